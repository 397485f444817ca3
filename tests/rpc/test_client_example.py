"""examples/client.py runs against a live server (tests/test_snippets.py checks that the README
shows what it prints and the API page its code)."""

from __future__ import annotations

import subprocess
import sys

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
