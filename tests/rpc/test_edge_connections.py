"""The network edge of ``scorer serve`` under abuse (scorer/server/limits.py, http_edge.py): idle
and slow-header connections beyond ``--max-connections`` on HTTP and gRPC beside a stream of normal
calls, the default cap under a low file-descriptor limit, request bodies far over
``--max-message-bytes`` (the server's memory), and a client that hangs up on a queued call.

Each server-process test holds in both layouts (``SCORER_TEST_SERVER_ARGS="--frontends 2"``). No
test decides on a sleep: each waits for the event it names (a metric, a closed socket), and its
timeouts only bound a failing run."""

from __future__ import annotations

import contextlib
import json
import logging
import select
import socket
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from rpc_harness import free_port, start_server, wait_for

from scorer.server.handler import timeout_seconds
from scorer.server.lifecycle import connections
from scorer.server.limits import (
    ACCEPT_FAILED,
    MOST_CONNECTIONS,
    AcceptLogLimit,
    default_max_connections,
    grpc_options,
)
from scorer.settings import Settings
from scorer.v1 import scorer_pb2 as pb
from scorer.v1 import scorer_pb2_grpc

QUERY = "which passage explains prefix caching"
DOCS = ["the prompt is computed once and its keys and values are shared", "bread rises when yeast ferments"]
BODY = json.dumps({"query": QUERY, "documents": DOCS}).encode()


# The pieces, without a server


def test_the_default_cap_is_a_quarter_of_what_the_descriptor_limit_leaves():
    assert default_max_connections(300) == 43  # (300 - 128) // 4: HTTP and gRPC, each with a burst
    assert default_max_connections(1024) == 224
    assert default_max_connections(100) == 8
    assert default_max_connections(2**20) == MOST_CONNECTIONS
    assert 8 <= connections(Settings()) <= MOST_CONNECTIONS


def test_max_connections_takes_auto_or_a_positive_count():
    assert connections(Settings(max_connections="12")) == 12
    for bad in ("0", "-3", "many"):
        with pytest.raises(ValueError, match="--max-connections"):
            Settings(max_connections=bad)


def test_the_grpc_options_carry_the_cap_and_the_deadlines():
    options = dict(grpc_options(20, 2.0, 300.0, 0.0, 30.0, 60.0))
    assert options["grpc.max_allowed_incoming_connections"] == 20
    assert options["grpc.server_handshake_timeout_ms"] == 2000
    assert options["grpc.max_connection_idle_ms"] == 300_000
    assert "grpc.max_connection_age_ms" not in options  # 0: no limit
    aged = dict(grpc_options(20, 2.0, 300.0, 600.0, 30.0, 60.0))
    assert (aged["grpc.max_connection_age_ms"], aged["grpc.max_connection_age_grace_ms"]) == (600_000, 30_000)


def test_accept_failures_log_one_line_per_interval_with_the_count():
    now = [0.0]
    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(self.format(record))

    logger = logging.Logger("asyncio-under-test")
    logger.addFilter(AcceptLogLimit(interval_s=10.0, clock=lambda: now[0]))
    logger.addHandler(Lines())
    error = OSError(24, "Too many open files")
    for i in range(10_000):  # asyncio's accept loop, out of descriptors, 10,000 times in 20 s
        now[0] = i * 0.002
        logger.error(ACCEPT_FAILED, exc_info=(OSError, error, None))
    logger.error("something else")

    assert len(lines) == 3  # at 0 s, at 10 s, and the other record
    assert lines[0].startswith(ACCEPT_FAILED) and ": 1 failed accepts" in lines[0]
    assert ": 5000 failed accepts in the last 10 s" in lines[1] and "Too many open files" in lines[1]
    assert "Traceback" not in "".join(lines) and lines[2] == "something else"


def test_x_timeout_ms_is_a_plain_decimal_on_grpc_and_http_alike():
    assert timeout_seconds("250") == 0.25 and timeout_seconds("0.5") == 0.0005
    for bad in ("1_000", " 100 ", "1e3", "nan", "inf", "+5", "-5", "0", "0x10", "", "١٢"):
        assert timeout_seconds(bad) is None, bad


