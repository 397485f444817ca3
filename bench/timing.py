"""Timing with CUDA events (host timers off CUDA) and the versions a result was measured with."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

SLEEP_CYCLES_PER_MS = 1_900_000  # H200 SM clock ~1.9 GHz; only has to keep the GPU busy a while


@dataclass(frozen=True)
class Timing:
    mean_ms: float
    median_ms: float
    min_ms: float
    n: int

    def as_dict(self) -> dict:
        return asdict(self)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_gpu(
    fn: Callable[[], object],
    device: torch.device,
    warmup: int = 10,
    iters: int = 100,
    cap_s: float | None = None,
) -> Timing:
    """Mean/median/min device time of ``fn`` over ``iters`` runs after ``warmup`` runs.

    Each run is bracketed by CUDA events. Launches are queued behind a device-side sleep, so
    the events measure kernel time and the gaps between a run's own kernels, not the Python
    launch overhead. With ``cap_s``, heavy cases run fewer iterations (at least 2) so that the
    timed runs take about ``cap_s`` seconds.
    """
    fn()
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    one = time.perf_counter() - t0
    if cap_s is not None and one > 0:
        iters = max(2, min(iters, int(cap_s / one)))
        warmup = max(1, min(warmup, int(cap_s / 4 / one)))
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return _summary(times)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    sync(device)
    if one < 2e-3:
        torch.cuda._sleep(int(SLEEP_CYCLES_PER_MS * min(50.0, 1e3 * one * iters * 2 + 1)))
    for s, e in zip(starts, ends, strict=True):
        s.record()
        fn()
        e.record()
    sync(device)
    return _summary([s.elapsed_time(e) for s, e in zip(starts, ends, strict=True)])


def time_ms(fn: Callable[[], object], iters: int) -> float:
    """Median device time (ms) of ``fn`` alone on the current CUDA device: each of ``iters`` runs
    (after 5 untimed) bracketed by events and waited for before the next is launched."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def capture_graph(fn: Callable[[], object], device: torch.device, warmup: int = 1, reps: int = 1):
    """A CUDA graph of ``reps`` calls of ``fn``, after ``warmup`` calls on a side stream (cuBLAS
    handles, Triton's compile, lazy allocations happen outside the capture)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    return graph


def time_host(fn: Callable[[], object], device: torch.device, iters: int = 5) -> float:
    """Median wall time (ms) of ``fn`` including a device synchronisation after each run."""
    times = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _summary(times: list[float]) -> Timing:
    return Timing(statistics.fmean(times), statistics.median(times), min(times), len(times))


def environment(device: torch.device) -> dict:
    """GPU, driver, CUDA, torch and flashinfer versions."""
    env = {
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
        "cpus": os.cpu_count(),
    }
    try:
        import flashinfer

        env["flashinfer"] = flashinfer.__version__
    except ImportError:
        env["flashinfer"] = None
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        env.update(gpu=p.name, capability=f"{p.major}.{p.minor}", sms=p.multi_processor_count)
        env["memory_gib"] = round(p.total_memory / 2**30, 1)
        try:
            q = "--query-gpu=driver_version,clocks.max.sm,clocks.sm,power.limit"
            out = subprocess.run(["nvidia-smi", q, "--format=csv,noheader"], capture_output=True, text=True)
            env["nvidia_smi"] = out.stdout.strip()
        except OSError:
            env["nvidia_smi"] = None
    return env


def append_records(path: Path, records: list[dict]) -> None:
    """Add ``records`` to the ``{"records": [...]}`` file at ``path`` (made if absent)."""
    old = json.loads(path.read_text())["records"] if path.exists() else []
    write_json(path, {"records": old + records})


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
