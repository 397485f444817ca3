"""The shape of the code, as tests: a scheme is one record (a toy eighth one scores through the
engine and the CLI; tests/rpc/test_toy_scheme.py takes it through the server), no scheme name is a
string outside the registry, auto runs once per call through a server, every front end takes its
options from one definition, and the Ray deployment handles no call itself."""

from __future__ import annotations

import ast
import asyncio
import functools
import itertools
import json
import random
from dataclasses import fields
from pathlib import Path

import grpc
import pytest
import torch
from grpc_health.v1.health import aio as health_aio

from scorer import cli
from scorer.planning import REGISTRY
from scorer.planning.schemes import unregister
from scorer.request import Doc, ScoreOptions, ScoreRequest
from scorer.server.batcher import BatchPolicy
from scorer.server.handler import CallHandler
from scorer.server.lifecycle import grpc_server
from scorer.server.scoring import ScoringService
from scorer.server.servicer import ScorerServicer
from scorer.settings import RAY, SCORE, SERVE, Settings, names_for
from scorer.v1 import scorer_pb2 as pb
from scorer.v1 import scorer_pb2_grpc

PACKAGE = Path(__file__).resolve().parents[1] / "scorer"
REGISTRY_FILE = PACKAGE / "planning" / "schemes.py"


@pytest.fixture
def toy():
    """The toy scheme registered for one test (it must not leak into the others)."""
    import toy_scheme

    toy_scheme.register()
    yield toy_scheme.TOY
    unregister(toy_scheme.TOY)


def _request(scheme: str, seed: int = 0, n_docs: int = 4) -> ScoreRequest:
    rng = random.Random(seed)
    docs = [
        Doc(token_ids=tuple(rng.randrange(256) for _ in range(rng.randint(1, 30))), id=str(i))
        for i in range(n_docs)
    ]
    prompt = tuple(rng.randrange(256) for _ in range(rng.randint(1, 60)))
    return ScoreRequest(
        "", docs, prompt_token_ids=prompt, options=ScoreOptions(scheme=scheme, template="plain")
    )


def _logprobs(result) -> torch.Tensor:
    return torch.tensor([d.label_logprobs for d in result.results], dtype=torch.float64)


def test_no_scheme_name_is_a_string_literal_outside_the_registry():
    names = set(REGISTRY)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == REGISTRY_FILE or path.parent.name == "v1":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.value!r}")
    assert not found, found


def test_a_toy_eighth_scheme_registered_as_one_record_scores_through_the_engine(engine, toy):
    for seed in range(5):
        got = engine.score(_request(toy, seed))
        want = engine.score(_request("naive", seed))
        assert got.scheme == toy
        torch.testing.assert_close(_logprobs(got), _logprobs(want), atol=1e-4, rtol=0)
        assert got.usage.tokens_computed == engine.score(_request("ragged", seed)).usage.tokens_computed
    batch = [engine.tokenize(_request(s, 7)) for s in (toy, "multi_item", toy)]  # mixed with another
    for r in engine.score_batch(batch):
        torch.testing.assert_close(
            _logprobs(r), _logprobs(engine.score(_request("naive", 7))), atol=1e-4, rtol=0
        )


def test_a_toy_scheme_scores_through_the_cli(toy, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SCORER_CACHE_DIR", str(tmp_path / "cache"))
    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in ("alpha beta", "gamma", "delta epsilon")))
    out = {}
    for scheme in (toy, "naive"):
        assert (
            cli.main(["score", "--prompt", "q", "--docs", str(docs), "--scheme", scheme, "--device", "cpu"])
            == 0
        )
        out[scheme] = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["scheme"] for r in out[toy]] == [toy] * 3
    for a, b in zip(out[toy], out["naive"], strict=True):
        assert a["index"] == b["index"] and a["score"] == pytest.approx(b["score"], abs=1e-4)


def test_auto_resolves_once_per_call_through_the_server(engine):
    """Through a real gRPC server in process: the auto policy runs exactly once per call (it used to
    run when the call was tokenized, when its scheme was logged, when the batcher counted its tokens
    and when the batch was planned)."""
    calls = []
    policy = engine.auto.__wrapped__

    def counting(shape):
        calls.append(shape)
        return policy(shape)

    engine.auto = counting
    try:
        replies = asyncio.run(_through_a_server(engine, [_request("auto", seed) for seed in range(6)]))
    finally:
        engine.auto = functools.lru_cache(maxsize=4096)(policy)
    assert len(calls) == 6 and all(r.scheme == "ragged" for r in replies)


async def _through_a_server(engine, requests: list[ScoreRequest]):
    handler = CallHandler()
    handler.service = ScoringService(engine, BatchPolicy(max_wait_s=0.01))
    handler.service.start()
    server, port = grpc_server(Settings(port=0), ScorerServicer(handler), health_aio.HealthServicer())
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = scorer_pb2_grpc.ScorerStub(channel)
            return await asyncio.gather(*(stub.ScoreDocs(_to_proto(r), timeout=30) for r in requests))
    finally:
        await server.stop(0)
        await handler.service.close()


def _to_proto(r: ScoreRequest) -> pb.ScoreDocsRequest:
    return pb.ScoreDocsRequest(
        prompt_token_ids=r.prompt_token_ids,
        docs=[pb.Doc(id=d.id, token_ids=d.token_ids) for d in r.docs],
        options=pb.ScoreOptions(scheme=r.options.scheme, template=r.options.template),
    )


