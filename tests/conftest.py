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


@pytest.fixture(scope="session")
def ray_app(tmp_path_factory):
    """One local Ray with the scorer application, shared by every Ray test (tests/ray_app.py)."""
    from ray_app import start

    yield from start(tmp_path_factory)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``make test``: ``-n 2 --dist loadgroup``) each module's tests run on
    one worker, so a module's server starts once; the Ray modules, and any test on the session's
    local Ray (``ray_app``), share one worker and that one Ray."""
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            ray = item.path.name.startswith("test_ray_") or "ray_app" in item.fixturenames
            item.add_marker(pytest.mark.xdist_group("ray" if ray else item.path.stem))
