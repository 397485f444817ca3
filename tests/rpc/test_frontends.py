"""``scorer serve --frontends 2`` on the CPU: the front ends in two processes of their own on the
same ports (SO_REUSEPORT), the engine in the server's process (scorer/server/frontends.py).

Which front end served a call is read from the handler's log line of the call's request id: a
front end's lines start with its name (``frontend-0 ``). Every channel here has a connection of
its own (``fresh_channel``), so the kernel spreads them over both front ends.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import random
import re
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from rpc_harness import CLIENT_OPTIONS, REPO, ServerProcess, free_port, start_server, wait_for
from rpc_requests import FAULT_PROMPT, MAIN_SERVER_ARGS, random_request, solo
from test_batching import TOLERANCE, batches_of_more_than_one
from test_errors import BAD_INPUTS
from test_http import DOCS, QUERY
from test_metrics import EXPECTED_FAMILIES

from loadtest import metrics as lm
from scorer.server.batcher import Closed, Dropped, OutOfMemory, QueueFull
from scorer.server.handler import status_for
from scorer.server.link import _portable, for_engine
from scorer.settings import Settings
from scorer.v1 import scorer_pb2 as pb
from scorer.v1 import scorer_pb2_grpc

FRONTENDS = ("frontend-0", "frontend-1")
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
SLOW_FORWARD_S = 1.0  # the slow server's forward batches
LIFECYCLE_FORWARD_S = 0.3  # the lifecycle server's
LIFECYCLE_BATCH_TOKENS = 64  # a call of the default template (74 tokens and more) runs alone
_route_ids = itertools.count()


def start_split(scorer_cache: Path, server_logs: Path, *args: str) -> ServerProcess:
    split = ["--frontends", str(len(FRONTENDS)), "--http-port", str(free_port())]
    return start_server(scorer_cache, server_logs, [*split, *args])


def http_url(server: ServerProcess) -> str:
    args = server.proc.args
    return f"http://127.0.0.1:{args[args.index('--http-port') + 1]}"


def fresh_channel(server: ServerProcess) -> grpc.Channel:
    """A channel with a TCP connection of its own (channels otherwise share one per target)."""
    return grpc.insecure_channel(
        server.target, options=[*CLIENT_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
    )


def stub(channel: grpc.Channel) -> scorer_pb2_grpc.ScorerStub:
    return scorer_pb2_grpc.ScorerStub(channel)


def health(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5).status


def handler_lines(server: ServerProcess, request_ids, timeout: float = 10.0) -> dict[str, tuple[str, str]]:
    """By request id: the front end whose handler answered the call, and what its log line says
    after the method (``OK scheme=ragged 3.1 ms``)."""
    wanted = set(request_ids)
    line = re.compile(r"^(frontend-\d+) .* request_id=(\S+) /scorer\.v1\.Scorer/ScoreDocs (.*)$", re.M)
    deadline = time.monotonic() + timeout
    while True:
        found = {rid: (front, said) for front, rid, said in line.findall(server.log()) if rid in wanted}
        if len(found) == len(wanted) or time.monotonic() > deadline:
            assert found.keys() == wanted, f"no handler line for {sorted(wanted - found.keys())}"
            return found
        time.sleep(0.02)


def served_by(server: ServerProcess, request_ids) -> dict[str, str]:
    return {rid: front for rid, (front, _) in handler_lines(server, request_ids).items()}


def route(server: ServerProcess, channel: grpc.Channel) -> tuple[str, grpc.StatusCode]:
    """The front end behind ``channel``, and how it answers a call without docs: INVALID_ARGUMENT
    once it tokenizes, UNAVAILABLE before (the call never reaches the engine)."""
    rid = f"route-{next(_route_ids)}"
    with pytest.raises(grpc.RpcError) as caught:
        stub(channel).ScoreDocs(pb.ScoreDocsRequest(prompt="q", request_id=rid), timeout=10)
    return served_by(server, [rid])[rid], caught.value.code()


def channels_to_each(server: ServerProcess) -> dict[str, grpc.Channel]:
    """A fresh channel to every front end."""
    found: dict[str, grpc.Channel] = {}
    for _ in range(64):
        channel = fresh_channel(server)
        front, _ = route(server, channel)
        if front in found:
            channel.close()
        else:
            found[front] = channel
        if len(found) == len(FRONTENDS):
            return found
    raise AssertionError(f"64 connections and only {sorted(found)} answered")


def spread_channels(server: ServerProcess, n: int) -> list[grpc.Channel]:
    """``n`` fresh channels, one to each front end at least."""
    return [*channels_to_each(server).values(), *(fresh_channel(server) for _ in range(n - len(FRONTENDS)))]


def assert_scored_alone(engine, msg: pb.ScoreDocsRequest, reply: pb.ScoreDocsResponse) -> None:
    ref = solo(engine, msg)
    assert reply.request_id == msg.request_id and reply.scheme == ref.scheme
    assert [r.index for r in reply.results] == [d.index for d in ref.results]
    assert [r.score for r in reply.results] == pytest.approx([d.score for d in ref.results], abs=TOLERANCE)
    if msg.options.return_label_logprobs:
        for r, d in zip(reply.results, ref.results, strict=True):
            assert list(r.label_logprobs) == pytest.approx(d.label_logprobs, abs=TOLERANCE)


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc)."""
    out = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            out.append(int(entry))
    return out


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def frontend_pids(server: ServerProcess) -> dict[str, int]:
    """Each front end's pid, the latest logged (uvicorn's start line, prefixed by its name)."""
    lines = re.findall(r"^(frontend-\d+) .*Started server process \[(\d+)\]", server.log(), re.M)
    return {front: int(pid) for front, pid in lines}


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past TIME_WAIT, never a listener
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


