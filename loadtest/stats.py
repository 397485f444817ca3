"""From a run's samples to its summary: rates, latency percentiles, codes, per scheme, saturation."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np

from .driver import DriveConfig, Samples

QUANTILES = {"p50": 50, "p90": 90, "p99": 99, "p999": 99.9}
LAG_BEHIND_S = 0.010  # a driver whose p99 lag exceeds this did not keep to its schedule
RISING_RATIO = 2.0  # latency "rising": last third's median at least this times the first third's


@dataclass
class Arrays:
    sched: np.ndarray
    lag: np.ndarray
    latency: np.ndarray
    ok: np.ndarray
    code: np.ndarray
    scheme: np.ndarray
    ran: np.ndarray
    docs: np.ndarray

    @classmethod
    def of(cls, s: Samples) -> Arrays:
        order = np.argsort(np.asarray(s.sched), kind="stable")
        code = np.asarray(s.code, dtype=object)[order]
        return cls(
            sched=np.asarray(s.sched, dtype=float)[order],
            lag=np.asarray(s.lag, dtype=float)[order],
            latency=np.asarray(s.latency, dtype=float)[order],
            ok=code == "OK",
            code=code,
            scheme=np.asarray(s.scheme, dtype=object)[order],
            ran=np.asarray(s.ran, dtype=object)[order],
            docs=np.asarray(s.docs, dtype=np.int64)[order],
        )

    def where(self, mask: np.ndarray) -> Arrays:
        return Arrays(**{k: v[mask] for k, v in vars(self).items()})


def latency_stats(lat: np.ndarray) -> dict[str, float | int | None]:
    if not len(lat):
        return {"count": 0, **dict.fromkeys([*QUANTILES, "max", "mean"])}
    qs = np.percentile(lat, list(QUANTILES.values()))
    out: dict[str, float | int | None] = {"count": len(lat)}
    out.update({k: float(v) for k, v in zip(QUANTILES, qs, strict=True)})
    out.update(max=float(lat.max()), mean=float(lat.mean()))
    return out


def counts(a: Arrays, window_s: float) -> dict:
    by_code = dict(sorted(Counter(a.code.tolist()).items()))
    ok = int(a.ok.sum())
    docs_ok = int(a.docs[a.ok].sum())
    return {
        "requests": len(a.latency),
        "ok": ok,
        "failed": len(a.latency) - ok,
        "by_code": by_code,
        "docs": int(a.docs.sum()),
        "docs_ok": docs_ok,
        "achieved_rps": ok / window_s if window_s > 0 else 0.0,
        "achieved_docs_per_s": docs_ok / window_s if window_s > 0 else 0.0,
        "latency_seconds": latency_stats(a.latency[a.ok]),
        "latency_seconds_all": latency_stats(a.latency),
    }


def summarize(s: Samples, cfg: DriveConfig, warmup_s: float = 0.0) -> dict:
    """Stats over calls scheduled after ``warmup_s``; ``client_totals`` counts every call (for /metrics)."""
    return summarize_arrays(Arrays.of(s), cfg, warmup_s, s.wall_s, s.error_examples, s.unfinished)


def summarize_arrays(
    everything: Arrays,
    cfg: DriveConfig,
    warmup_s: float,
    wall_s: float,
    error_examples: dict[str, str],
    unfinished: int = 0,
) -> dict:
    a = everything.where(everything.sched >= warmup_s)
    span = max(cfg.duration_s - warmup_s, 1e-9)
    window = max(completion_span(a), span)
    out: dict = {"mode": "open" if cfg.rate > 0 else "closed", "window_s": window, "wall_s": wall_s}
    if cfg.rate > 0:
        out["offered_rps"] = cfg.rate
        out["offered_docs_per_s"] = cfg.rate * float(a.docs.mean()) if len(a.docs) else 0.0
    else:
        out["concurrency"] = cfg.concurrency
        out["offered_rps"] = out["offered_docs_per_s"] = None
    out["scheduled_rps"] = len(a.latency) / span
    out.update(counts(a, window))
    out["error_examples"] = error_examples
    out["per_scheme"] = {}
    for scheme in sorted(set(a.scheme.tolist())):
        sub = a.where(a.scheme == scheme)
        entry = counts(sub, window)
        entry["ran"] = dict(Counter(x for x in sub.ran.tolist() if x))
        out["per_scheme"][scheme] = entry
    out["generator"] = generator_stats(a, unfinished)
    out["saturation"] = saturation(out, a)
    out["timeline"] = timeline(a)
    out["client_totals"] = {
        "requests": len(everything.latency),
        "failed": int((~everything.ok).sum()),
        "by_code": dict(Counter(everything.code.tolist())),
        "docs_ok": int(everything.docs[everything.ok].sum()),
    }
    return out


def completion_span(a: Arrays) -> float:
    """Seconds from the first ok completion to the last (per gap between them).

    The rate's window is the longer of this and the run's schedule: the schedule while the server
    keeps up (completions are then the arrivals shifted by their latency), the completions when
    they trail past the end because the server fell behind, at the server's own pace.
    """
    done = (a.sched + a.latency)[a.ok]
    if len(done) < 2:
        return 0.0
    return float(done.max() - done.min()) * len(done) / (len(done) - 1)


def generator_stats(a: Arrays, unfinished: int) -> dict:
    lag = latency_stats(a.lag)
    behind = bool(lag["count"] and lag["p99"] > LAG_BEHIND_S)
    note = (
        f"the generator sent 1% of calls more than {lag['p99'] * 1e3:.1f} ms late: it could not keep to the "
        "schedule (latency still counts from the scheduled time)"
        if behind
        else "kept to schedule"
    )
    return {"lag_seconds": lag, "behind_schedule": behind, "unfinished": unfinished, "note": note}


def saturation(summary: dict, a: Arrays) -> dict:
    """Signs the offered load exceeded what the server sustains (in closed loop, only failures count:
    a closed loop runs at the server's pace by construction)."""
    reasons = []
    if summary["mode"] == "open" and summary["achieved_rps"] < 0.9 * summary["scheduled_rps"]:
        reasons.append(
            f"achieved {summary['achieved_rps']:.1f} ok calls/s < 90% of the "
            f"{summary['scheduled_rps']:.1f}/s scheduled"
        )
    if summary["failed"]:
        codes = ", ".join(f"{c} {n}" for c, n in summary["by_code"].items() if c != "OK")
        reasons.append(f"{summary['failed']} of {summary['requests']} calls failed ({codes})")
    ok_lat = a.latency[a.ok]
    if summary["mode"] == "open" and len(ok_lat) >= 30:
        third = len(ok_lat) // 3
        first, last = float(np.median(ok_lat[:third])), float(np.median(ok_lat[-third:]))
        if last > RISING_RATIO * first and last - first > 0.005:
            reasons.append(
                f"latency rising: median {first * 1e3:.1f} ms in the first third of the run, "
                f"{last * 1e3:.1f} ms in the last"
            )
    return {"saturated": bool(reasons), "reasons": reasons}


def timeline(a: Arrays, step_s: float = 1.0) -> list[dict]:
    """Per ``step_s`` of scheduled time (``a`` sorted by it): calls sent, ok, failed, ok latency p50/p99."""
    if not len(a.sched):
        return []
    first, last = int(a.sched[0] // step_s), int(a.sched[-1] // step_s)
    edges = np.searchsorted(a.sched, np.arange(first, last + 2) * step_s)
    out = []
    for k, (lo, hi) in enumerate(zip(edges[:-1], edges[1:], strict=True)):
        ok = a.ok[lo:hi]
        lat = a.latency[lo:hi][ok]
        out.append(
            {
                "t": (first + k) * step_s,
                "sent": int(hi - lo),
                "ok": int(ok.sum()),
                "failed": int(hi - lo - ok.sum()),
                "p50": float(np.percentile(lat, 50)) if len(lat) else None,
                "p99": float(np.percentile(lat, 99)) if len(lat) else None,
            }
        )
    return out


def capacity(runs: list[dict], slo_p99_s: float | None) -> dict:
    """Per scheme: the run with the highest achieved rate that was not saturated (and met the p99 SLO)."""
    out = {}
    for scheme in sorted({r["scheme"] for r in runs}):
        good = [
            r
            for r in runs
            if r["scheme"] == scheme
            and not r["saturation"]["saturated"]
            and (slo_p99_s is None or (r["latency_seconds"]["p99"] or 1e9) <= slo_p99_s)
        ]
        best = max(good, key=lambda r: r["achieved_rps"], default=None)
        out[scheme] = {
            "achieved_rps": best["achieved_rps"] if best else None,
            "achieved_docs_per_s": best["achieved_docs_per_s"] if best else None,
            "offered_rps": best["offered_rps"] if best else None,
        }
    return out
