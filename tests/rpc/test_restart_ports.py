"""A server restarts at once on the ports of one that just served HTTP, in every layout: the
connections it closed linger in TIME_WAIT on its HTTP port for a minute. The split server reserves
its ports with SO_REUSEPORT; without SO_REUSEADDR beside it, that bind failed over the TIME_WAIT
connections of a listener without SO_REUSEPORT (a one-process server): ``Address already in use``,
exit 2, for a minute."""

from __future__ import annotations

import json
import socket
import subprocess
import urllib.request

import rpc_harness
from rpc_harness import free_port, start_server

from scorer.server.frontends import reserve_port
from scorer.v1 import scorer_pb2 as pb


def test_the_split_servers_port_is_reserved_past_time_wait_connections():
    listener = socket.create_server(("127.0.0.1", 0))  # as the one-process server's HTTP: no SO_REUSEPORT
    port = listener.getsockname()[1]
    for _ in range(3):  # the server closes first: its end waits in TIME_WAIT
        client = socket.create_connection(("127.0.0.1", port))
        served, _ = listener.accept()
        served.close()
        client.recv(1)
        client.close()
    listener.close()
    states = subprocess.run(["ss", "-tan"], capture_output=True, text=True).stdout
    assert f"127.0.0.1:{port} " in states  # still there
    reserve_port("127.0.0.1", port).close()


def rerank(http_port: int) -> int:
    body = json.dumps({"query": "q", "texts": ["a doc", "another doc"]}).encode()
    url = f"http://127.0.0.1:{http_port}/rerank"
    with urllib.request.urlopen(urllib.request.Request(url, body), timeout=30) as reply:
        return reply.status


def test_a_split_server_restarts_at_once_on_the_ports_a_server_just_served_http_on(
    scorer_cache, server_logs, monkeypatch
):
    """One process, then ``--frontends 2`` on the same gRPC, HTTP and metrics ports (this test
    sets the layouts)."""
    grpc_port, metrics_port, http_port = free_port(), free_port(), free_port()
    monkeypatch.setattr(rpc_harness, "free_port", lambda: grpc_port)
    monkeypatch.setattr(rpc_harness, "SERVER_ARGS", ["--metrics-port", str(metrics_port)])
    args = ["--http-port", str(http_port)]
    first = start_server(scorer_cache, server_logs, [*args, "--frontends", "0"])
    assert [rerank(http_port) for _ in range(10)] == [200] * 10  # each connection closed by the server
    assert first.stop() == 0, first.log()
    second = start_server(scorer_cache, server_logs, [*args, "--frontends", "2"])
    try:
        assert rerank(http_port) == 200
        reply = second.stub().ScoreDocs(pb.ScoreDocsRequest(prompt="q", docs=[pb.Doc(text="d")]), timeout=30)
        assert len(reply.results) == 1
    finally:
        assert second.stop() == 0, second.log()