def engine_calls(server: ServerProcess) -> float:
    """Calls that have reached the engine's batcher: those launched in a batch, then those queued,
    read in that order. A call leaves the queue before its batch counts it, so none is counted
    twice (one taken between the reads is missed, for a moment); a dropped call leaves the count."""
    launched = server.metric("scorer_batch_requests_sum")
    return launched + server.metric("scorer_queue_depth")


def rerank(url: str, request_id: str) -> httpx.Response:
    body = {"model": "m", "query": QUERY, "documents": DOCS}
    return httpx.post(f"{url}/v2/rerank", json=body, headers={"X-Request-Id": request_id}, timeout=60)


# The shared split server


@pytest.fixture(scope="module")
def started(scorer_cache, server_logs):
    """The shared server (MAIN_SERVER_ARGS, two front ends), and the codes of a call on each of
    four fresh channels sent the moment health first said SERVING."""
    server = start_split(scorer_cache, server_logs, *MAIN_SERVER_ARGS)
    codes = []
    for _ in range(4):
        with fresh_channel(server) as channel:
            try:
                stub(channel).ScoreDocs(pb.ScoreDocsRequest(prompt="q", docs=[pb.Doc(text="d")]), timeout=30)
                codes.append(grpc.StatusCode.OK)
            except grpc.RpcError as e:
                codes.append(e.code())
    yield server, codes
    assert server.stop() == 0, server.log()


@pytest.fixture
def split(started) -> ServerProcess:
    return started[0]


def test_health_says_serving_only_once_every_front_end_can_score(started):
    server, codes = started
    assert codes == [grpc.StatusCode.OK] * 4, "SERVING before the front ends could score"
    assert server.metric("scorer_ready") == 1
    assert f"in {len(FRONTENDS)} front-end processes" in server.log()


def test_concurrent_calls_from_both_front_ends_share_batches_and_each_scores_as_alone(split, engine):
    rng = random.Random(60)
    requests = [random_request(rng, request_id=f"fe-mix-{i}") for i in range(60)]
    channels = spread_channels(split, 8)
    merged_before = batches_of_more_than_one(split)

    futures = [stub(channels[i % 8]).ScoreDocs.future(r, timeout=120) for i, r in enumerate(requests)]
    replies = [f.result() for f in futures]

    for msg, reply in zip(requests, replies, strict=True):
        assert_scored_alone(engine, msg, reply)
    assert batches_of_more_than_one(split) > merged_before
    assert set(served_by(split, [r.request_id for r in requests]).values()) == set(FRONTENDS)
    for channel in channels:
        channel.close()


