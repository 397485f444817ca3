"""The load-test tool: request generation, the driver against the stub and the real embedded server,
reports reconciled with /metrics, overload reporting, and the generator's own capacity."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loadtest import capacity, gen, report, run, stats
from loadtest import metrics as lm
from loadtest.driver import DriveConfig, Samples, compile_calls, drive, pause, schedule
from scorer.models.tiny import ensure_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parent / "rpc"))
from rpc_harness import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
PNG = b"\x89PNG\r\n\x1a\n"
SERVER_START_S = 120.0
SMALL = ["--docs", "5", "--prompt-tokens", "16", "--doc-tokens", "uniform:8:24", "--token-ids"]


def _serving(target: str) -> bool:
    with grpc.insecure_channel(target) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """The real embedded server (tiny model, CPU) on free loopback ports."""
    if importlib.util.find_spec("scorer.server") is None:
        pytest.skip("scorer.server is not importable yet: the real gRPC server has not landed")
    cache = tmp_path_factory.mktemp("scorer-cache")
    port, metrics_port = free_port(), free_port()
    log = tmp_path_factory.mktemp("server-log") / "server.log"
    cmd = [sys.executable, "-m", "scorer", "serve", "--port", str(port), "--metrics-port", str(metrics_port)]
    cmd += ["--drain-seconds", "0", "--max-queue", "64", "--device", "cpu"]
    # one torch thread: on a 2-core runner the server's forward must leave the generator a core
    env = {**os.environ, "SCORER_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    target = f"127.0.0.1:{port}"
    deadline = time.monotonic() + SERVER_START_S
    while not _serving(target):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"server did not start:\n{log.read_text()}")
        time.sleep(0.1)
    yield {"target": target, "metrics": f"http://127.0.0.1:{metrics_port}/metrics", "cache": cache}
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def stub() -> Iterator[tuple[str, str]]:
    with capacity.stub_server("--metrics-port", "0") as (target, metrics_url):
        yield target, metrics_url


def _gen(path: Path, *args: str) -> list:
    assert gen.main(["--out", str(path), *args]) == 0
    return gen.read_jsonl(path)


def _report(out: Path) -> dict:
    return json.loads((out / "report.json").read_text())


# --- generation ---------------------------------------------------------------------------------


def test_gen_is_seeded_and_follows_the_distributions(tmp_path: Path) -> None:
    args = ["--requests", "50", "--docs", "uniform:2:9", "--doc-tokens", "lognormal:20:0.5:60", "--seed", "3"]
    a = _gen(tmp_path / "a.jsonl", *args, "--scheme", "naive=3,cascade=1", "--token-ids")
    _gen(tmp_path / "b.jsonl", *args, "--scheme", "naive=3,cascade=1", "--token-ids")
    _gen(tmp_path / "c.jsonl", *args[:-1], "4", "--scheme", "naive=3,cascade=1", "--token-ids")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert (tmp_path / "a.jsonl").read_bytes() != (tmp_path / "c.jsonl").read_bytes()
    docs = [len(r.docs) for r in a]
    assert min(docs) >= 2 and max(docs) <= 9 and len(set(docs)) > 3
    lengths = [len(d.token_ids) for r in a for d in r.docs]
    assert max(lengths) <= 60 and 14 <= np.median(lengths) <= 27
    assert all(32 <= t < 256 for r in a for d in r.docs for t in d.token_ids)
    schemes = [r.options.scheme for r in a]
    assert set(schemes) == {"naive", "cascade"} and schemes.count("naive") > schemes.count("cascade")
    assert all(len(r.prompt_token_ids) == 30 and not r.prompt for r in a)
    assert len({r.request_id for r in a}) == 50


def test_gen_text_has_exact_token_counts_with_a_tokenizer(tmp_path: Path) -> None:
    tok_dir = ensure_tiny_model(tmp_path / "cache")
    tokenizer = gen.load_tokenizer(str(tok_dir))
    reqs = _gen(
        tmp_path / "t.jsonl", "--requests", "5", "--docs", "4", "--prompt-tokens", "12",
        "--doc-tokens", "fixed:25", "--tokenizer", str(tok_dir), "--distinct-prompts", "2",
    )  # fmt: skip
    for r in reqs:
        assert abs(len(tokenizer.encode(r.prompt, add_special_tokens=False).ids) - 12) <= 1
        for d in r.docs:
            assert d.text and abs(len(tokenizer.encode(d.text, add_special_tokens=False).ids) - 25) <= 1
    assert reqs[0].prompt == reqs[2].prompt != reqs[1].prompt


def test_gen_prompt_reuse_sends_each_context_on_consecutive_calls(tmp_path: Path) -> None:
    reqs = _gen(
        tmp_path / "r.jsonl", "--requests", "7", "--docs", "2", "--prompt-tokens", "40",
        "--token-ids", "--prompt-reuse", "3",
    )  # fmt: skip
    prompts = [tuple(r.prompt_token_ids) for r in reqs]
    assert prompts[0] == prompts[1] == prompts[2] != prompts[3] == prompts[4] == prompts[5] != prompts[6]
    assert len(set(prompts)) == 3


@pytest.mark.parametrize(("prompt", "doc"), [(300, 50), (30, 8)], ids=["A", "short"])
def test_gen_text_without_a_tokenizer_has_the_asked_lengths_on_the_embedded_tokenizer(
    tmp_path: Path, prompt: int, doc: int
) -> None:
    """The built-in word list counted at the default 1.3 tokens a word comes within 10% of the
    asked lengths on the embedded default's BPE tokenizer, counted as the server counts them
    (template plain: the prompt alone is the prefix, each doc alone an item)."""
    from transformers import AutoTokenizer

    from scorer.models import tiny
    from scorer.planning import get
    from scorer.request import Limits, tokenize
    from scorer.server.convert import request_from_proto

    tokenizer = AutoTokenizer.from_pretrained(str(ensure_tiny_model(tmp_path / "cache")))
    reqs = _gen(
        tmp_path / "a.jsonl", "--requests", "40", "--docs", "10", "--prompt-tokens", str(prompt),
        "--doc-tokens", f"fixed:{doc}", "--template", "plain", "--seed", "3",
    )  # fmt: skip
    limits = Limits(max_docs=10, max_doc_tokens=4096, max_positions=1 << 20, vocab_size=tiny.VOCAB_SIZE)
    ragged = lambda *_: (get("ragged"), 0)  # noqa: E731
    jobs = [tokenize(request_from_proto(r, "t"), tokenizer, limits, ragged) for r in reqs]
    prompts = [len(j.prefix_ids) for j in jobs]
    docs = [n for j in jobs for n in j.doc_tokens]
    assert len(docs) == 400 and not any(t for j in jobs for t in j.truncated)
    assert abs(np.mean(prompts) / prompt - 1) <= 0.1, np.mean(prompts)
    assert abs(np.mean(docs) / doc - 1) <= 0.1, np.mean(docs)


def test_gen_corpus_and_length_file(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("alpha beta gamma delta epsilon zeta eta theta iota kappa\n" * 5)
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("# doc lengths from logs\n7\n7\n7\n")
    reqs = _gen(
        tmp_path / "c.jsonl", "--requests", "3", "--corpus", str(corpus),
        "--doc-tokens", f"file:{lengths}", "--tokens-per-word", "1",
    )  # fmt: skip
    for d in (d for r in reqs for d in r.docs):
        words = d.text.split()
        assert len(words) == 7 and " ".join(words) in corpus.read_text().replace("\n", " ") * 2


@pytest.mark.parametrize("spec", ["uniform:5:2", "lognormal:0:1", "normal:3:1", "fixed", "x"])
def test_bad_distributions_are_refused(spec: str) -> None:
    with pytest.raises(Exception, match="bad distribution"):
        gen.parse_dist(spec)


# --- driver and report pieces -------------------------------------------------------------------


def test_schedule_is_bounded_and_offers_the_rate() -> None:
    poisson = schedule(100.0, 2.0, "poisson", seed=1)
    assert len(poisson) == 200 and np.all(np.diff(poisson) >= 0) and poisson[-1] < 2.0
    gaps = np.diff(poisson)
    assert gaps.std() > 0.5 * gaps.mean()  # Poisson bursts, not a metronome
    constant = schedule(100.0, 2.0, "constant", seed=1)
    assert np.allclose(np.diff(constant), 0.01)
    assert len(schedule(100.0, 2.0, "poisson", seed=1, max_requests=30)) == 30
    with pytest.raises(ValueError):
        DriveConfig(target="x", duration_s=1e9, rate=1).validate()
    with pytest.raises(ValueError):
        DriveConfig(target="x", duration_s=1, rate=1, concurrency=2).validate()
    with pytest.raises(ValueError, match="spin"):
        DriveConfig(target="x", duration_s=1, rate=1, spin_s=-0.001).validate()


def test_the_open_loop_sleeps_until_its_spin_then_yields() -> None:
    assert pause(0.010, 0.001) == pytest.approx(0.009)
    assert pause(0.0008, 0.001) == 0.0  # inside the spin: a yield, not a sleep
    assert pause(0.010, 0.0) == 0.010  # --spin-ms 0: sleep to the send time


def _samples(latencies: list[float], codes: list[str] | None = None) -> Samples:
    n = len(latencies)
    s = Samples(
        sched=[i * 0.01 for i in range(n)],
        lag=[0.0] * n,
        latency=latencies,
        code=codes or ["OK"] * n,
        scheme=["naive"] * n,
        ran=["naive"] * n,
        docs=[3] * n,
    )
    s.wall_s = n * 0.01
    return s


def test_saturation_signs() -> None:
    cfg = DriveConfig(target="x", duration_s=3.0, rate=100.0)
    calm = stats.summarize(_samples([0.01] * 300), cfg)
    assert not calm["saturation"]["saturated"], calm["saturation"]
    assert calm["achieved_rps"] == pytest.approx(100, rel=0.01)
    assert calm["achieved_docs_per_s"] == pytest.approx(300, rel=0.01)
    rising = stats.summarize(_samples([0.01 + 0.005 * i for i in range(300)]), cfg)
    assert any("latency rising" in r for r in rising["saturation"]["reasons"])
    shed = stats.summarize(_samples([0.01] * 300, ["OK", "RESOURCE_EXHAUSTED"] * 150), cfg)
    assert any("RESOURCE_EXHAUSTED 150" in r for r in shed["saturation"]["reasons"])


def test_metrics_parse_and_reconcile() -> None:
    text = (
        'scorer_requests_total{scheme="naive",code="OK"} 10\n'
        'scorer_requests_total{scheme="none",code="CANCELLED"} 2\n'
        'scorer_errors_total{code="CANCELLED"} 2\n'
        'scorer_docs_scored_total{scheme="naive"} 30\n'
    )
    counts = lm.parse(text).minus(lm.ServerCounts())
    client = {"requests": 12, "failed": 2, "by_code": {"OK": 10, "DEADLINE_EXCEEDED": 2}, "docs_ok": 30}
    rec = lm.reconcile(client, counts)
    assert rec["matched"], rec
    assert rec["rows"][f"code {lm.DEADLINE_OR_CANCELLED}"] == {
        "client": 2,
        "server": 2,
        "diff": 0,
        "match": True,
    }
    client["docs_ok"] = 33
    rec = lm.reconcile(client, counts)
    assert not rec["matched"] and not rec["explained"], rec
    # one call answered OK on the server just after the client's deadline: explained, not matched
    late = {"requests": 12, "failed": 3, "by_code": {"OK": 9, "DEADLINE_EXCEEDED": 3}, "docs_ok": 27}
    rec = lm.reconcile(late, counts)
    assert not rec["matched"] and rec["explained"] and "1 call(s)" in rec["verdict"], rec


def test_the_final_scrape_waits_while_an_overloaded_server_still_answers_calls() -> None:
    """Calls the client gave up on finish on the server a batch at a time: the scrape waits as long
    as answers keep coming (each batch 4 s apart, longer than ``wait_s``), stops once the server
    has answered every call, and gives up ``wait_s`` after the last answer, or at ``most_s``. The
    clock is the test's: no sleeping."""
    now = [0.0]

    def clock() -> float:
        return now[0]

    def sleep(s: float) -> None:
        now[0] += s

    def server(answered_at: list[float]):
        def read() -> lm.ServerCounts:
            done = sum(t <= now[0] for t in answered_at)
            return lm.parse(f'scorer_requests_total{{code="OK"}} {done}\n')

        return read

    batches = [0.0, 4.0, 8.0, 12.0]  # four calls, one a batch, 4 s apart
    got = lm.scrape_settled(
        "", 4, lm.ServerCounts(), wait_s=5.0, read=server(batches), clock=clock, sleep=sleep
    )
    assert got.requests == 4 and 12.0 <= now[0] < 12.2

    now[0] = 0.0
    stalled = [0.0, 1.0]  # two of the four calls ever answered
    got = lm.scrape_settled(
        "", 4, lm.ServerCounts(), wait_s=5.0, read=server(stalled), clock=clock, sleep=sleep
    )
    assert got.requests == 2 and 6.0 <= now[0] < 6.2

    now[0] = 0.0
    endless = [0.5 * i for i in range(1, 1000)]  # answers keep coming, never the expected count
    got = lm.scrape_settled(
        "", 10_000, lm.ServerCounts(), wait_s=5.0, most_s=30.0, read=server(endless), clock=clock, sleep=sleep
    )
    assert 30.0 <= now[0] < 30.2 and got.requests < 10_000


