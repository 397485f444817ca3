"""PNG plots (matplotlib, Agg): latency over time, latency CDF, latency-throughput curves of a sweep.

A series is one run: (label, group, arrays); runs of one group (a scheme, in a sweep) share a colour
over time and a panel in the CDF. A run without an ok call has no latency to draw: the CDF panel says
so in words and the latency-throughput chart marks it with an x on its x axis. Each plot has a
``*_figure`` function that returns the figure unsaved.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from .stats import Arrays  # noqa: E402

Series = tuple[str, str, Arrays]
MAX_POINTS = 20_000
DPI = 100


def _group_colors(groups: Sequence[str]) -> dict[str, str]:
    return {g: f"C{k % 10}" for k, g in enumerate(dict.fromkeys(groups))}


def failed_note(requests: int, by_code: dict[str, int]) -> str:
    """For a run with no ok call: 'all 40 calls failed (UNAVAILABLE)', or 'no calls'."""
    bad = {c: n for c, n in sorted(by_code.items()) if c != "OK"}
    if not requests or not bad:
        return "no calls"
    codes = next(iter(bad)) if len(bad) == 1 else ", ".join(f"{c} {n}" for c, n in bad.items())
    return f"all {requests} calls failed ({codes})"


def latency_over_time(runs: Sequence[Series], path: Path) -> None:
    _save(latency_over_time_figure(runs), path)


def latency_over_time_figure(runs: Sequence[Series]) -> plt.Figure:
    """Each call at its scheduled time (runs one after another), ok as dots, failures as red crosses."""
    fig, ax = plt.subplots(figsize=(10, 4.8))
    colors = _group_colors([g for _, g, _ in runs])
    many = len(runs) > 6
    offset, any_failed = 0.0, False
    rng = np.random.default_rng(0)
    per_run = MAX_POINTS // max(len(runs), 1)
    for label, group, a in runs:
        if not len(a.sched):
            continue
        t = a.sched + offset
        keep = np.arange(len(t)) if len(t) <= per_run else np.sort(rng.choice(len(t), per_run, replace=False))
        ok, color = a.ok[keep], colors[group]
        ax.scatter(
            t[keep][ok], a.latency[keep][ok] * 1e3, s=3, alpha=0.4, color=color, label=None if many else label
        )
        if (~ok).any():
            any_failed = True
            ax.scatter(t[keep][~ok], a.latency[keep][~ok] * 1e3, s=8, marker="x", color="red", alpha=0.5)
        xs, p99 = _p99_per_second(t, a.latency, a.ok)
        ax.plot(xs + 0.5, p99 * 1e3, color=color, lw=1.2)
        if len(runs) > 1:
            ax.axvline(offset, color="grey", lw=0.5)
        if many:
            ax.text(offset + 0.2, 1.01, label, transform=ax.get_xaxis_transform(), rotation=60, fontsize=6)
        offset = float(np.ceil(t.max())) + 1.0
    handles = [Line2D([], [], marker="o", ls="", color=c, label=g) for g, c in colors.items()] if many else []
    if any_failed:
        handles.append(Line2D([], [], marker="x", ls="", color="red", label="failed"))
    ax.set(xlabel="scheduled send time (s)", ylabel="latency (ms)", yscale="log")
    ax.set_title("Latency over time (dots: calls; line: p99 per second)", pad=40 if many else 6)
    ax.grid(True, which="both", alpha=0.3)
    if many:
        _legend(ax, handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    else:
        _legend(ax, ax.get_legend_handles_labels()[0] + handles, fontsize=7, markerscale=2)
    return fig


def latency_cdf(runs: Sequence[Series], path: Path) -> None:
    _save(latency_cdf_figure(runs), path)


def latency_cdf_figure(runs: Sequence[Series]) -> plt.Figure:
    """One panel per group, one line per run of it; runs without an ok call are named in the panel."""
    groups = list(dict.fromkeys(g for _, g, _ in runs)) or [""]
    cols = min(3, len(groups))
    rows = math.ceil(len(groups) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols + 1.5, 3.4 * rows), squeeze=False, sharex=True)
    for ax, group in zip(axes.flat, groups, strict=False):
        members = [(label, a) for label, g, a in runs if g == group]
        shades = plt.get_cmap("viridis")(np.linspace(0, 0.85, max(len(members), 1)))
        notes = []
        for (label, a), color in zip(members, shades, strict=True):
            lat = np.sort(a.latency[a.ok]) * 1e3
            if len(lat):
                ax.plot(
                    lat, np.arange(1, len(lat) + 1) / len(lat), color=color, label=f"{label} (n={len(lat)})"
                )
            else:
                note = failed_note(len(a.code), Counter(a.code.tolist()))
                notes.append(note if len(members) == 1 else f"{label}: {note}")
        if notes:
            alone = len(notes) == len(members)  # the panel has no line: the note in its middle
            xy, ha, va = ((0.5, 0.5), "center", "center") if alone else ((0.03, 0.95), "left", "top")
            ax.text(*xy, "\n".join(notes), transform=ax.transAxes, ha=ha, va=va, fontsize=8, color="red")
        for q in (0.5, 0.9, 0.99):
            ax.axhline(q, color="grey", lw=0.5, ls=":")
        ax.set(xscale="log", ylim=(0, 1.01), title=group if len(groups) > 1 else "Latency CDF")
        ax.set(xlabel="latency of ok calls (ms)", ylabel="fraction of calls")
        ax.grid(True, which="both", alpha=0.3)
        _legend(ax, fontsize=6, loc="lower right")
    for ax in list(axes.flat)[len(groups) :]:
        ax.set_visible(False)
    return fig


def latency_throughput(runs: Sequence[dict], path: Path) -> None:
    _save(latency_throughput_figure(runs), path)


def latency_throughput_figure(runs: Sequence[dict]) -> plt.Figure:
    """Per scheme: p99 (solid) and p50 (dashed) against achieved ok calls/s; hollow markers: saturated;
    an x on the x axis: a run without an ok call, labelled with its calls' codes."""
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [3, 2]})
    colors = _group_colors([r["scheme"] for r in runs])
    at_axis = ax.get_xaxis_transform()  # x in data, y in axes: 0 is the x axis
    n_failed = 0
    for scheme, color in colors.items():
        pts = sorted((r for r in runs if r["scheme"] == scheme), key=lambda r: r["offered_rps"] or 0)
        x = np.array([r["achieved_rps"] for r in pts])
        sat = np.array([r["saturation"]["saturated"] for r in pts])
        good = np.flatnonzero(~sat)
        bad = np.flatnonzero(sat)
        for q, ls, marker, alpha in (("p99", "-", "o", 1.0), ("p50", "--", "s", 0.5)):
            y = np.array([_ms(r["latency_seconds"][q]) for r in pts])
            ax.plot(x[good], y[good], ls=ls, marker=marker, color=color, alpha=alpha)
            if len(bad):
                ax.scatter(
                    x[bad], y[bad], marker=marker, facecolors="none", edgecolors=color, alpha=alpha, s=40
                )
        for i, r in enumerate(pts):
            if r["latency_seconds"]["p99"] is None:
                ax.plot([x[i]], [0], marker="x", ms=9, mew=2, color=color, transform=at_axis, clip_on=False)
                note = f"{r['label']}: {failed_note(r['requests'], r['by_code'])}"
                up = 6 + 10 * n_failed  # several at one x stack up
                ax.annotate(
                    note,
                    (x[i], 0),
                    xycoords=at_axis,
                    xytext=(6, up),
                    textcoords="offset points",
                    fontsize=6,
                    color=color,
                )
                n_failed += 1
            elif sat[i] and r["failed"]:
                err = f"{100 * r['failed'] / max(r['requests'], 1):.0f}% failed"
                y99 = _ms(r["latency_seconds"]["p99"])
                ax.annotate(
                    err, (x[i], y99), xytext=(4, -10), textcoords="offset points", fontsize=6, color=color
                )
        ax2.plot([r["offered_rps"] for r in pts], x, "o-", color=color)
    handles = [Line2D([], [], color=c, lw=2, label=s) for s, c in colors.items()]
    handles += [
        Line2D([], [], color="grey", ls="-", marker="o", label="p99"),
        Line2D([], [], color="grey", ls="--", marker="s", alpha=0.5, label="p50"),
        Line2D([], [], color="grey", ls="", marker="o", mfc="none", label="saturated"),
    ]
    if n_failed:
        handles.append(Line2D([], [], color="grey", ls="", marker="x", mew=2, label="no ok call"))
    _legend(ax, handles, fontsize=7)
    # a log axis needs one latency to place (a sweep whose every step failed has none)
    scale = "log" if any(r["latency_seconds"]["p99"] is not None for r in runs) else "linear"
    ax.set(xlabel="achieved ok calls/s", ylabel="latency (ms)", yscale=scale, title="Latency vs throughput")
    ax.grid(True, which="both", alpha=0.3)
    top = max([r["offered_rps"] or 0 for r in runs] + [1])
    ax2.plot([0, top], [0, top], color="grey", lw=0.6, ls=":")
    ax2.set(xlabel="offered calls/s", ylabel="achieved ok calls/s", title="Achieved vs offered")
    ax2.grid(True, alpha=0.3)
    return fig


