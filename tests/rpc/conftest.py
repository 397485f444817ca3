from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from rpc_harness import ServerProcess, start_server
from rpc_requests import MAIN_SERVER_ARGS

from scorer.engine import Engine
from scorer.models.tiny import ensure_tiny_model
from scorer.runtime import build_engine


@pytest.fixture(scope="session")
def scorer_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SCORER_CACHE_DIR of every server in the session; the tiny model is written here once."""
    cache = tmp_path_factory.mktemp("scorer-cache")
    ensure_tiny_model(cache)
    return cache


@pytest.fixture(scope="session")
def server_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server-logs")


@pytest.fixture(scope="session")
def engine(scorer_cache: Path) -> Engine:
    """The same checkpoint in process: the reference a call scored alone must match."""
    return build_engine(ensure_tiny_model(scorer_cache), device="cpu")


@pytest.fixture(scope="session")
def server(scorer_cache: Path, server_logs: Path) -> Iterator[ServerProcess]:
    """The shared server: batches wait up to 20 ms; at most 64 docs; FAULT_PROMPT raises in the forward."""
    proc = start_server(scorer_cache, server_logs, MAIN_SERVER_ARGS)
    yield proc
    assert proc.stop() == 0, proc.log()


SINGLE_PASS = {
    "test_batcher.py": "the batcher alone, no server",
    "test_loops.py": "the event loops alone, no server",
    "test_frontends.py": "starts the split server itself",
    "test_restart_ports.py": "starts one process, then the split server, itself",
    "test_toy_scheme.py": "runs in each arrangement itself",
    "test_startup.py": "settings and ports refused before any front end starts (test_frontends: the split's)",
    "test_prometheus.py": "Prometheus and Grafana's queries; the split's /metrics: test_metrics, both passes",
}
"""The modules of tests/rpc that ``make test`` runs once: its second pass (servers with
``--frontends 2``) deselects them (``-m "not single_pass"``)."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SINGLE_PASS and item.path.parent.name == "rpc":
            item.add_marker(pytest.mark.single_pass)
