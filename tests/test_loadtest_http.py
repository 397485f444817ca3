"""The load tool's HTTP mode (``loadtest.run --api cohere|jina|tei``): each API's body and the
status mapping, the refusal of token-id sets, deadlines and overload against the stub's HTTP routes,
and short open-loop runs against the real server's ``--http-port``, reconciled with its metrics
under the call's ``api`` label and compared with a gRPC run by ``report compare``."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest import capacity, gen, http_api, report, run
from loadtest import metrics as lm
from loadtest.driver import DriveConfig, drive
from scorer.models.tiny import ensure_tiny_model
from scorer.server.http import SHAPES
from scorer.v1 import scorer_pb2 as pb

sys.path.insert(0, str(Path(__file__).resolve().parent / "rpc"))
from rpc_harness import ServerProcess, free_port, start_server  # noqa: E402

HTTP_APIS = ("cohere", "jina", "tei")
PATHS = {"cohere": "/v2/rerank", "jina": "/v1/rerank", "tei": "/rerank"}
TEXT = ["--docs", "5", "--prompt-tokens", "16", "--doc-tokens", "uniform:8:24"]
FAULT_PROMPT = "a query whose batch fails"
MAX_DOC_TOKENS = 256
LONG_DOC = "caching " * (4 * MAX_DOC_TOKENS)  # a token a word at least: over --max-doc-tokens


def _gen(path: Path, *args: str) -> list[pb.ScoreDocsRequest]:
    assert gen.main(["--out", str(path), *args]) == 0
    return gen.read_jsonl(path)


def _report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


def _request(**options) -> pb.ScoreDocsRequest:
    return pb.ScoreDocsRequest(
        prompt="which passage explains prefix caching",
        docs=[pb.Doc(id="a", text="the prompt is computed once"), pb.Doc(id="b", text="bread rises")],
        request_id="lt1-000007",
        options=pb.ScoreOptions(**options),
    )


# --- the bodies, the answers' codes, refusals -----------------------------------------------------


@pytest.mark.parametrize(
    ("api", "want"),
    [
        (
            "cohere",
            {
                "query": "which passage explains prefix caching",
                "documents": ["the prompt is computed once", "bread rises"],
                "top_n": 1,
                "max_tokens_per_doc": 32,
            },
        ),
        (
            "jina",
            {
                "query": "which passage explains prefix caching",
                "documents": ["the prompt is computed once", "bread rises"],
                "top_n": 1,
                "return_documents": False,
            },
        ),
        (
            "tei",
            {
                "query": "which passage explains prefix caching",
                "texts": ["the prompt is computed once", "bread rises"],
                "truncate": True,
            },
        ),
    ],
)
def test_each_api_body_is_what_the_server_reads_back_as_the_same_call(api: str, want: dict) -> None:
    req = _request(scheme="auto", top_n=1, max_doc_tokens=32, truncate="doc_end")
    (call,) = http_api.compile_calls([req], api)
    assert json.loads(call.payload) == want
    assert (call.scheme, call.docs, call.request_id) == ("auto", 2, "lt1-000007")
    shape = SHAPES[PATHS[api]]
    back = shape.to_request(shape.body.model_validate_json(call.payload))
    assert back.prompt == req.prompt and [d.text for d in back.docs] == [d.text for d in req.docs]
    assert back.options.top_n == (0 if api == "tei" else 1)  # TEI's body has no top_n
    assert back.options.truncate == "doc_end"
    assert back.options.max_doc_tokens == (32 if api == "cohere" else 0)
    not_sent = {
        "cohere": [],
        "jina": ["options.max_doc_tokens"],
        "tei": ["options.max_doc_tokens", "options.top_n"],
    }
    assert http_api.dropped(api, req) == not_sent[api]


def test_what_a_body_cannot_carry_is_named() -> None:
    req = _request(scheme="naive", template="plain", group_size=4, truncate="error")
    req.instruction = "judge it"
    assert http_api.dropped("cohere", req) == [
        "instruction",
        "options.scheme",
        "options.template",
        "options.truncate",  # Cohere and Jina always cut a long document
        "options.group_size",
    ]
    assert "options.truncate" not in http_api.dropped("tei", req)  # TEI refuses one, as "error" does
    assert http_api.dropped("jina", _request(scheme="auto")) == []
    assert http_api.check_text([req, _request()], "jina") == {
        "instruction": 1,
        "options.scheme": 1,
        "options.template": 1,
        "options.truncate": 1,
        "options.group_size": 1,
    }


def _error(code: str, message: str = "x") -> bytes:
    return json.dumps({"message": message, "field": "", "code": code, "request_id": "r"}).encode()


@pytest.mark.parametrize(
    ("status", "answer", "code"),
    [
        (200, b'{"results": []}', "OK"),
        (400, _error("INVALID_ARGUMENT", "query: empty query"), "INVALID_ARGUMENT"),
        (400, b"", "INVALID_ARGUMENT"),
        (413, _error("INVALID_ARGUMENT", "documents[0]: over 256 tokens"), "INVALID_ARGUMENT"),
        (413, _error("RESOURCE_EXHAUSTED", "body: over --max-message-bytes"), "RESOURCE_EXHAUSTED"),
        (413, b"<html>Request Entity Too Large</html>", "INVALID_ARGUMENT"),
        (429, _error("RESOURCE_EXHAUSTED", "queue full"), "RESOURCE_EXHAUSTED"),
        (429, b"", "RESOURCE_EXHAUSTED"),
        (503, _error("UNAVAILABLE", "the model is loading"), "UNAVAILABLE"),
        (503, b"", "UNAVAILABLE"),
        (504, _error("DEADLINE_EXCEEDED"), "DEADLINE_EXCEEDED"),
        (504, b"upstream timed out", "DEADLINE_EXCEEDED"),
        (401, _error("UNAUTHENTICATED"), "UNAUTHENTICATED"),
        (401, b"", "UNAUTHENTICATED"),
        (500, _error("INTERNAL", "a fault"), "INTERNAL"),
        (502, b"<html>Bad Gateway</html>", "UNKNOWN"),
        (418, b"", "UNKNOWN"),
        (500, _error("NOT_A_CODE"), "INTERNAL"),  # a code that is no gRPC code: the status's
        (503, _error("OK"), "UNAVAILABLE"),  # "OK" on a failure is not believed
    ],
)
def test_answers_are_counted_by_the_body_code_else_by_the_status(
    status: int, answer: bytes, code: str
) -> None:
    got, message = http_api.status_code(status, answer)
    assert got == code
    assert message == "" if status == 200 else message.startswith(f"HTTP {status}")


def test_an_error_example_keeps_the_server_message() -> None:
    assert http_api.status_code(429, _error("RESOURCE_EXHAUSTED", "queue full")) == (
        "RESOURCE_EXHAUSTED",
        "HTTP 429: queue full",
    )


@pytest.mark.parametrize("api", HTTP_APIS)
def test_a_token_id_set_is_refused_at_start_in_http_mode(
    api: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    req = tmp_path / "ids.jsonl"
    _gen(req, "--requests", "4", *TEXT, "--token-ids")
    argv = ["--api", api, "--target", "127.0.0.1:1", "--requests", str(req), "--rate", "5", "--duration", "1"]
    with pytest.raises(SystemExit) as exited:
        run.main([*argv, "--out", str(tmp_path / "out")])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "4 of 4 requests carry token ids" in err and f"--api {api} cannot send them" in err
    assert f"POST {PATHS[api]} body takes text only" in err and "without --token-ids" in err
    assert not (tmp_path / "out").exists()


def test_one_token_id_request_among_text_ones_is_named(tmp_path: Path) -> None:
    reqs = _gen(tmp_path / "t.jsonl", "--requests", "3", *TEXT)
    reqs[2].docs[1].ClearField("text")
    reqs[2].docs[1].token_ids.extend([40, 41])
    with pytest.raises(ValueError, match=r"1 of 3 requests carry token ids .*request 3, lt0-000002"):
        http_api.compile_calls(reqs, "cohere")


def test_options_that_cannot_apply_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    req = tmp_path / "t.jsonl"
    _gen(req, "--requests", "2", *TEXT)
    base = ["--requests", str(req), "--rate", "5", "--duration", "1", "--out", str(tmp_path / "o")]
    for argv, message in [
        (["--api", "cohere", "--schemes", "naive"], "--api cohere runs every call as scheme auto"),
        (["--api-key", "k"], "--api-key and --http-client are for an HTTP --api"),
    ]:
        with pytest.raises(SystemExit):
            run.main([*argv, *base])
        assert message in capsys.readouterr().err


def test_the_servers_counts_are_read_for_the_runs_api() -> None:
    text = (
        'scorer_requests_total{api="grpc",scheme="naive",code="OK"} 7\n'
        'scorer_requests_total{api="cohere",scheme="naive",code="OK"} 10\n'
        'scorer_requests_total{api="cohere",scheme="none",code="RESOURCE_EXHAUSTED"} 2\n'
        'scorer_requests_total{api="tei",scheme="naive",code="OK"} 5\n'
        'scorer_errors_total{api="cohere",code="RESOURCE_EXHAUSTED"} 2\n'
        'scorer_errors_total{api="grpc",code="INTERNAL"} 1\n'
        'scorer_docs_scored_total{scheme="naive"} 30\n'
    )
    cohere = lm.parse(text, "cohere")
    assert cohere.requests_by_code == {"OK": 10, "RESOURCE_EXHAUSTED": 2}
    assert cohere.errors_by_code == {"RESOURCE_EXHAUSTED": 2} and cohere.docs == 30  # docs: no api label
    assert lm.parse(text, "grpc").requests_by_code == {"OK": 7}
    assert lm.parse(text).requests == 24  # every front end
    unlabelled = 'scorer_requests_total{scheme="naive",code="OK"} 3\n'  # a server without the label
    assert lm.parse(unlabelled, "jina").requests == 3


def test_headers_carry_the_deadline_request_id_and_key() -> None:
    calls = http_api.compile_calls([_request(), _request()], "tei")
    cfg = DriveConfig(
        target="127.0.0.1:8080", duration_s=1, rate=1, deadline_s=0.25, api="tei", api_key="sekret"
    )
    driver = http_api.HttpDriver(cfg, calls)
    assert driver.url == "http://127.0.0.1:8080/rerank"
    assert driver.headers[0] == {
        "content-type": "application/json",
        "x-timeout-ms": "250",
        "authorization": "Bearer sekret",
        "x-request-id": "lt1-000007",
    }
    assert driver.headers[1] is driver.headers[0]  # one dict per request id
    assert http_api.base_url("https://scorer.example:8443/") == "https://scorer.example:8443"


# --- against the stub's HTTP routes ----------------------------------------------------------------


@pytest.fixture(scope="module")
def http_stub() -> Iterator[tuple[str, str]]:
    with capacity.stub_server("--metrics-port", "0", http=True) as (target, metrics_url):
        yield target, metrics_url


@pytest.mark.parametrize("client", http_api.CLIENTS)
@pytest.mark.parametrize("api", HTTP_APIS)
def test_closed_loop_over_each_client_and_api(
    http_stub: tuple[str, str], tmp_path: Path, api: str, client: str
) -> None:
    target, metrics_url = http_stub
    req = tmp_path / "t.jsonl"
    _gen(req, "--requests", "7", *TEXT)
    out = tmp_path / "out"
    argv = ["--api", api, "--http-client", client, "--target", target, "--requests", str(req)]
    argv += ["--concurrency", "4", "--max-requests", "40", "--duration", "10", "--metrics-url", metrics_url]
    assert run.main([*argv, "--out", str(out), "--quiet", "--no-samples"]) == 0
    rep = _report(out)
    assert rep["by_code"] == {"OK": 40} and rep["mode"] == "closed"
    assert rep["runs"][0]["label"] == f"{api} auto x4 concurrent" and rep["config"]["http_client"] == client
    assert rep["server"]["matched"] and rep["server"]["api"] == api, rep["server"]
    assert rep["achieved_docs_per_s"] > 0


def test_a_504_at_the_deadline_is_deadline_exceeded_and_reconciles(tmp_path: Path) -> None:
    """The stub takes 300 ms a call and answers 504 once X-Timeout-Ms (50) passes."""
    req = tmp_path / "t.jsonl"
    _gen(req, "--requests", "5", *TEXT)
    with capacity.stub_server("--service-ms", "300", "--metrics-port", "0", http=True) as (target, metrics):
        out = tmp_path / "out"
        argv = [
            "--api",
            "jina",
            "--target",
            target,
            "--requests",
            str(req),
            "--rate",
            "20",
            "--duration",
            "1",
        ]
        argv += ["--deadline-ms", "50", "--metrics-url", metrics, "--out", str(out), "--quiet"]
        assert run.main(argv) == 0
    rep = _report(out)
    assert rep["by_code"] == {"DEADLINE_EXCEEDED": 20}
    assert rep["error_examples"]["DEADLINE_EXCEEDED"].startswith("HTTP 504")
    assert 0.05 <= rep["latency_seconds_all"]["p50"] < 0.3  # the server's 504, not the 300 ms answer
    assert rep["server"]["matched"], rep["server"]


def test_a_call_unanswered_past_its_deadline_is_given_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client gives up before the server's 504 arrives (no grace left for it)."""
    monkeypatch.setattr(http_api, "GRACE_S", -0.05)
    reqs = _gen(tmp_path / "t.jsonl", "--requests", "3", *TEXT)
    with capacity.stub_server("--service-ms", "300", http=True) as (target, _):
        cfg = DriveConfig(
            target=target,
            duration_s=5,
            concurrency=2,
            max_requests=6,
            deadline_s=0.1,
            progress_s=0,
            api="tei",
        )
        s = drive(cfg, http_api.compile_calls(reqs, "tei"))
    assert s.code == ["DEADLINE_EXCEEDED"] * 6
    assert s.error_examples["DEADLINE_EXCEEDED"] == "no answer within the 100 ms deadline"
    assert max(s.latency) < 0.3