def test_a_run_reports_where_the_server_spent_a_call_s_time_and_its_batches(capsys) -> None:
    """The stage histograms' and batch histograms' sums and counts, differenced over the run: mean ms
    a call spent queued and in its batch's forward, and the batches' mean calls and tokens."""

    def page(queue_s: float, forward_s: float, calls: int, batches: int, tokens: int) -> str:
        return (
            f'scorer_stage_duration_seconds_sum{{stage="queue"}} {queue_s}\n'
            f'scorer_stage_duration_seconds_count{{stage="queue"}} {calls}\n'
            f'scorer_stage_duration_seconds_sum{{stage="forward"}} {forward_s}\n'
            f'scorer_stage_duration_seconds_count{{stage="forward"}} {calls}\n'
            f"scorer_batch_requests_sum {calls}\nscorer_batch_requests_count {batches}\n"
            f"scorer_batch_tokens_sum {tokens}\nscorer_batch_tokens_count {batches}\n"
        )

    before = lm.parse(page(1.0, 2.0, 10, 5, 5000))
    after = lm.parse(page(1.5, 4.0, 30, 10, 45000))
    stages = after.minus(before).stages()
    assert stages == {
        "queue_ms_mean": 25.0,
        "forward_ms_mean": 100.0,
        "batches": 5,
        "batch_calls_mean": 4.0,
        "batch_tokens_mean": 8000.0,
    }
    client = {"requests": 0, "failed": 0, "by_code": {}, "docs_ok": 0}
    rec = lm.reconcile(client, after.minus(before))
    md = "\n".join(report._server_md(rec))
    assert "queue 25, forward 100; 5 batches of 4 calls and 8000 tokens on average." in md
    line = {
        "label": "auto @ 10/s", "achieved_rps": 10.0, "achieved_docs_per_s": 100.0, "failed": 0,
        "latency_seconds": {"p99": 0.05}, "saturation": {"saturated": False}, "server": rec,
    }  # fmt: skip
    run._print_line(line)
    assert "(queue 25 / forward 100 ms a call, 4 calls a batch)" in capsys.readouterr().err
    assert lm.parse("").stages() == {}  # a server that exports none: no line
    assert "On the server" not in "\n".join(report._server_md(lm.reconcile(client, lm.parse(""))))