def test_connections_spread_over_both_front_end_processes(split):
    channels = [fresh_channel(split) for _ in range(16)]
    fronts = {route(split, channel)[0] for channel in channels}
    assert fronts == set(FRONTENDS)
    pids = frontend_pids(split)
    assert pids.keys() == set(FRONTENDS) and set(pids.values()) <= set(children(split.proc.pid))
    for channel in channels:
        channel.close()


@pytest.mark.parametrize(
    "case",
    [
        "empty prompt",
        "more docs than --max-docs",
        "unknown scheme",
        "label of two tokens",
        "doc id outside the vocabulary",
        "doc over max_doc_tokens",
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field_on_either_front_end(split, case):
    template, code, field = BAD_INPUTS[case]
    for front, channel in channels_to_each(split).items():
        msg = pb.ScoreDocsRequest()
        msg.CopyFrom(template)
        msg.request_id = f"fe-bad-{front}-{case.replace(' ', '-')}"
        with pytest.raises(grpc.RpcError) as caught:
            stub(channel).ScoreDocs(msg, timeout=30)
        trailers = dict(caught.value.trailing_metadata())
        assert caught.value.code() == code, front
        assert caught.value.details().startswith(f"{field}: ")
        assert trailers["x-invalid-field"] == field and trailers["x-request-id"] == msg.request_id
        assert health(channel) == SERVING
        good = pb.ScoreDocsRequest(prompt="q", docs=[pb.Doc(text="d")])
        assert len(stub(channel).ScoreDocs(good, timeout=30).results) == 1
        channel.close()


def test_a_faulty_call_fails_alone_with_internal_and_its_mates_on_both_front_ends_succeed(split, engine):
    rng = random.Random(8)
    channels = list(channels_to_each(split).values())
    good = [random_request(rng, scheme="ragged", request_id=f"fe-mate-{i}") for i in range(6)]
    bad = pb.ScoreDocsRequest(prompt=FAULT_PROMPT, docs=[pb.Doc(text="d")], request_id="fe-faulty")
    internal_before = split.metric("scorer_errors_total", code="INTERNAL")

    calls = [*good[:3], bad, *good[3:]]
    futures = [stub(channels[i % 2]).ScoreDocs.future(r, timeout=60) for i, r in enumerate(calls)]
    outcomes = [f.exception() or f.result() for f in futures]

    failed = outcomes.pop(3)
    assert failed.code() == grpc.StatusCode.INTERNAL
    assert dict(failed.trailing_metadata())["x-request-id"] == "fe-faulty"
    for msg, reply in zip(good, outcomes, strict=True):
        assert_scored_alone(engine, msg, reply)
    internal = split.wait_metric("scorer_errors_total", internal_before + 1, code="INTERNAL")
    assert internal == internal_before + 1
    assert "injected fault" in split.log()
    assert all(health(channel) == SERVING for channel in channels)


@pytest.mark.parametrize(
    "exc",
    [Dropped("deadline"), Dropped("unreachable"), QueueFull("full"), OutOfMemory("oom"), Closed("closed")],
    ids=lambda e: f"{type(e).__name__}({e.args[0] if not isinstance(e, Dropped) else e.reason})",
)
def test_an_engine_error_reaches_the_front_end_as_the_same_answer(exc):
    """What the engine process sends back (pickled) is answered as the same error in one process."""
    sent = pickle.loads(pickle.dumps(_portable(exc)))
    assert type(sent) is type(exc) and status_for(sent) == status_for(exc)


def test_the_link_sends_a_job_without_its_docs_tokens_and_it_scores_the_same(engine):
    """The engine process gets each call's tokens once (``items``), not the docs' text and ids too;
    scores, doc ids and options are those of the whole Job."""
    from scorer.request import Doc, ScoreRequest

    rng = random.Random(11)
    docs = [Doc(id=f"t{i}", text=" ".join(["token"] * rng.randint(20, 60))) for i in range(6)]
    docs += [Doc(id=f"i{i}", token_ids=tuple(rng.randrange(4, 250) for _ in range(60))) for i in range(6)]
    job = engine.tokenize(ScoreRequest("a query", docs))
    sent = pickle.loads(pickle.dumps(for_engine(job)))
    assert all(not d.text and not d.token_ids for d in sent.request.docs)
    assert [d.id for d in sent.request.docs] == [d.id for d in docs]
    assert (sent.request.prompt, sent.options, sent.items) == (job.request.prompt, job.options, job.items)
    assert len(pickle.dumps(sent)) < 0.7 * len(pickle.dumps(job))
    assert engine.score_batch([sent]) == engine.score_batch([job])


def test_metrics_are_one_set_counting_every_front_ends_calls(split):
    url = f"http://127.0.0.1:{split.metrics_port}/metrics"
    channels = spread_channels(split, 6)
    rng = random.Random(5)
    requests = [random_request(rng, request_id=f"fe-count-{i}") for i in range(12)]
    before = lm.scrape(url, api="grpc")
    ok_before = split.metric("scorer_requests_total", api="grpc", code="OK")

    replies = [stub(channels[i % 6]).ScoreDocs(r, timeout=60) for i, r in enumerate(requests)]

    assert set(served_by(split, [r.request_id for r in requests]).values()) == set(FRONTENDS)
    ok = split.wait_metric("scorer_requests_total", ok_before + 12, api="grpc", code="OK")
    assert ok == ok_before + 12
    client = {
        "requests": 12,
        "failed": 0,
        "by_code": {"OK": 12},
        "docs_ok": sum(len(r.results) for r in replies),
    }
    rec = lm.reconcile(client, lm.scrape(url, api="grpc").minus(before), api="grpc")
    assert rec["matched"], rec
    text = split.metrics_text()
    families = list(text_string_to_metric_families(text))
    names = [f.name for f in families]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)
    series = [(s.name, tuple(sorted(s.labels.items()))) for f in families for s in f.samples]
    assert len(series) == len(set(series)), "a series twice"
    assert all(name.startswith("scorer_") for name in names)
    assert EXPECTED_FAMILIES.items() <= {f.name: f.type for f in families}.items()
    assert split.metric("scorer_inflight_requests") == 0
    assert split.metric("scorer_ready") == 1
    for stage in ("queue", "tokenize", "forward"):  # tokenize: the front ends'; the others: the engine's
        assert split.metric("scorer_stage_duration_seconds_count", stage=stage) > 0
    for channel in channels:
        channel.close()


def test_http_through_the_front_ends_scores_as_grpc_and_health_is_200(split):
    url = http_url(split)
    options = pb.ScoreOptions(truncate="doc_end", max_doc_tokens=4096)  # Cohere's defaults
    grpc_reply = split.stub().ScoreDocs(
        pb.ScoreDocsRequest(prompt=QUERY, docs=[pb.Doc(text=d) for d in DOCS], options=options), timeout=60
    )
    want = [r.score for r in grpc_reply.results]
    cohere_before = split.metric("scorer_requests_total", api="cohere", code="OK")

    for i in range(4):  # a connection each: both front ends, likely
        reply = rerank(url, f"fe-http-{i}")
        assert reply.status_code == 200, reply.text
        by_index = {r["index"]: r["relevance_score"] for r in reply.json()["results"]}
        assert [by_index[i] for i in range(len(DOCS))] == pytest.approx(want, abs=TOLERANCE)
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200

    assert split.wait_metric("scorer_requests_total", cohere_before + 4, api="cohere", code="OK") == (
        cohere_before + 4
    )
    assert set(served_by(split, [f"fe-http-{i}" for i in range(4)]).values()) <= set(FRONTENDS)


def test_info_through_the_front_ends_names_the_engine_processs_model_and_batcher(split):
    """A front end has no model and no batcher: /info reports the engine process's."""
    reply = split.stub().ScoreDocs(pb.ScoreDocsRequest(prompt=QUERY, docs=[pb.Doc(text="a")]), timeout=60)
    for _ in range(4):  # a connection each: both front ends, likely
        info = httpx.get(f"{http_url(split)}/info", timeout=10)
        assert info.status_code == 200, info.text
        info = info.json()
        assert info["model_id"] == reply.model
        assert info["max_batch_tokens"] == Settings().max_batch_tokens
        assert (info["attention_backend"], info["device"]) == ("torch", "cpu")
        assert info["limits"]["max_docs"] == 64  # MAIN_SERVER_ARGS


# A slow forward: calls wait in the engine's queue


@pytest.fixture
def slow(scorer_cache, server_logs):
    """Every forward batch takes SLOW_FORWARD_S; fresh each test, so that no forward time is known
    yet and the batcher refuses no call on its estimate."""
    server = start_split(
        scorer_cache, server_logs, "--debug-forward-delay-ms", str(SLOW_FORWARD_S * 1e3), "--max-wait-ms", "0"
    )
    yield server
    assert server.stop() == 0, server.log()


def test_queued_calls_of_both_front_ends_share_a_batch_and_expired_or_cancelled_ones_cost_nothing(
    slow, engine
):
    """Behind a slow batch: a call from each front end, run in one batch; a call whose 300 ms
    deadline passes in the queue (DEADLINE_EXCEEDED) and one its client cancels leave the queue
    unscored (their docs are never counted)."""
    server = slow
    channels = channels_to_each(server)
    first, second = (channels[f] for f in FRONTENDS)
    rng = random.Random(4)
    blocker = pb.ScoreDocsRequest(prompt="q", docs=[pb.Doc(text="d")], request_id="fe-blocker")
    pair = [random_request(rng, scheme="ragged", request_id=f"fe-pair-{i}") for i in range(2)]

    def docs(n: int, name: str) -> pb.ScoreDocsRequest:
        return pb.ScoreDocsRequest(prompt="q", docs=[pb.Doc(text="d")] * n, request_id=name)

    names = ("scorer_batch_requests_count", "scorer_batch_requests_sum", "scorer_docs_scored_total")
    before = {n: server.metric(n) for n in names}
    dropped = sum(server.metric("scorer_requests_dropped_total", reason=r) for r in ("deadline", "cancelled"))
    codes_before = {
        c: server.metric("scorer_requests_total", code=c) for c in ("DEADLINE_EXCEEDED", "CANCELLED")
    }

    running_blocker = stub(first).ScoreDocs.future(blocker, timeout=60)
    server.wait_metric("scorer_batch_requests_count", before["scorer_batch_requests_count"] + 1)
    mates = [stub(ch).ScoreDocs.future(m, timeout=60) for ch, m in zip((first, second), pair, strict=True)]
    cancelled = stub(first).ScoreDocs.future(docs(5, "fe-cancelled"))
    late = stub(second).ScoreDocs.future(docs(7, "fe-late"), timeout=0.3)
    assert server.wait_metric("scorer_queue_depth", 4) == 4
    assert cancelled.cancel()

    assert late.exception().code() == grpc.StatusCode.DEADLINE_EXCEEDED
    code, _, ms, *_ = handler_lines(server, ["fe-late"])["fe-late"][1].split()
    assert code == "DEADLINE_EXCEEDED" and float(ms) < SLOW_FORWARD_S * 800  # not at the blocker's end
    assert_scored_alone(engine, blocker, running_blocker.result())
    for msg, future in zip(pair, mates, strict=True):
        assert_scored_alone(engine, msg, future.result())
    assert served_by(server, [m.request_id for m in pair]) == dict(
        zip([m.request_id for m in pair], FRONTENDS, strict=True)
    )

    now_dropped = sum(
        server.metric("scorer_requests_dropped_total", reason=r) for r in ("deadline", "cancelled")
    )
    assert now_dropped == dropped + 2
    assert server.metric("scorer_batch_requests_count") == before["scorer_batch_requests_count"] + 2
    assert server.metric("scorer_batch_requests_sum") == before["scorer_batch_requests_sum"] + 3  # 1, then 2
    scored = len(blocker.docs) + sum(len(m.docs) for m in pair)
    assert server.metric("scorer_docs_scored_total") == before["scorer_docs_scored_total"] + scored
    for code, n in codes_before.items():
        assert server.wait_metric("scorer_requests_total", n + 1, code=code) == n + 1, code
    assert "request_id=fe-late dropped from the queue before its forward pass" in server.log()


# Kill a front end, then SIGTERM: the lifecycle server


@pytest.fixture(scope="module")
def lifecycle(scorer_cache, server_logs):
    """Every forward batch takes LIFECYCLE_FORWARD_S; a call of the default template runs in a
    batch of its own. Its processes' loops busy-poll (``--busy-poll-ms``): restarts and the drain
    work on them too. test_sigterm_... stops it."""
    server = start_split(
        scorer_cache,
        server_logs,
        *("--debug-forward-delay-ms", str(LIFECYCLE_FORWARD_S * 1e3), "--max-wait-ms", "0"),
        *("--max-batch-tokens", str(LIFECYCLE_BATCH_TOKENS), "--busy-poll-ms", "5"),
    )
    yield server
    if server.proc.poll() is None:
        assert server.stop() == 0, server.log()


def test_a_killed_front_end_is_started_again_and_its_calls_are_dropped_unscored(lifecycle, engine):
    """The survivor's calls, queued ahead, all succeed and its health stays SERVING; the killed
    one's queued calls fail UNAVAILABLE and are dropped from the engine's queue (not scored, and
    no result of theirs reaches the new process, whose calls number from 0 again); the new process
    listens only once it can score, then scores correctly; no count is lost."""
    server = lifecycle
    assert server.proc.poll() is None, "runs before test_sigterm_..., which stops the server"
    channels = channels_to_each(server)
    victim, survivor = FRONTENDS[1], FRONTENDS[0]
    pid = frontend_pids(server)[victim]
    assert pid in children(server.proc.pid)
    ok_before = server.metric("scorer_requests_total", code="OK")
    cancelled_before = server.metric("scorer_requests_dropped_total", reason="cancelled")
    tokenized = server.metric("scorer_stage_duration_seconds_count", stage="tokenize")
    batches = server.metric("scorer_batch_requests_count")
    reached = engine_calls(server)
    rng = random.Random(9)

    ahead_msg = pb.ScoreDocsRequest(prompt="q", docs=[pb.Doc(text="d")], request_id="fe-ahead")
    ahead = [stub(channels[survivor]).ScoreDocs.future(ahead_msg, timeout=60) for _ in range(24)]
    server.wait_metric("scorer_stage_duration_seconds_count", tokenized + 24, stage="tokenize")
    server.wait_metric("scorer_batch_requests_count", batches + 1)  # the engine is busy ahead of them:
    doomed_msg = pb.ScoreDocsRequest(prompt="q", docs=[pb.Doc(text="d")] * 3)  # the doomed all queue
    doomed = [stub(channels[victim]).ScoreDocs.future(doomed_msg, timeout=60) for _ in range(6)]
    wait_for(lambda: engine_calls(server) >= reached + 30, 30, "the doomed calls did not reach the engine")
    restarts = server.metric("scorer_frontend_restarts_total")
    os.kill(pid, signal.SIGKILL)

    assert [f.exception().code() if f.exception() else "OK" for f in doomed] == [UNAVAILABLE] * 6
    restarted = f"front end 1 (pid {pid}) exited with -9; starting it again"
    wait_for(lambda: restarted in server.log(), 10, "no restart logged")
    assert server.wait_metric("scorer_frontend_restarts_total", restarts + 1) == restarts + 1
    assert server.wait_metric("scorer_requests_dropped_total", cancelled_before + 6, reason="cancelled") == (
        cancelled_before + 6
    )
    assert health(channels[survivor]) == SERVING and server.metric("scorer_ready") == 1
    assert server.metric("scorer_requests_total", code="OK") >= ok_before  # the dead one's counts stay

    def new_front_end() -> grpc.Channel | None:
        channel = fresh_channel(server)
        status = health(channel)
        front, code = route(server, channel)
        if front == victim:  # it listens only once it can score: never UNAVAILABLE, never NOT_SERVING
            assert (code, status) == (grpc.StatusCode.INVALID_ARGUMENT, SERVING)
            return channel
        channel.close()
        return None

    reborn = wait_for(new_front_end, 60, "the front end was not started again")
    assert frontend_pids(server)[victim] != pid and running(frontend_pids(server)[victim])
    assert health(reborn) == SERVING and health(channels[survivor]) == SERVING
    fresh = [random_request(rng, request_id=f"fe-reborn-{i}") for i in range(6)]
    futures = [stub(reborn).ScoreDocs.future(m, timeout=60) for m in fresh]
    for msg, future in zip(fresh, futures, strict=True):
        assert_scored_alone(engine, msg, future.result())
    assert set(served_by(server, [m.request_id for m in fresh]).values()) == {victim}
    for future in ahead:
        assert len(future.result().results) == 1
    assert_scored_alone(engine, ahead_msg, ahead[0].result())


def test_sigterm_under_load_finishes_every_call_in_flight_and_leaves_no_process(lifecycle, engine):
    server = lifecycle
    channels = list(channels_to_each(server).values())
    procs = children(server.proc.pid)  # the front ends and multiprocessing's resource tracker
    fronts = frontend_pids(server)
    assert set(fronts.values()) <= set(procs) and len(fronts) == len(FRONTENDS)
    grpc_port, http_port = server.port, int(http_url(server).rsplit(":", 1)[1])
    rng = random.Random(15)
    requests = [random_request(rng, request_id=f"fe-term-{i}") for i in range(6)]

    with ThreadPoolExecutor(1) as pool:
        http_call = pool.submit(rerank, http_url(server), "fe-term-http")
        futures = [stub(channels[i % 2]).ScoreDocs.future(m, timeout=60) for i, m in enumerate(requests)]
        assert server.wait_metric("scorer_inflight_requests", 7) == 7  # summed over the front ends
        server.proc.send_signal(signal.SIGTERM)
        for msg, future in zip(requests, futures, strict=True):
            assert_scored_alone(engine, msg, future.result())
        assert http_call.result().status_code == 200

    assert server.proc.wait(60) == 0, server.log()
    wait_for(lambda: not any(running(p) for p in procs), 10, f"still running: {procs}")
    assert not listening(grpc_port) and not listening(http_port)
    lines = server.log().splitlines()
    refusing = sorted(line.split(" ", 1)[0] for line in lines if "refusing new calls; " in line)
    assert refusing == list(FRONTENDS)
    assert lines[-1].endswith(" stopped")


# Start-up


@pytest.mark.parametrize(
    ("holder", "flag", "what"),
    [
        ("socket", "--port", "gRPC port"),
        ("socket", "--http-port", "HTTP port"),
        ("split", "--port", "gRPC port"),
    ],
)
def test_a_taken_port_stops_the_split_server_naming_it(request, scorer_cache, holder, flag, what):
    """Taken by a plain listening socket, or by another split server's front ends (SO_REUSEPORT:
    binding beside them would take half of that server's connections): exit 2, one line."""
    with contextlib.ExitStack() as stack:
        if holder == "socket":
            taken = stack.enter_context(socket.socket())
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
        else:
            other = request.getfixturevalue("split")
            port = other.port
        ports = {"--port": str(free_port()), "--http-port": str(free_port()), flag: str(port)}
        cmd = [sys.executable, "-m", "scorer.server", "--frontends", "2", "--metrics-port", "0"]
        env = {**os.environ, "SCORER_CACHE_DIR": str(scorer_cache)}
        args = [*cmd, *itertools.chain(*ports.items())]
        done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert done.returncode == 2 and len(errors) == 1, done.stderr
    assert f"cannot listen on {what} 127.0.0.1:{port}: Address already in use" in errors[0]
    assert "Traceback" not in done.stderr and "frontend-" not in done.stderr  # none was started
    if holder == "split":
        assert other.health() == SERVING