# Through scorer serve


def _idle(port: int, n: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(n)]


def _slow_headers(port: int, n: int) -> list[socket.socket]:
    """Connections that send the start of a request's headers and no more."""
    socks = _idle(port, n)
    for sock in socks:
        sock.sendall(b"POST /v2/rerank HTTP/1.1\r\nHost: t\r\nX-Slow: a")
    return socks


def _closed_by_server(sock: socket.socket) -> bytes:
    """What the server sent before closing ``sock`` (raises TimeoutError if it does not)."""
    data = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def _at_eof(sock: socket.socket) -> bool:
    """Has the server closed ``sock`` (which select says is readable)?"""
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def _grpc_call(stub) -> None:
    request = pb.ScoreDocsRequest(prompt=QUERY, docs=[pb.Doc(text=d) for d in DOCS])
    stub.ScoreDocs(request, timeout=60)


def test_idle_and_slow_header_connections_beyond_the_cap_leave_normal_calls_served(scorer_cache, server_logs):
    """A cap of 16 per listener and process; 100 idle HTTP connections, 10 sending their headers
    slowly and 100 idle gRPC connections beside a stream of normal calls: calls on established
    connections and on new ones are answered (new HTTP connections close the longest idle ones),
    /health answers, the slow and idle ones are closed by the server, and the log stays small."""
    http_port = free_port()
    args = ["--http-port", str(http_port), "--max-connections", "16", "--http-header-timeout-s", "2"]
    proc = start_server(scorer_cache, server_logs, args)
    url = f"http://127.0.0.1:{http_port}"
    opened = []
    try:
        with httpx.Client(base_url=url, timeout=60) as client, proc.channel() as channel:
            stub = scorer_pb2_grpc.ScorerStub(channel)
            assert client.post("/v2/rerank", content=BODY).status_code == 200  # established
            _grpc_call(stub)
            log_size = proc.log_path.stat().st_size

            idle = _idle(http_port, 100)
            slow = _slow_headers(http_port, 10)
            opened += idle + slow
            grpc_idle = _idle(proc.port, 100)
            opened += grpc_idle

            latencies, statuses = [], []
            for i in range(40):
                started = time.monotonic()
                if i % 4 == 0:
                    statuses.append(client.post("/v1/rerank", content=BODY).status_code)
                elif i % 4 == 1:  # a new connection each time
                    statuses.append(httpx.post(url + "/v2/rerank", content=BODY, timeout=60).status_code)
                elif i % 4 == 2:
                    _grpc_call(stub)
                    statuses.append(200)
                else:
                    statuses.append(httpx.get(url + "/health", timeout=60).status_code)
                latencies.append(time.monotonic() - started)

            assert statuses == [200] * 40
            assert statistics.quantiles(latencies, n=100)[98] < 1.0, sorted(latencies)[-5:]
            # the new connections closed idle ones at the cap; the header deadline closes the rest
            assert proc.metric("scorer_http_connections_closed_total", reason="evicted") > 0
            for sock in idle:
                sock.settimeout(60)
                assert _closed_by_server(sock) == b""
            for sock in slow:  # 408 once their headers are late, unless evicted before
                sock.settimeout(60)
                answer = _closed_by_server(sock)
                assert answer == b"" or answer.startswith(b"HTTP/1.1 408 "), answer
            for sock in grpc_idle:  # no HTTP/2 handshake within 2 s: closed by the server
                sock.settimeout(60)
                _closed_by_server(sock)
            _grpc_call(stub)
            with proc.channel() as fresh:  # and a new gRPC connection is served again
                _grpc_call(scorer_pb2_grpc.ScorerStub(fresh))
            grown = proc.log_path.stat().st_size - log_size
            assert grown < 8192, proc.log()[-3000:]
    finally:
        for sock in opened:
            sock.close()
        assert proc.stop() == 0, proc.log()[-3000:]