# --- against the stub server --------------------------------------------------------------------


def test_closed_loop_and_request_bound(stub: tuple[str, str], tmp_path: Path) -> None:
    reqs = _gen(tmp_path / "r.jsonl", "--requests", "7", *SMALL)
    cfg = DriveConfig(target=stub[0], duration_s=10.0, concurrency=4, max_requests=50, progress_s=0)
    s = drive(cfg, compile_calls(reqs))
    assert len(s) == 50 and s.code.count("OK") == 50 and s.wall_s < 10


@pytest.mark.parametrize(
    ("scheme", "sweep", "name"),
    [("auto", False, "auto"), ("cascade", True, "cascade"), ("auto,naive", True, "mixed")],
)
def test_a_run_is_named_by_the_scheme_its_calls_ask_for(
    stub: tuple[str, str], tmp_path: Path, scheme: str, sweep: bool, name: str
) -> None:
    """Without --schemes: "mixed" only when the set's calls ask for different schemes."""
    req = tmp_path / "r.jsonl"
    reqs = _gen(req, "--requests", "12", *SMALL, "--scheme", scheme, "--seed", "1")
    assert len({r.options.scheme for r in reqs}) == len(scheme.split(","))
    out = tmp_path / "out"
    load = ["--sweep", "40,80", "--pause", "0"] if sweep else ["--rate", "40"]
    argv = ["--target", stub[0], "--requests", str(req), *load, "--duration", "0.25", "--out", str(out)]
    assert run.main([*argv, "--no-samples", "--quiet"]) == 0
    rep = _report(out)
    rates = [40, 80] if sweep else [40]
    assert [(r["label"], r["scheme"]) for r in rep["runs"]] == [(f"{name} @ {r}/s", name) for r in rates]
    if sweep:
        assert set(rep["capacity"]) == {name}
    else:
        assert rep["scheme"] == name


