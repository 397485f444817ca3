"""`make deploy-local` (python -m scorer.ray_local): a local Ray with Serve's proxies on fixed ports
answers a call through the gRPC proxy, serves the replica's metrics on the port it printed, and a
terminal's Ctrl-C (SIGINT to its whole process group) stops Serve and Ray and exits 0."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from ray_app import free_port

from scorer.models.tiny import ensure_tiny_model

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow
READY_S = 120.0
STOP_S = 60.0


def free_port_flags(all_ports: bool = False) -> list[str]:
    """HAProxy's ports (and with ``all_ports`` every fixed port) on free ones: other Rays may run
    on this host."""
    names = ["--haproxy-stats-port", "--haproxy-metrics-port"]
    if all_ports:
        names += ["--grpc-port", "--http-port", "--ray-metrics-port"]
    return [x for name in names for x in (name, str(free_port()))]


def _session_processes(session_dir: str) -> list[int]:
    """Processes of that Ray session: Ray passes its session directory to each one it starts."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and session_dir.encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_deploy_local_answers_a_call_and_stops_cleanly_on_ctrl_c(tmp_path, stop_signal):
    ensure_tiny_model(tmp_path)
    grpc_port, http_port, metrics_port, ray_metrics_port = (free_port() for _ in range(4))
    cmd = [
        *(sys.executable, "-m", "scorer.ray_local", "--grpc-port", str(grpc_port)),
        *("--http-port", str(http_port), "--metrics-port", str(metrics_port)),
        *("--ray-metrics-port", str(ray_metrics_port), *free_port_flags(), "max_wait_ms=1"),
    ]
    env = {**os.environ, "SCORER_CACHE_DIR": str(tmp_path)}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True
    )
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("READY "):
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert ready.wait(READY_S), "".join(lines[-30:])
        (line,) = [x for x in lines if x.startswith("READY ")]
        assert f"gRPC 127.0.0.1:{grpc_port} " in line
        assert f"replica metrics http://127.0.0.1:{metrics_port}/metrics" in line
        session_dir = re.search(r"Ray session (\S+),", line).group(1)
        assert "RAY_SERVE_ENABLE_HA_PROXY=1" in line  # scorer.ray_serve.RAY_ENV

        client = [sys.executable, "examples/client.py", "--target", f"127.0.0.1:{grpc_port}"]
        answer = subprocess.run(client, cwd=REPO, capture_output=True, text=True, timeout=60)
        assert answer.returncode == 0 and "scheme=" in answer.stdout, answer.stdout + answer.stderr
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            assert 'scorer_requests_total{api="grpc",code="OK"' in r.read().decode()
        assert _session_processes(session_dir)

        if stop_signal == signal.SIGINT:
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        else:
            proc.send_signal(signal.SIGTERM)  # what a supervisor sends the process
        assert proc.wait(STOP_S) == 0, "".join(lines[-30:])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(10)
    assert lines[-1].strip() == "stopped", "".join(lines[-30:])
    give_up = time.monotonic() + 10  # Ray's last processes exit a moment after the driver
    while _session_processes(session_dir) and time.monotonic() < give_up:
        time.sleep(0.2)
    assert not _session_processes(session_dir)
    with socket.socket() as s:  # Ray's HAProxy is gone with it, its ports free
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", grpc_port))


def test_replicas_asking_for_more_cpus_than_ray_has_are_refused_at_once(capsys):
    """Ray would leave them unscheduled without a word on the terminal: say so and exit 2."""
    from scorer.ray_local import main

    assert (
        main(
            ["--num-cpus", "2", "--replicas", "2", *free_port_flags(all_ports=True), "engine_process=shared"]
        )
        == 2
    )
    assert "ask for 3 CPUs and this Ray has 2" in capsys.readouterr().err


def test_a_port_another_process_listens_on_is_one_line_naming_its_flag(capsys):
    """Beside another Ray on its default ports: one line and exit 2 before Ray starts, not a
    traceback after it."""
    from scorer.ray_local import main

    with socket.socket() as other:
        other.bind(("0.0.0.0", 0))
        other.listen()
        port = other.getsockname()[1]
        flags = free_port_flags(all_ports=True)
        flags[flags.index("--haproxy-metrics-port") + 1] = str(port)
        assert main(flags) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"port {port} (HAProxy's metrics, --haproxy-metrics-port)" in line and "taken" in line


def test_every_port_is_a_flag_passed_to_ray():
    from scorer.ray_local import parse, ray_env

    ns, _ = parse(
        ["--haproxy-stats-port", "18404", "--haproxy-metrics-port", "19101"]
        + ["--replica-grpc-ports", "42000-42100", "--replica-http-ports", "32000-32100"]
    )
    assert ray_env(ns) == {
        "RAY_SERVE_HAPROXY_STATS_PORT": "18404",
        "RAY_SERVE_HAPROXY_METRICS_PORT": "19101",
        "RAY_SERVE_DIRECT_INGRESS_MIN_GRPC_PORT": "42000",
        "RAY_SERVE_DIRECT_INGRESS_MAX_GRPC_PORT": "42100",
        "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT": "32000",
        "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT": "32100",
    }
    with pytest.raises(SystemExit):
        parse(["--replica-grpc-ports", "42100-42000"])
