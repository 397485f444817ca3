"""A port that is taken stops the server at once with a clear message, not a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from rpc_harness import REPO, start_server

from scorer.models.tiny import ensure_tiny_model
from scorer.server.lifecycle import batch_policy
from scorer.settings import Settings


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


@pytest.mark.parametrize(
    ("args", "flag"),
    [
        (["--port", "99999"], "--port (port): 99999"),
        (["--max-queue", "0"], "--max-queue (max_queue): 0"),
        (["--max-docs", "0"], "--max-docs (max_docs): 0"),
        (["--model", "no/such/checkpoint"], "--model (model): 'no/such/checkpoint'"),
        pytest.param(
            ["--device", "cuda"],
            "--device (device): 'cuda'",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here"),
        ),
    ],
)
def test_a_setting_that_cannot_work_stops_the_server_before_it_starts(scorer_cache, args, flag):
    """One ERROR line naming the flag, exit 2, before the port opens or the model loads."""
    cmd = [sys.executable, "-m", "scorer.server", "--port", "0", "--metrics-port", "0", *args]
    env = {**os.environ, "SCORER_CACHE_DIR": str(scorer_cache)}
    done = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if " ERROR " in line]
    assert len(errors) == 1 and flag in errors[0], done.stderr
    assert "Traceback" not in done.stderr and "listening on" not in done.stderr


@pytest.mark.parametrize(
    ("name", "value", "problem"),
    [
        ("port", -1, "-1 is not a port (0-65535)"),
        ("metrics_port", 65536, "65536 is not a port (0-65535)"),
        ("max_doc_tokens", 0, "0 is less than 1"),
        ("max_batch_tokens", 0, "0 is less than 1"),
        ("max_wait_ms", -0.5, "-0.5 is less than 0"),
        ("loop_path_gaps", -1.0, "-1.0 is less than 0"),
        ("busy_poll_ms", -1.0, "-1.0 is less than 0"),
        ("cuda_graph_max_tokens", -1, "-1 is less than 0"),
        ("drain_seconds", -1.0, "-1.0 is less than 0"),
        ("grace_seconds", -1.0, "-1.0 is less than 0"),
        ("metrics_port_tries", 0, "0 is less than 1"),
        ("call_timeout_s", 0.0, "0.0 is not more than 0"),
        ("device", "tpu", "'tpu' is not cpu, cuda or cuda:N"),
        ("device", "cuda:x", "'cuda:x' is not cpu, cuda or cuda:N"),
    ],
)
def test_settings_refuse_what_cannot_work_naming_flag_and_field(name, value, problem):
    flag = "--" + name.replace("_", "-")
    with pytest.raises(ValueError) as e:
        Settings(**{name: value})
    assert str(e.value) == f"{flag} ({name}): {problem}"


def test_settings_check_cuda_the_model_directory_and_the_tls_files(tmp_path, scorer_cache, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match=rf"^--device \(device\): '{device}' needs CUDA"):
            Settings(device=device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert Settings(device="cuda:1").device == "cuda:1"
    with pytest.raises(ValueError, match=r"^--model \(model\): '.*' is not a directory"):
        Settings(model=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"^--model \(model\): '.*' has no config.json"):
        Settings(model=str(tmp_path))
    assert Settings(model=str(ensure_tiny_model(scorer_cache))).model
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    with pytest.raises(ValueError, match=r"^--tls-key \(tls_key\): '.*key.pem' is not a file"):
        Settings(tls_cert=str(cert), tls_key=str(tmp_path / "key.pem"))
    assert Settings(tls_cert=str(cert), tls_key=str(cert)).tls_cert


def test_settings_take_the_edges_of_their_ranges():
    edges = dict(port=65535, metrics_port=0, max_queue=1, max_docs=1, max_wait_ms=0, drain_seconds=0)
    assert Settings(**edges, cuda_graph_max_tokens=0, call_timeout_s=0.5, device="cpu").port == 65535
    assert batch_policy(Settings(loop_path_gaps=0, device="cpu")).loop_path_gaps == 0


def test_the_serving_log_lines_age_counts_from_the_process_start():
    """process_age_s (in the SERVING lines): a process that slept 1 s first is at least 1 s old."""
    code = "import time; time.sleep(1.0); from scorer.server import scoring; print(scoring.process_age_s())"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert 1.0 <= float(out.stdout) < 120, out.stdout