def test_sweep_per_scheme_and_compare(stub: tuple[str, str], tmp_path: Path) -> None:
    target, metrics_url = stub
    req = tmp_path / "r.jsonl"
    _gen(req, "--requests", "20", *SMALL)
    out = tmp_path / "sweep"
    argv = ["--target", target, "--requests", str(req), "--sweep", "50,100", "--schemes", "naive,cascade"]
    argv += ["--duration", "1", "--pause", "0", "--metrics-url", metrics_url, "--out", str(out), "--quiet"]
    assert run.main(argv) == 0
    rep = _report(out)
    assert rep["sweep"] and [(r["scheme"], r["offered_rps"]) for r in rep["runs"]] == [
        ("naive", 50.0),
        ("naive", 100.0),
        ("cascade", 50.0),
        ("cascade", 100.0),
    ]
    assert all(r["server"]["matched"] and r["failed"] == 0 for r in rep["runs"])
    assert all(r["per_scheme"].keys() == {r["scheme"]} for r in rep["runs"])
    assert set(rep["capacity"]) == {"naive", "cascade"}
    assert (out / "latency_throughput.png").read_bytes()[:8] == PNG
    text = report.compare(rep, rep)
    assert "naive @ 50/s" in text and "+0.0%" in text
    assert report.main(["compare", str(out), str(out), "--plot", str(tmp_path / "cdf.png")]) == 0
    assert (tmp_path / "cdf.png").read_bytes()[:8] == PNG
    assert report.main(["render", str(out), "--recompute", "--warmup", "0.5"]) == 0
    again = _report(out)
    assert again["config"]["warmup_s"] == 0.5 and len(again["runs"]) == 4
    for before, after in zip(rep["runs"], again["runs"], strict=True):
        assert after["server"] == before["server"] and after["requests"] < before["requests"]


