"""Reports: report.json, report.md, samples.csv and PNG plots in one directory; ``compare`` and ``render``.

python -m loadtest.report compare reportA/ reportB/ [--out compare.md] [--plot cdf.png]
python -m loadtest.report render report/      (rewrite report.md and the plots from report.json + samples)
python -m loadtest.report render report/ --recompute [--warmup S]   (the stats too, from samples.csv)
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .driver import DriveConfig
from .stats import Arrays, capacity, summarize_arrays

SAMPLE_FIELDS = ("run", "sched", "lag", "latency", "code", "scheme", "ran", "docs")
PLOTS = {
    "latency_over_time": "latency_over_time.png",
    "latency_cdf": "latency_cdf.png",
    "latency_throughput": "latency_throughput.png",
}


def write(out: Path, report: dict, runs: Sequence[tuple[str, Arrays]], samples: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if samples:
        write_samples(out / "samples.csv", runs)
    report["plots"] = render_plots(out, report, runs)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=_jsonable) + "\n")
    (out / "report.md").write_text(markdown(report))


def render_plots(out: Path, report: dict, runs: Sequence[tuple[str, Arrays]]) -> list[str]:
    """Over calls scheduled after the warm-up, like the stats; a sweep's runs grouped by scheme."""
    from . import plots

    warmup = report["config"].get("warmup_s") or 0.0
    group = {r["label"]: r["scheme"] if report.get("sweep") else r["label"] for r in report["runs"]}
    series = [(label, group.get(label, label), a.where(a.sched >= warmup)) for label, a in runs]
    written = []
    if series:
        plots.latency_over_time(series, out / PLOTS["latency_over_time"])
        plots.latency_cdf(series, out / PLOTS["latency_cdf"])
        written += [PLOTS["latency_over_time"], PLOTS["latency_cdf"]]
    if report.get("sweep"):
        plots.latency_throughput(report["runs"], out / PLOTS["latency_throughput"])
        written.append(PLOTS["latency_throughput"])
    return written


def write_samples(path: Path, runs: Sequence[tuple[str, Arrays]]) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(SAMPLE_FIELDS)
        for label, a in runs:
            for row in zip(a.sched, a.lag, a.latency, a.code, a.scheme, a.ran, a.docs, strict=True):
                w.writerow((label, f"{row[0]:.6f}", f"{row[1]:.6f}", f"{row[2]:.6f}", *row[3:]))


def read_samples(path: Path) -> list[tuple[str, Arrays]]:
    rows: dict[str, list[list[str]]] = {}
    with path.open(newline="") as f:
        for r in csv.DictReader(f):
            rows.setdefault(r["run"], []).append([r[k] for k in SAMPLE_FIELDS[1:]])
    out = []
    for label, rs in rows.items():
        cols = list(zip(*rs, strict=True))
        code = np.array(cols[3], dtype=object)
        out.append(
            (
                label,
                Arrays(
                    sched=np.array(cols[0], dtype=float),
                    lag=np.array(cols[1], dtype=float),
                    latency=np.array(cols[2], dtype=float),
                    ok=code == "OK",
                    code=code,
                    scheme=np.array(cols[4], dtype=object),
                    ran=np.array(cols[5], dtype=object),
                    docs=np.array(cols[6], dtype=np.int64),
                ),
            )
        )
    return out


