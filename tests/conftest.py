import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "100")),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile("dev", max_examples=200, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """A module's engine of the tiny model on the torch attention backend (up to 400 docs of 512
    tokens), its compiled artefacts under a temporary ``SCORER_CACHE_DIR``; modules that need
    another engine define their own."""
    from scorer.engine import EngineConfig
    from scorer.runtime import build_engine

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SCORER_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        yield build_engine(attention_backend="torch", config=EngineConfig(max_docs=400, max_doc_tokens=512))


@pytest.fixture(scope="session")
def ray_app(tmp_path_factory):
    """One local Ray with the scorer application, shared by every Ray test (tests/ray_app.py)."""
    from ray_app import start

    yield from start(tmp_path_factory)


RAY_MODULES = ("test_ray_", "test_prometheus.py")
"""The modules that start or use a local Ray (``ray_app`` is session-wide): one worker runs them
all, so CI's two cores hold one Ray at a time."""


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook; plain pytest (the GPU machine) has none
def pytest_xdist_make_scheduler(config, log):
    """``make test``'s workers (``-n 2``) take whole modules, so a module's servers start once; the
    Ray modules go together (``RAY_MODULES``). xdist's ``loadgroup`` would do this by marks, but
    its group suffix no longer reaches pytest 9's node ids."""
    from xdist.scheduler import LoadScopeScheduling

    class Modules(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "ray" if path.rsplit("/", 1)[-1].startswith(RAY_MODULES) else path

    return Modules(config, log)
