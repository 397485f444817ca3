"""A port that is taken stops the server at once with a clear message, not a traceback."""

from __future__ import annotations

import subprocess
import sys

from rpc_harness import REPO, start_server


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


def test_flashinfer_that_cannot_run_stops_the_server_with_one_line():
    """Asked for explicitly, FlashInfer that cannot run this model (no CUDA here) is a start-up
    error naming the flag, exit 2, before the port opens; never a silent switch to torch."""
    cmd = [sys.executable, "-m", "scorer.server", "--port", "0", "--metrics-port", "0"]
    done = subprocess.run(
        [*cmd, "--attention-backend", "flashinfer"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert (
        len(errors) == 1
        and "--attention-backend flashinfer" in errors[0]
        and "--attention-fallback torch" in errors[0]
    )
    assert "Traceback" not in done.stderr


def test_the_torch_fallback_is_asked_for_and_shows(scorer_cache, server_logs):
    proc = start_server(
        scorer_cache, server_logs, ("--attention-backend", "flashinfer", "--attention-fallback", "torch")
    )
    try:
        assert (
            proc.metric("scorer_model_info", attention_backend="torch", attention_requested="flashinfer") == 1
        )
        assert "falling back to the torch reference (--attention-fallback torch)" in proc.log()
    finally:
        assert proc.stop() == 0


def test_a_bad_setting_is_refused_with_one_line():
    cmd = [sys.executable, "-m", "scorer.server", "--port", "0", "--metrics-port", "0", "--tls-cert", "x.pem"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "tls_cert and tls_key go together" in done.stderr