def test_a_plan_error_while_serving_fails_that_call_and_the_server_keeps_its_backend(engine, monkeypatch):
    backend = engine.runner.backend
    real_plan, failed = backend.plan, []

    def plan_once_broken(p):
        if not failed:
            failed.append(p)
            raise RuntimeError("a kernel that cannot plan")
        return real_plan(p)

    monkeypatch.setattr(backend, "plan", plan_once_broken)

    async def scenario():
        first = await _through_a_server_raw(engine, _request("ragged", 1))
        second = await _through_a_server_raw(engine, _request("ragged", 2))
        return first, second

    (code1, _), (code2, reply) = asyncio.run(scenario())
    assert code1 == grpc.StatusCode.INTERNAL and code2 == grpc.StatusCode.OK and len(reply.results) == 4
    assert engine.runner.backend is backend and backend.name == "torch"


async def _through_a_server_raw(engine, request: ScoreRequest):
    try:
        (reply,) = await _through_a_server(engine, [request])
        return grpc.StatusCode.OK, reply
    except grpc.aio.AioRpcError as e:
        return e.code(), None


def test_serve_score_and_ray_take_their_options_from_one_definition():
    from scorer.ray_serve import ScorerArgs

    parser = cli.build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices
    dests = {name: {a.dest for a in p._actions if a.dest != "help"} for name, p in sub.items()}
    assert dests["serve"] == set(names_for(SERVE))
    request_options = {f.name for f in fields(ScoreOptions)}
    assert dests["score"] == set(names_for(SCORE)) | request_options | {"prompt", "docs", "instruction"}
    assert set(ScorerArgs.model_fields) == set(names_for(RAY))
    assert set(names_for(SCORE)) <= set(names_for(SERVE)) & set(names_for(RAY))
    with pytest.raises(ValueError, match="attention_backend"):
        Settings(attention_backend="tpu")


def test_the_ray_deployment_handles_no_call_itself():
    """Status mapping, trailers, counting and the log line live in server/handler.py only."""
    source = (PACKAGE / "ray_serve.py").read_text()
    for own in (
        "status_for",
        "REQUEST_ID_KEY",
        "x-request-id",
        "observe_request",
        "open_call",
        "StatusCode.INTERNAL",
    ):
        assert own not in source, own
    assert "CallHandler" in source and "score_docs" in source


def import_graph(package: Path) -> dict[str, dict[str, int]]:
    """Each module of ``package`` -> the modules of ``package`` it imports, with the line of the
    first such import. Every import statement counts, at module level, in a function or under
    ``TYPE_CHECKING``: a circle through a function-level import still ties the two modules
    together (neither can be read, tested or moved alone), and only hides it until call time.
    Importing ``a.b.c`` runs ``a/__init__.py`` and ``a/b/__init__.py`` first, so it is an import
    of those packages too (not of the importer's own packages, which are imported before it)."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str:  # ``scorer.planning.names``, a function -> ``scorer.planning``
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        own = {here.rsplit(".", k)[0] for k in range(here.count(".") + 1)}
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(
                        [*here.split(".")[: here.count(".") + 2 - node.level], *filter(None, [base])]
                    )
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] != package.name:
                    continue
                target = known(target)
                for k in range(target.count(".") + 1):
                    imported = target.rsplit(".", k)[0]
                    if imported != name and imported not in own:
                        edges.setdefault(imported, node.lineno)
        graph[name] = edges
    return graph


def import_circles(graph: dict[str, dict[str, int]]) -> list[str]:
    """Every circle of imports (one per strongly connected set of modules), as ``a:12 -> b:3 -> a``."""
    order, low, stack, circles = {}, {}, [], []

    def visit(v: str) -> None:
        order[v] = low[v] = len(order)
        stack.append(v)
        for w in graph[v]:
            if w not in order:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], order[w])
        if low[v] == order[v]:
            members = set(stack[stack.index(v) :])
            del stack[stack.index(v) :]
            if len(members) > 1:
                parent, queue = {v: None}, [v]
                for at in queue:  # breadth first inside the set: the shortest circle through v
                    for w in sorted(graph[at]):
                        if w in members and w not in parent:
                            parent[w] = at
                            queue.append(w)
                path = [next(u for u in queue if v in graph[u])]
                while parent[path[0]] is not None:
                    path.insert(0, parent[path[0]])
                path.append(v)
                path = [f"{a}:{graph[a][b]}" for a, b in itertools.pairwise(path)] + [v]
                circles.append(" -> ".join(path))

    for v in sorted(graph):
        if v not in order:
            visit(v)
    return circles


def test_the_import_circle_check_finds_a_circle_through_a_function_level_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .b import f\n")
    (pkg / "a.py").write_text("import os\n\nfrom .sub.c import g\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    (pkg / "sub" / "c.py").write_text("from . import b\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.c": 3, "pkg.sub": 3}  # the package's __init__ runs first
    assert graph["pkg.sub.c"] == {"pkg.sub.b": 1}
    assert import_circles(graph) == ["pkg.a:3 -> pkg.sub:1 -> pkg.sub.b:2 -> pkg.a"]
    (pkg / "sub" / "b.py").write_text("def f():\n    pass\n")
    assert import_circles(import_graph(pkg)) == []


def test_no_module_of_scorer_is_in_an_import_circle():
    circles = import_circles(import_graph(PACKAGE))
    assert not circles, "import circles (module:line of the import):\n" + "\n".join(circles)


def test_settings_import_nothing_of_the_server():
    """The server reads the settings; the settings know nothing of the server."""
    upward = {
        m: line
        for m, line in import_graph(PACKAGE)["scorer.settings"].items()
        if m.startswith("scorer.server")
    }
    assert not upward, f"scorer/settings.py imports {upward} (module: line)"