def test_overload_of_the_http_stub_is_reported(tmp_path: Path) -> None:
    """2 workers x 20 ms = 100 calls/s, 4 waiting at most; offered 300/s: 429s by the body's code."""
    req = tmp_path / "t.jsonl"
    _gen(req, "--requests", "10", *TEXT)
    stub = ("--workers", "2", "--service-ms", "20", "--queue", "4", "--metrics-port", "0")
    with capacity.stub_server(*stub, http=True) as (target, metrics):
        out = tmp_path / "over"
        argv = ["--api", "cohere", "--target", target, "--requests", str(req), "--rate", "300"]
        argv += ["--duration", "1.5", "--metrics-url", metrics, "--out", str(out), "--quiet"]
        assert run.main(argv) == 0
    rep = _report(out)
    assert rep["saturation"]["saturated"]
    assert rep["by_code"]["RESOURCE_EXHAUSTED"] > 100
    assert rep["error_examples"]["RESOURCE_EXHAUSTED"] == "HTTP 429: stub: RESOURCE_EXHAUSTED"
    assert rep["server"]["matched"], rep["server"]


@pytest.mark.slow
def test_http_generator_sustains_1000_tiny_calls_per_second() -> None:
    """HTTP mode's own limit against the stub (2 cores in CI, shared with the stub): aiohttp
    measured 2,000 sustained at about 225 us of CPU a call on a 2-core VM; up to five tries."""
    for _ in range(5):
        step = capacity.run([1000.0], duration_s=3.0, concurrency=32, api="cohere")["open_loop"][0]
        if step["failed"] == 0 and step["achieved_rps"] >= 950 and step["lag_p99_ms"] < 100:
            break
    assert step["failed"] == 0, step
    assert step["achieved_rps"] >= 900, step
    assert step["lag_p99_ms"] < 100, step
    assert step["driver_cpu_us_per_call"] < 1000, step