def test_overload_of_a_small_stub_is_reported(tmp_path: Path) -> None:
    """Capacity 2 workers x 20 ms = 100 calls/s, queue 4; offered 300/s."""
    req = tmp_path / "r.jsonl"
    _gen(req, "--requests", "10", *SMALL)
    with capacity.stub_server(
        "--workers", "2", "--service-ms", "20", "--queue", "4", "--metrics-port", "0"
    ) as (
        target,
        metrics_url,
    ):
        out = tmp_path / "over"
        argv = ["--target", target, "--requests", str(req), "--rate", "300", "--duration", "2"]
        assert run.main([*argv, "--metrics-url", metrics_url, "--out", str(out), "--quiet"]) == 0
    rep = _report(out)
    assert rep["saturation"]["saturated"]
    assert rep["by_code"]["RESOURCE_EXHAUSTED"] > 100
    # near the stub's capacity, not collapsed; wall-clock on a shared 2-core runner (68 seen once)
    assert 60 <= rep["achieved_rps"] <= 110, rep["achieved_rps"]
    assert rep["server"]["matched"], rep["server"]


@pytest.mark.slow
def test_generator_sustains_2000_tiny_calls_per_second() -> None:
    """The driver's own limit, against the stub on this machine (2 cores in CI, shared with the stub).

    Wall-clock rates on a shared runner are noisy (a quiet 2-core VM measured 1,809-2,000 achieved
    in different minutes), so up to five tries and 90% of the rate; the driver's CPU time per call
    is the steadier bound: 500 us is 2,000 calls/s on one core.
    """
    for _ in range(5):
        step = capacity.run([2000.0], duration_s=3.0, concurrency=64)["open_loop"][0]
        if step["failed"] == 0 and step["achieved_rps"] >= 1900 and step["lag_p99_ms"] < 100:
            break
    assert step["failed"] == 0, step
    assert step["achieved_rps"] >= 1800, step
    assert step["lag_p99_ms"] < 100, step
    assert step["driver_cpu_us_per_call"] < 500, step


