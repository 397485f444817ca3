"""The README's client example runs against a live server."""

from __future__ import annotations

import subprocess
import sys

import pytest
from rpc_harness import REPO

from scorer.models.tiny import NAME


def test_readme_client_example_runs_against_a_live_server(server):
    done = subprocess.run(
        [sys.executable, "examples/client.py", "--target", server.target],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 4
    scores = [float(line.split()[2]) for line in lines[:2]]
    assert scores == sorted(scores, reverse=True)
    assert "request_id=example-1" in lines[2] and f"model={NAME}" in lines[2]


def test_readme_client_snippet_is_the_tested_example():
    readme = (REPO / "README.md").read_text()
    if "## Serving over gRPC" not in readme:
        pytest.skip("the README's gRPC section is not merged yet")
    section = readme.split("## Serving over gRPC", 1)[1]
    snippet = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert snippet.strip() in (REPO / "examples" / "client.py").read_text()