# --- against the real server's --http-port ----------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, int]]:
    """``python -m scorer.server --http-port`` on the tiny CPU model; one torch thread, so that on a
    2-core runner the forward leaves the generator a core."""
    cache = tmp_path_factory.mktemp("scorer-cache")
    ensure_tiny_model(cache)
    http_port = free_port()
    args = ["--http-port", str(http_port), "--max-queue", "64", "--max-doc-tokens", str(MAX_DOC_TOKENS)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        proc = start_server(
            cache, tmp_path_factory.mktemp("server-logs"), [*args, "--debug-fault-prompt", FAULT_PROMPT]
        )
    yield proc, http_port
    assert proc.stop() == 0, proc.log()


def _metrics_url(proc: ServerProcess) -> str:
    return f"http://127.0.0.1:{proc.metrics_port}/metrics"


def _run(server: tuple[ServerProcess, int], api: str, req: Path, out: Path, *more: str) -> dict:
    proc, http_port = server
    target = proc.target if api == "grpc" else f"127.0.0.1:{http_port}"
    argv = ["--api", api, "--target", target, "--requests", str(req), "--metrics-url", _metrics_url(proc)]
    assert run.main([*argv, *more, "--out", str(out), "--quiet"]) == 0
    return _report(out)


@pytest.mark.parametrize("api", HTTP_APIS)
def test_a_short_open_loop_run_in_each_api_reconciles_under_its_api_label(
    server: tuple[ServerProcess, int], tmp_path: Path, api: str
) -> None:
    proc, _ = server
    req = tmp_path / "reqs.jsonl"
    _gen(req, "--requests", "20", *TEXT, "--seed", "1")
    before = {a: proc.metric("scorer_requests_total", api=a) for a in ("grpc", *HTTP_APIS)}
    rep = _run(server, api, req, tmp_path / "report", "--rate", "8", "--duration", "3")
    assert rep["offered_rps"] == 8 and rep["requests"] == 24
    assert rep["failed"] == 0 and rep["by_code"] == {"OK": 24}, rep["error_examples"]
    assert [(r["label"], r["scheme"], r["api"]) for r in rep["runs"]] == [(f"{api} auto @ 8/s", "auto", api)]
    assert rep["config"]["api"] == api and rep["config"]["api_path"] == PATHS[api]
    assert rep["achieved_rps"] > 0 and rep["achieved_docs_per_s"] == pytest.approx(5 * rep["achieved_rps"])
    assert 0 < rep["latency_seconds"]["p50"] <= rep["latency_seconds"]["p99"] < 5
    rec = rep["server"]
    assert rec["matched"] and rec["api"] == api, rec
    assert rec["rows"]["requests"]["server"] == 24 and rec["rows"]["docs"]["server"] == 120
    assert rec["server_requests_by_code"] == {"OK": 24}
    after = {a: proc.metric("scorer_requests_total", api=a) for a in before}
    assert {a: after[a] - before[a] for a in before} == {a: 24 if a == api else 0 for a in before}
    md = (tmp_path / "report" / "report.md").read_text()
    assert f"over HTTP {api} `POST {PATHS[api]}`" in md
    assert f'`api="{api}"` calls' in md and "client and server counts match" in md


def test_grpc_and_cohere_side_by_side_with_report_compare(
    server: tuple[ServerProcess, int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    req = tmp_path / "reqs.jsonl"
    _gen(req, "--requests", "20", *TEXT, "--seed", "2")
    load = ("--rate", "8", "--duration", "2")
    reps = {api: _run(server, api, req, tmp_path / api, *load) for api in ("grpc", "cohere")}
    for api, rep in reps.items():
        assert rep["by_code"] == {"OK": 16} and rep["server"]["matched"], rep
        assert rep["server"]["api"] == api
    assert reps["grpc"]["runs"][0]["label"] == "auto @ 8/s"
    assert reps["grpc"]["per_scheme"]["auto"]["ran"]  # gRPC answers name the scheme that ran
    assert reps["cohere"]["per_scheme"]["auto"]["ran"] == {}  # the rerank answers do not
    capsys.readouterr()
    assert report.main(["compare", str(tmp_path / "grpc"), str(tmp_path / "cohere")]) == 0
    out, err = capsys.readouterr()
    assert "## auto @ 8/s vs cohere auto @ 8/s" in out and "warning" not in err
    assert f"- {tmp_path / 'grpc'}: `{server[0].target}` over gRPC ScoreDocs" in out
    assert f"over HTTP cohere `POST /v2/rerank` ({reps['cohere']['config']['http_client']})" in out
    assert "| achieved docs/s |" in out and "| latency p99 ms |" in out


def test_failed_http_calls_are_counted_by_the_servers_code_and_reconcile(
    server: tuple[ServerProcess, int], tmp_path: Path
) -> None:
    """TEI refuses a text over --max-doc-tokens (413, INVALID_ARGUMENT in the body); a call whose
    batch fails is 500 INTERNAL."""
    reqs = _gen(tmp_path / "base.jsonl", "--requests", "10", *TEXT, "--seed", "3")
    for i, r in enumerate(reqs):
        if i % 5 == 1:
            r.prompt = FAULT_PROMPT
        elif i % 5 == 3:
            r.docs[2].text = LONG_DOC
    req = tmp_path / "mixed.jsonl"
    gen.write_jsonl(reqs, req)
    rep = _run(server, "tei", req, tmp_path / "out", "--rate", "10", "--duration", "2")
    assert rep["by_code"] == {"INTERNAL": 4, "INVALID_ARGUMENT": 4, "OK": 12}, rep["error_examples"]
    assert rep["error_examples"]["INVALID_ARGUMENT"].startswith("HTTP 413: texts[2]:")
    assert rep["error_examples"]["INTERNAL"].startswith("HTTP 500")
    assert rep["server"]["matched"], rep["server"]