def _p99_per_second(t: np.ndarray, lat: np.ndarray, ok: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``t`` ascending."""
    t, lat = t[ok], lat[ok]
    if not len(t):
        return np.array([]), np.array([])
    secs = np.arange(np.floor(t[0]), np.floor(t[-1]) + 1)
    edges = np.searchsorted(t, np.append(secs, secs[-1] + 1))
    keep = [(x, lo, hi) for x, lo, hi in zip(secs, edges[:-1], edges[1:], strict=True) if hi > lo]
    return np.array([x for x, _, _ in keep]), np.array([np.percentile(lat[lo:hi], 99) for _, lo, hi in keep])


def _legend(ax: plt.Axes, handles: list | None = None, **kw: object) -> None:
    """A legend of ``handles`` (default: the labelled artists), and none without any: matplotlib
    would warn "No artists with labels found to put in legend" or draw an empty box."""
    handles = ax.get_legend_handles_labels()[0] if handles is None else handles
    if handles:
        ax.legend(handles=handles, **kw)


def _ms(v: float | None) -> float:
    return float("nan") if v is None else v * 1e3


def _save(fig: plt.Figure, path: Path) -> None:
    plain = FuncFormatter(lambda v, _: f"{v:g}")
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            if axis.get_scale() == "log":
                axis.set_major_formatter(plain)
                axis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