def test_grpc_closes_connections_over_the_cap_as_it_accepts_them(scorer_cache, server_logs):
    """20 connections that never start HTTP/2 against a gRPC cap of 4 per process and a 60 s
    handshake deadline: all but the cap's are closed at once; the established channel is served."""
    args = ["--max-connections", "4", "--http-header-timeout-s", "60"]
    proc = start_server(scorer_cache, server_logs, args)
    socks: list[socket.socket] = []
    try:
        with proc.channel() as channel:
            stub = scorer_pb2_grpc.ScorerStub(channel)
            _grpc_call(stub)
            socks = _idle(proc.port, 20)
            processes = len(_tree(proc.proc.pid)) - 1 or 1  # the front ends, else this one
            open_ = set(socks)
            deadline = time.monotonic() + 30
            while len(open_) > 4 * processes and time.monotonic() < deadline:
                readable, _, _ = select.select(list(open_), [], [], 1.0)
                open_ -= {s for s in readable if _at_eof(s)}  # the others got the server's SETTINGS
            assert len(open_) <= 4 * processes, len(open_)
            _grpc_call(stub)
    finally:
        for sock in socks:
            sock.close()
        assert proc.stop() == 0, proc.log()[-3000:]


def test_at_a_300_descriptor_limit_the_default_cap_keeps_the_server_serving(scorer_cache, server_logs):
    """As ``ulimit -n 300`` with 400 idle HTTP and 400 idle gRPC connections: the default cap
    (43 per listener and process) keeps descriptors free, so the server accepts, answers and
    logs no accept failures."""
    http_port = free_port()
    proc = start_server(scorer_cache, server_logs, ["--http-port", str(http_port)], preload=["low_fd_limit"])
    url = f"http://127.0.0.1:{http_port}"
    opened = []
    try:
        with httpx.Client(base_url=url, timeout=60) as client, proc.channel() as channel:
            stub = scorer_pb2_grpc.ScorerStub(channel)
            _grpc_call(stub)
            assert client.get("/health").status_code == 200
            log_size = proc.log_path.stat().st_size
            opened += _idle(http_port, 400)
            opened += _idle(proc.port, 400)
            for _ in range(5):
                assert client.post("/v2/rerank", content=BODY).status_code == 200
                assert httpx.get(url + "/health", timeout=60).status_code == 200  # a new connection
                _grpc_call(stub)
            assert proc.metric("scorer_http_connections_closed_total", reason="evicted") > 0
            log = proc.log()[log_size:]
            assert ACCEPT_FAILED not in log and len(log) < 8192, log[-3000:]
    finally:
        for sock in opened:
            sock.close()
        assert proc.stop() == 0, proc.log()[-3000:]


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [pid, *(p for child in children for p in _tree(int(child)))]


def _peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmHWM for {pid}")


