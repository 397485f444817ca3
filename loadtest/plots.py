"""PNG plots (matplotlib, Agg): latency over time, latency CDF, latency-throughput curves of a sweep."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from .stats import Arrays  # noqa: E402

MAX_POINTS = 20_000
DPI = 100


def latency_over_time(runs: Sequence[tuple[str, Arrays]], path: Path) -> None:
    """Each call at its scheduled time (runs one after another), ok as dots, failures as red crosses."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    offset, any_failed = 0.0, False
    rng = np.random.default_rng(0)
    for k, (label, a) in enumerate(runs):
        t = a.sched + offset
        keep = np.arange(len(t))
        if len(t) > MAX_POINTS // max(len(runs), 1):
            keep = np.sort(rng.choice(len(t), MAX_POINTS // len(runs), replace=False))
        ok = a.ok[keep]
        color = f"C{k % 10}"
        ax.scatter(t[keep][ok], a.latency[keep][ok] * 1e3, s=3, alpha=0.4, color=color, label=label)
        if (~ok).any():
            any_failed = True
            ax.scatter(t[keep][~ok], a.latency[keep][~ok] * 1e3, s=10, marker="x", color="red")
        xs, p99 = _p99_per_second(t, a.latency, a.ok)
        ax.plot(xs + 0.5, p99 * 1e3, color=color, lw=1.2)
        if len(runs) > 1:
            ax.axvline(offset, color="grey", lw=0.5)
        offset = float(np.ceil(t.max())) + 1.0 if len(t) else offset
    if any_failed:
        ax.scatter([], [], s=10, marker="x", color="red", label="failed")
    ax.set(xlabel="scheduled send time (s)", ylabel="latency (ms)", yscale="log")
    ax.set_title("Latency over time (dots: calls; line: p99 per second)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, markerscale=3)
    _save(fig, path)


def latency_cdf(runs: Sequence[tuple[str, Arrays]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, (label, a) in enumerate(runs):
        lat = np.sort(a.latency[a.ok]) * 1e3
        if not len(lat):
            continue
        y = np.arange(1, len(lat) + 1) / len(lat)
        ax.plot(lat, y, color=f"C{k % 10}", label=f"{label} (n={len(lat)})")
    for q in (0.5, 0.9, 0.99):
        ax.axhline(q, color="grey", lw=0.5, ls=":")
    ax.set(xlabel="latency of ok calls (ms)", ylabel="fraction of calls", xscale="log", ylim=(0, 1.01))
    ax.set_title("Latency CDF")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, path)


def latency_throughput(runs: Sequence[dict], path: Path) -> None:
    """One curve per scheme: p50 (dashed) and p99 (solid) latency against achieved ok calls/s."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    schemes = sorted({r["scheme"] for r in runs})
    for k, scheme in enumerate(schemes):
        pts = sorted((r for r in runs if r["scheme"] == scheme), key=lambda r: r["offered_rps"] or 0)
        x = [r["achieved_rps"] for r in pts]
        p50 = [_ms(r["latency_seconds"]["p50"]) for r in pts]
        p99 = [_ms(r["latency_seconds"]["p99"]) for r in pts]
        color = f"C{k % 10}"
        ax.plot(x, p99, "o-", color=color, label=f"{scheme} p99")
        ax.plot(x, p50, "s--", color=color, alpha=0.6, label=f"{scheme} p50")
        for r, xi, yi in zip(pts, x, p99, strict=True):
            if r["failed"]:
                ax.annotate(f"{100 * r['failed'] / max(r['requests'], 1):.0f}% err", (xi, yi), fontsize=6)
        offered = [r["offered_rps"] for r in pts]
        ax2.plot(offered, x, "o-", color=color, label=scheme)
    ax.set(xlabel="achieved ok calls/s", ylabel="latency (ms)", yscale="log")
    ax.set_title("Latency vs throughput")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    top = max([r["offered_rps"] or 0 for r in runs] + [1])
    ax2.plot([0, top], [0, top], color="grey", lw=0.6, ls=":")
    ax2.set(xlabel="offered calls/s", ylabel="achieved ok calls/s")
    ax2.set_title("Achieved vs offered")
    ax2.grid(True, alpha=0.3)
    _save(fig, path)


def _p99_per_second(t: np.ndarray, lat: np.ndarray, ok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``t`` ascending."""
    t, lat = t[ok], lat[ok]
    if not len(t):
        return np.array([]), np.array([])
    secs = np.arange(np.floor(t[0]), np.floor(t[-1]) + 1)
    edges = np.searchsorted(t, np.append(secs, secs[-1] + 1))
    keep = [(x, lo, hi) for x, lo, hi in zip(secs, edges[:-1], edges[1:], strict=True) if hi > lo]
    return np.array([x for x, _, _ in keep]), np.array([np.percentile(lat[lo:hi], 99) for _, lo, hi in keep])


def _ms(v: float | None) -> float:
    return float("nan") if v is None else v * 1e3


def _save(fig: plt.Figure, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