# --- against the real embedded server -----------------------------------------------------------


def test_gen_and_5s_run_against_the_embedded_server(server: dict, tmp_path: Path) -> None:
    req = tmp_path / "reqs.jsonl"
    _gen(req, "--requests", "40", *SMALL, "--scheme", "auto,naive,cascade,grouped", "--seed", "1")
    out = tmp_path / "report"
    argv = ["--target", server["target"], "--requests", str(req), "--rate", "20", "--duration", "5"]
    assert run.main([*argv, "--metrics-url", server["metrics"], "--out", str(out)]) == 0
    rep = _report(out)
    assert rep["offered_rps"] == 20 and rep["requests"] == 100
    assert rep["failed"] == 0 and rep["by_code"] == {"OK": 100}, rep["error_examples"]
    assert 17 <= rep["achieved_rps"] <= 23 and rep["achieved_docs_per_s"] == pytest.approx(
        5 * rep["achieved_rps"]
    )
    lat = rep["latency_seconds"]
    assert 0 < lat["p50"] <= lat["p90"] <= lat["p99"] <= lat["max"] < 5
    assert set(rep["per_scheme"]) == {"auto", "naive", "cascade", "grouped"}
    assert rep["per_scheme"]["cascade"]["ran"] == {"cascade": rep["per_scheme"]["cascade"]["ok"]}
    assert not rep["generator"]["behind_schedule"] or rep["generator"]["lag_seconds"]["p99"] < 0.1
    rec = rep["server"]
    assert rec["matched"], rec
    assert rec["rows"]["requests"]["server"] == 100 and rec["rows"]["docs"]["server"] == 500
    for name in ("latency_over_time.png", "latency_cdf.png"):
        assert (out / name).read_bytes()[:8] == PNG
    assert "client and server counts match" in (out / "report.md").read_text()
    assert len((out / "samples.csv").read_text().splitlines()) == 101


@pytest.mark.slow
def test_overload_of_the_embedded_server_is_reported_honestly(server: dict, tmp_path: Path) -> None:
    """Far above what the tiny CPU model serves: RESOURCE_EXHAUSTED (queue of 64) or rising latency.
    Calls of ~700 tokens: the small ones batch well enough that a fast VM served 257 of 400 a
    second, more than the half this test asks below."""
    req = tmp_path / "reqs.jsonl"
    heavy = ["--docs", "20", "--prompt-tokens", "100", "--doc-tokens", "uniform:20:40", "--token-ids"]
    _gen(req, "--requests", "40", *heavy, "--seed", "2")
    out = tmp_path / "over"
    argv = ["--target", server["target"], "--requests", str(req), "--rate", "400", "--duration", "3"]
    argv += ["--deadline-ms", "3000", "--metrics-url", server["metrics"], "--out", str(out), "--quiet"]
    assert run.main(argv) == 0
    rep = _report(out)
    sat = rep["saturation"]
    assert sat["saturated"], rep
    assert rep["by_code"].get("RESOURCE_EXHAUSTED", 0) > 0 or any("rising" in r for r in sat["reasons"])
    assert rep["achieved_rps"] < 0.5 * rep["offered_rps"]
    # a call may end on the server a hair inside its deadline and reach the client after it
    assert rep["server"]["matched"] or rep["server"]["explained"], rep["server"]