def _send_until_refused(port: int, head: bytes, chunk: bytes, most: int) -> None:
    """Send ``head`` then ``chunk`` after ``chunk`` until ``most`` bytes or the server closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sent = 0
        with contextlib.suppress(OSError):
            sock.sendall(head)
            while sent < most:
                sock.sendall(chunk)
                sent += len(chunk)


def test_bodies_far_over_the_limit_leave_the_servers_memory_flat(scorer_cache, server_logs):
    """Four 300 MB bodies by Content-Length and four 64 MiB chunked bodies at once, against a
    4 MiB --max-message-bytes: each is refused (413, counted RESOURCE_EXHAUSTED) and no process
    of the server grows its peak RSS by more than twice the limit per concurrent request."""
    http_port = free_port()
    limit = 4 * 2**20
    proc = start_server(
        scorer_cache, server_logs, ["--http-port", str(http_port), "--max-message-bytes", str(limit)]
    )
    try:
        assert httpx.post(f"http://127.0.0.1:{http_port}/v2/rerank", content=BODY).status_code == 200
        pids = _tree(proc.proc.pid)
        peaks = {pid: _peak_rss_kib(pid) for pid in pids}
        before = proc.metric("scorer_requests_total", code="RESOURCE_EXHAUSTED")
        length = 300 * 10**6
        by_length = b"POST /v2/rerank HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % length
        chunked = b"POST /v1/rerank HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n"
        piece = b"x" * 65536
        with ThreadPoolExecutor(8) as pool:
            sends = [pool.submit(_send_until_refused, http_port, by_length, piece, length) for _ in range(4)]
            framed = b"%x\r\n%s\r\n" % (len(piece), piece)
            sends += [
                pool.submit(_send_until_refused, http_port, chunked, framed, 64 * 2**20) for _ in range(4)
            ]
            for send in sends:
                send.result(120)
        assert proc.wait_metric("scorer_requests_total", before + 8, code="RESOURCE_EXHAUSTED") == before + 8
        grown_mib = {pid: (_peak_rss_kib(pid) - peaks[pid]) / 1024 for pid in pids}
        assert max(grown_mib.values()) < 2 * 4 * limit / 2**20, grown_mib
    finally:
        assert proc.stop() == 0, proc.log()[-3000:]


def test_a_client_that_hangs_up_drops_its_queued_call_before_its_forward(scorer_cache, server_logs):
    """A Cohere call queued behind a 5 s forward, whose client closes the connection: it leaves the
    queue unscored (dropped, cancelled), is counted CANCELLED and logged 499; no other batch runs."""
    http_port = free_port()
    args = ["--http-port", str(http_port), "--debug-forward-delay-ms", "5000", "--max-wait-ms", "0"]
    proc = start_server(scorer_cache, server_logs, [*args, "--loop-path-gaps", "1e9"])
    try:
        with ThreadPoolExecutor(1) as pool:
            blocker = pool.submit(
                httpx.post,
                f"http://127.0.0.1:{http_port}/rerank",
                timeout=60,
                content=json.dumps({"query": QUERY, "texts": DOCS}),
            )
            assert proc.wait_metric("scorer_batch_requests_count", 1, timeout=60) == 1  # in its forward
            sock = socket.create_connection(("127.0.0.1", http_port), timeout=60)
            sock.sendall(
                b"POST /v2/rerank HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n%s" % (len(BODY), BODY)
            )
            assert proc.wait_metric("scorer_queue_depth", 1, timeout=60) == 1
            sock.close()
            assert proc.wait_metric("scorer_requests_dropped_total", 1, timeout=60, reason="cancelled") == 1
            assert (
                proc.wait_metric("scorer_requests_total", 1, timeout=60, api="cohere", code="CANCELLED") == 1
            )
            assert blocker.result(60).status_code == 200
        assert proc.metric("scorer_batch_requests_count") == 1
        # logged once the handler's cancellation (which counts it) has settled: wait, not race
        wait_for(lambda: "/v2/rerank 499: the client closed the connection" in proc.log(), 30, "no 499 line")
    finally:
        assert proc.stop() == 0, proc.log()[-3000:]


def test_a_slow_body_and_slow_headers_do_not_hold_a_connection(scorer_cache, server_logs):
    """--http-header-timeout-s and --http-body-timeout-s through scorer serve: 408 each."""
    http_port = free_port()
    args = ["--http-port", str(http_port), "--http-header-timeout-s", "1", "--http-body-timeout-s", "1"]
    proc = start_server(scorer_cache, server_logs, args)
    try:
        (headers,) = _slow_headers(http_port, 1)
        body = socket.create_connection(("127.0.0.1", http_port), timeout=60)
        body.sendall(b"POST /rerank HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n{")
        with headers, body:
            assert _closed_by_server(headers).startswith(b"HTTP/1.1 408 ")
            assert _closed_by_server(body).startswith(b"HTTP/1.1 408 ")
        assert proc.metric("scorer_requests_total", api="tei", code="DEADLINE_EXCEEDED") == 1
        assert proc.metric("scorer_http_connections_closed_total", reason="header_timeout") == 1
    finally:
        assert proc.stop() == 0, proc.log()[-3000:]
