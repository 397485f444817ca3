"""A port that is taken stops the server at once with a clear message, not a traceback."""

from __future__ import annotations

import subprocess
import sys

from rpc_harness import REPO


def test_taken_ports_fail_fast_with_a_clear_message(server):
    for args, what in (
        (["--port", str(server.port), "--metrics-port", "0"], "gRPC port"),
        (["--port", "0", "--metrics-port", str(server.metrics_port)], "metrics port"),
    ):
        cmd = [sys.executable, "-m", "scorer.server", *args]
        done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert done.returncode == 2
        assert f"cannot listen on {what}" in done.stderr
        assert "Traceback" not in done.stderr
