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
