"""API keys on every route (gRPC's ``authorization`` metadata as HTTP's header), read from a file
or the environment; and the prefix-cache salt derived from the key, which isolates tenants."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rpc_harness import ServerProcess, free_port, start_server

from scorer.server.auth import ApiKeys, Unauthenticated, key_salt, load_keys
from scorer.settings import SERVE, Settings
from scorer.v1 import scorer_pb2 as pb

KEYS = ("tenant-a-key", "tenant-b-key")
PROMPT = list(range(10, 330))  # 320 prompt tokens: whole blocks of the prefix cache


@pytest.fixture(scope="module")
def keyed(scorer_cache, server_logs, tmp_path_factory) -> Iterator[tuple[ServerProcess, int]]:
    key_file = tmp_path_factory.mktemp("keys") / "keys"
    key_file.write_text(f"# one key a tenant\n{KEYS[0]}\n\n{KEYS[1]}\n")
    http_port = free_port()
    args = ["--api-key-file", str(key_file), "--cache-salt-from-key", "--metrics-auth"]
    args += ["--http-port", str(http_port)]
    proc = start_server(scorer_cache, server_logs, args)
    yield proc, http_port
    assert proc.stop() == 0, proc.log()
    assert KEYS[0] not in proc.log() and KEYS[1] not in proc.log()


def bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


def metrics(server: ServerProcess, key: str | None = KEYS[0]) -> str:
    """/metrics, asked with ``key`` (``--metrics-auth``)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as reply:
        return reply.read().decode()


def unauthenticated(server: ServerProcess) -> float:
    return sum(
        s.value
        for family in text_string_to_metric_families(metrics(server))
        for s in family.samples
        if s.name == "scorer_requests_total" and s.labels.get("code") == "UNAUTHENTICATED"
    )


def call(prompt=PROMPT, salt: str = "") -> pb.ScoreDocsRequest:
    options = pb.ScoreOptions(template="plain", cache_salt=salt)
    return pb.ScoreDocsRequest(prompt_token_ids=prompt, docs=[pb.Doc(token_ids=[5, 6, 7])], options=options)


@pytest.mark.parametrize("metadata", [(), bearer("wrong"), (("authorization", KEYS[0]),)], ids=str)
def test_grpc_without_a_valid_bearer_key_is_unauthenticated_and_counted(keyed, metadata):
    server, _ = keyed
    before = unauthenticated(server)
    with pytest.raises(grpc.RpcError) as caught:
        server.stub().ScoreDocs(call([1, 2, 3]), metadata=metadata, timeout=30)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "Bearer" in caught.value.details()
    deadline = time.monotonic() + 10  # the count reaches /metrics from a front end's process shortly
    while unauthenticated(server) < before + 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert unauthenticated(server) == before + 1


def test_with_metrics_auth_metrics_wants_a_key_too(keyed):
    server, _ = keyed
    for key in (None, "wrong"):
        with pytest.raises(urllib.error.HTTPError) as refused:
            metrics(server, key)
        assert refused.value.code == 401
    assert "scorer_requests_total" in metrics(server, KEYS[1])


def test_every_key_of_the_file_is_taken_on_grpc_and_http(keyed):
    server, http_port = keyed
    for key in KEYS:
        reply = server.stub().ScoreDocs(call([1, 2, 3]), metadata=bearer(key), timeout=30)
        assert len(reply.results) == 1
    body = json.dumps({"query": "q", "texts": ["a doc"]}).encode()
    url = f"http://127.0.0.1:{http_port}/rerank"
    keyed_request = urllib.request.Request(url, body, {"Authorization": f"Bearer {KEYS[1]}"})
    with urllib.request.urlopen(keyed_request, timeout=30) as reply:
        assert reply.status == 200
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(urllib.request.Request(url, body), timeout=30)
    assert refused.value.code == 401


def cached(server: ServerProcess, key: str, salt: str = "") -> int:
    reply = server.stub().ScoreDocs(call(salt=salt), metadata=bearer(key), timeout=60)
    return reply.usage.cached_prompt_tokens


def test_with_cache_salt_from_key_a_tenant_never_reads_what_another_cached(keyed):
    """Unsalted callers share the prefix cache: one that sends a prompt another sent twice reads it
    from the cache (``usage.cached_prompt_tokens``, and its latency, tell). Salted by key, tenant B
    reads none of tenant A's prompt, whatever salt it sends, while A reads its own."""
    server, _ = keyed
    assert [cached(server, KEYS[0]) for _ in range(3)][-1] > 0  # kept on its second sighting
    assert cached(server, KEYS[1]) == 0
    assert cached(server, KEYS[1], salt=key_salt(KEYS[0], "")) == 0  # a forged salt is salted again
    assert cached(server, KEYS[0]) > 0


def test_keys_come_from_the_file_then_the_environment_then_the_flag(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("k1\n# a comment\nk2\n")
    assert load_keys("flag", str(key_file), {"SCORER_API_KEY": "env"}) == ApiKeys(("k1", "k2"))
    assert load_keys("flag", None, {"SCORER_API_KEY": "env"}) == ApiKeys(("env",))
    assert load_keys("flag", None, {}) == ApiKeys(("flag",))
    assert load_keys(None, None, {}) is None
    keys = ApiKeys(("k1", "k2"))
    assert keys.match("Bearer k2") == "k2" and keys.match(b"bearer  k1 ") == "k1"
    for bad in (None, "", "k1", "Basic k1", "Bearer k3", "Bearer "):
        with pytest.raises(Unauthenticated):
            keys.match(bad)


def test_settings_refuse_a_salt_from_no_key_an_empty_key_file_and_two_key_sources(tmp_path, monkeypatch):
    monkeypatch.delenv("SCORER_API_KEY", raising=False)
    empty = tmp_path / "empty"
    empty.write_text("# no key\n\n")
    with pytest.raises(ValueError, match="--cache-salt-from-key needs an API key"):
        Settings(cache_salt_from_key=True)
    with pytest.raises(ValueError, match="--metrics-auth needs an API key"):
        Settings(metrics_auth=True)
    with pytest.raises(ValueError, match="holds no key"):
        Settings(api_key_file=str(empty))
    with pytest.raises(ValueError, match="give one"):
        Settings(api_key="k", api_key_file=str(empty))
    monkeypatch.setenv("SCORER_API_KEY", "k")
    assert Settings(cache_salt_from_key=True).cache_salt_from_key
    assert SERVE in Settings.__dataclass_fields__["api_key_file"].metadata["scopes"]