def _jsonable(x: object) -> object:
    if isinstance(x, np.integer | np.floating):
        return x.item()
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def _rate(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def _codes(by_code: dict[str, int]) -> str:
    return ", ".join(f"{c} {n}" for c, n in by_code.items() if c != "OK") or "none"


def front_end(cfg: dict) -> str:
    """How a report's calls were sent: "gRPC ScoreDocs" or e.g. "HTTP cohere `POST /v2/rerank` (aiohttp)"."""
    api = cfg.get("api") or "grpc"
    if api == "grpc":
        return "gRPC ScoreDocs"
    client = f" ({cfg['http_client']})" if cfg.get("http_client") else ""
    return f"HTTP {api} `POST {cfg.get('api_path', '')}`{client}"


def markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [
        "# Load test report",
        "",
        f"Target `{cfg['target']}` over {front_end(cfg)}, requests from `{cfg['requests_file']}` "
        f"({report['workload']['requests']} requests, {report['workload']['docs_mean']:.1f} docs each on "
        "average), "
        f"{cfg['duration_s']:g} s per run, deadline {cfg['deadline_s'] * 1e3:g} ms, {report['created']}.",
        "Latency runs from each call's scheduled send time; percentiles are over ok calls.",
        "",
    ]
    if cfg.get("http_dropped"):
        fields = ", ".join(f"`{k}` ({n} requests)" for k, n in cfg["http_dropped"].items())
        lines += [f"Not sent (the {cfg['api']} body has no such field): {fields}.", ""]
    runs = report["runs"]
    if report.get("sweep"):
        lines += _sweep_md(report)
    for run in runs:
        lines += _run_md(run, heading=len(runs) > 1)
    lines += ["## Plots", ""] + [f"![{p}]({p})" for p in report.get("plots", [])]
    return "\n".join(lines) + "\n"


def _sweep_md(report: dict) -> list[str]:
    lines = [
        "## Sweep",
        "",
        "| scheme | offered/s | achieved/s | docs/s | p50 ms | p99 ms | max ms | failed | saturated |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in report["runs"]:
        lat = r["latency_seconds"]
        lines.append(
            f"| {r['scheme']} | {_rate(r['offered_rps'])} | {r['achieved_rps']:.1f} | "
            f"{r['achieved_docs_per_s']:.0f} | {_ms(lat['p50'])} | {_ms(lat['p99'])} | {_ms(lat['max'])} | "
            f"{_codes(r['by_code'])} | {'yes' if r['saturation']['saturated'] else 'no'} |"
        )
    lines += ["", "Highest achieved rate without saturation (and within the p99 objective, if given):", ""]
    for scheme, cap in report.get("capacity", {}).items():
        lines.append(
            f"- {scheme}: {_rate(cap['achieved_rps'])} calls/s, {_rate(cap['achieved_docs_per_s'])} docs/s"
        )
    return [*lines, ""]


def _run_md(run: dict, heading: bool) -> list[str]:
    lat, gen = run["latency_seconds"], run["generator"]
    lag = gen["lag_seconds"]
    lines = [f"## {run['label']}", ""] if heading else ["## Summary", ""]
    lines += [
        "| | |",
        "|---|---|",
        f"| offered calls/s | {_rate(run['offered_rps'])} |",
        f"| scheduled calls/s (this run's arrivals) | {run['scheduled_rps']:.1f} |",
        f"| achieved ok calls/s | {run['achieved_rps']:.1f} |",
        f"| offered docs/s | {_rate(run['offered_docs_per_s'])} |",
        f"| achieved docs/s | {run['achieved_docs_per_s']:.1f} |",
        f"| calls | {run['requests']} ({run['ok']} ok, {run['failed']} failed: {_codes(run['by_code'])}) |",
        f"| latency p50 / p90 / p99 / max | {_ms(lat['p50'])} / {_ms(lat['p90'])} / {_ms(lat['p99'])} / "
        f"{_ms(lat['max'])} ms |",
        f"| generator lag p50 / p99 / max | {_ms(lag['p50'])} / {_ms(lag['p99'])} / {_ms(lag['max'])} ms "
        f"({gen['note']}) |",
        "",
    ]
    sat = run["saturation"]
    lines.append("**Saturated**: " + "; ".join(sat["reasons"]) if sat["saturated"] else "Not saturated.")
    for code, msg in run.get("error_examples", {}).items():
        lines.append(f"- `{code}`: {msg}")
    lines += [
        "",
        "| scheme | calls | ok | failed | ok calls/s | docs/s | p50 ms | p90 ms | p99 ms | max ms | ran as |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for scheme, s in run["per_scheme"].items():
        sl = s["latency_seconds"]
        ran = ", ".join(f"{k} {v}" for k, v in s["ran"].items())
        lines.append(
            f"| {scheme} | {s['requests']} | {s['ok']} | {_codes(s['by_code'])} | {s['achieved_rps']:.1f} | "
            f"{s['achieved_docs_per_s']:.0f} | {_ms(sl['p50'])} | {_ms(sl['p90'])} | {_ms(sl['p99'])} | "
            f"{_ms(sl['max'])} | {ran} |"
        )
    if "server" in run:
        lines += ["", *_server_md(run["server"])]
    return [*lines, ""]


def _server_md(rec: dict) -> list[str]:
    verdict = rec.get("verdict", "match" if rec["matched"] else "do not match")
    verdict = verdict if rec["matched"] or verdict != "do not match" else "**do not match**"
    calls = f'`api="{rec["api"]}"` calls' if rec.get("api") else "every call"
    lines = [
        f"Server `/metrics` (change over the run, {calls}, warm-up included): client and server counts "
        f"{verdict}.",
        "",
        "| count | client | server | diff |",
        "|---|---:|---:|---:|",
    ]
    for name, row in rec["rows"].items():
        lines.append(f"| {name} | {row['client']:g} | {row['server']:g} | {row['diff']:+g} |")
    st = rec.get("server_stages") or {}
    if st:
        each = ", ".join(f"{k[: -len('_ms_mean')]} {v:g}" for k, v in st.items() if k.endswith("_ms_mean"))
        batches = (
            f"; {st['batches']:g} batches of {st['batch_calls_mean']:g} calls and {st['batch_tokens_mean']:g}"
            " tokens on average"
            if "batches" in st
            else ""
        )
        lines += ["", f"On the server, a call's mean ms by stage (every front end's calls): {each}{batches}."]
    return lines


def recompute(report: dict, runs: Sequence[tuple[str, Arrays]], warmup_s: float | None = None) -> dict:
    """The stats of every run again from its samples (this version's code, or another warm-up);
    the /metrics reconciliation is kept as it was measured."""
    cfg = report["config"]
    if warmup_s is not None:
        cfg["warmup_s"] = warmup_s
    samples = dict(runs)
    fresh = []
    for run in report["runs"]:
        drive = DriveConfig(
            target=cfg["target"],
            duration_s=cfg["duration_s"],
            rate=run["offered_rps"] or 0.0,
            concurrency=run.get("concurrency") or 0,
        )
        summary = summarize_arrays(
            samples[run["label"]],
            drive,
            cfg.get("warmup_s") or 0.0,
            run["wall_s"],
            run["error_examples"],
            run["generator"]["unfinished"],
        )
        keep = {k: run[k] for k in ("label", "scheme", "api", "server") if k in run}
        fresh.append({**keep, **summary})
    top = {
        k: v for k, v in report.items() if k in ("loadtest_version", "created", "config", "workload", "sweep")
    }
    top["runs"] = fresh
    if top.get("sweep"):
        slo = cfg.get("slo_p99_ms")
        top["capacity"] = capacity(fresh, slo / 1000 if slo else None)
    else:
        top.update({k: v for k, v in fresh[0].items() if k not in ("label", "timeline")})
    return top


def load(path: Path) -> dict:
    return json.loads((path / "report.json" if path.is_dir() else path).read_text())


def rate_rows(report: dict) -> list[dict]:
    """A sweep's runs, one row each: offered and achieved calls/s, docs/s, p99 in ms (None where no
    call succeeded) and the calls that failed (what the benchmarks that sweep a server keep)."""
    return [
        {
            "offered_calls_s": r["offered_rps"],
            "calls_s": r["achieved_rps"],
            "docs_s": r["achieved_docs_per_s"],
            "p99_ms": None if r["latency_seconds"]["p99"] is None else r["latency_seconds"]["p99"] * 1e3,
            "failed": r["failed"],
        }
        for r in report["runs"]
    ]


def compare(a: dict, b: dict, names: tuple[str, str] = ("A", "B")) -> str:
    """Markdown: the runs of A and B at the same load side by side (see ``pair_runs``), after a
    warning where the reports' offered rates differ."""
    pairs, notes = pair_runs(a, b, names)
    lines = [f"# Compare: {names[0]} vs {names[1]}", ""]
    if "api" in a["config"] or "api" in b["config"]:
        lines += [
            f"- {n}: `{r['config']['target']}` over {front_end(r['config'])}"
            for n, r in zip(names, (a, b), strict=True)
        ]
        lines.append("")
    if notes:
        lines += [*(f"- **Warning**: {n}" for n in notes), ""]
    if not pairs:
        lines += ["No two runs at the same offered rate: nothing compared.", ""]
    for ra, rb in pairs:
        label = ra["label"] if ra["label"] == rb["label"] else f"{ra['label']} vs {rb['label']}"
        lines += [f"## {label}", "", f"| | {names[0]} | {names[1]} | change |", "|---|---:|---:|---:|"]
        for name, fa, fb in _compare_rows(ra, rb):
            lines.append(f"| {name} | {_fmt(fa)} | {_fmt(fb)} | {_change(fa, fb)} |")
        lines.append("")
    return "\n".join(lines)


def pair_runs(
    a: dict, b: dict, names: tuple[str, str] = ("A", "B")
) -> tuple[list[tuple[dict, dict]], list[str]]:
    """Each run of A with the run of B of the same label, else of the same offered load (rate in open
    loop, concurrency in closed loop), in A's order; runs at different loads are never paired. The
    notes say where the loads differ and which runs were left out."""
    runs_a, runs_b = a["runs"], b["runs"]
    match: dict[int, int] = {}
    free = list(range(len(runs_b)))
    for key in (lambda r: r["label"], _load):
        for i, ra in enumerate(runs_a):
            j = None if i in match else next((j for j in free if key(runs_b[j]) == key(ra)), None)
            if j is not None:
                match[i] = j
                free.remove(j)
    loads_a, loads_b = (list(dict.fromkeys(_load(r) for r in runs)) for runs in (runs_a, runs_b))
    notes = []
    if set(loads_a) != set(loads_b):
        notes.append(
            f"the offered rates differ: {names[0]} ran {', '.join(loads_a)}; {names[1]} ran "
            f"{', '.join(loads_b)}. Runs are compared only at the same rate."
        )
    only_a = [r["label"] for i, r in enumerate(runs_a) if i not in match]
    only_b = [runs_b[j]["label"] for j in free]
    for name, only in zip(names, (only_a, only_b), strict=True):
        if only:
            notes.append(f"not compared, only in {name}: {', '.join(only)}.")
    return [(runs_a[i], runs_b[j]) for i, j in sorted(match.items())], notes


def _load(run: dict) -> str:
    """What a run offered: "100/s" in open loop, "x4 concurrent" in closed loop."""
    rate = run.get("offered_rps")
    return f"{rate:g}/s" if rate else f"x{run.get('concurrency')} concurrent"


def _compare_rows(ra: dict, rb: dict) -> list[tuple[str, float | None, float | None]]:
    rows: list[tuple[str, float | None, float | None]] = [
        ("offered calls/s", ra["offered_rps"], rb["offered_rps"]),
        ("achieved ok calls/s", ra["achieved_rps"], rb["achieved_rps"]),
        ("achieved docs/s", ra["achieved_docs_per_s"], rb["achieved_docs_per_s"]),
        ("failed calls", ra["failed"], rb["failed"]),
    ]
    for q in ("p50", "p90", "p99", "max"):
        rows.append(
            (f"latency {q} ms", _ms_or_none(ra["latency_seconds"][q]), _ms_or_none(rb["latency_seconds"][q]))
        )
    rows.append(
        (
            "generator lag p99 ms",
            _ms_or_none(ra["generator"]["lag_seconds"]["p99"]),
            _ms_or_none(rb["generator"]["lag_seconds"]["p99"]),
        )
    )
    for scheme in sorted(set(ra["per_scheme"]) & set(rb["per_scheme"])):
        la, lb = ra["per_scheme"][scheme]["latency_seconds"], rb["per_scheme"][scheme]["latency_seconds"]
        rows.append((f"{scheme} p99 ms", _ms_or_none(la["p99"]), _ms_or_none(lb["p99"])))
    return rows


def _ms_or_none(v: float | None) -> float | None:
    return None if v is None else v * 1e3


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)


def _change(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return "-"
    if a == 0:
        return "same" if b == 0 else f"{b - a:+g}"
    return f"{100 * (b - a) / a:+.1f}%"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.report", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compare", help="two reports side by side (markdown on stdout)")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    c.add_argument("--out", type=Path, help="also write the markdown here")
    c.add_argument("--plot", type=Path, help="write a CDF of both runs' latencies here (needs samples.csv)")
    r = sub.add_parser("render", help="rewrite report.md and the plots of a report directory")
    r.add_argument("dir", type=Path)
    r.add_argument("--recompute", action="store_true", help="recompute the stats from samples.csv")
    r.add_argument("--warmup", type=float, help="with --recompute: leave this many seconds out instead")
    args = p.parse_args(argv)
    if args.command == "render":
        report = load(args.dir)
        path = args.dir / "samples.csv"
        samples = read_samples(path) if path.exists() else []
        if args.recompute:
            if not samples:
                p.error(f"--recompute needs {path}")
            report = recompute(report, samples, args.warmup)
        report["plots"] = render_plots(args.dir, report, samples)
        (args.dir / "report.json").write_text(json.dumps(report, indent=1, default=_jsonable) + "\n")
        (args.dir / "report.md").write_text(markdown(report))
        print(f"rendered {args.dir}/report.md and {len(report['plots'])} plots", file=sys.stderr)
        return 0
    names = (str(args.a), str(args.b))
    a, b = load(args.a), load(args.b)
    for note in pair_runs(a, b, names)[1]:
        print(f"warning: {note}", file=sys.stderr)
    text = compare(a, b, names)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.plot:
        from . import plots

        series = []
        for name, d in zip(names, (args.a, args.b), strict=True):
            series += [(f"{name}: {label}", label, a) for label, a in read_samples(d / "samples.csv")]
        plots.latency_cdf(series, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
