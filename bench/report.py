"""Markdown tables and heat maps from the benchmarks' JSON (runs anywhere, no GPU).

python -m bench.report [--data bench/data] [--out bench]

Kernel grids from DATA/kernels (``bench.kernels``), the model level from DATA/cost_model (``bench.e2e``,
the measurements the packaged cost model is fitted on: a later run of some schemes fills their cells).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from statistics import geometric_mean

from scorer.planning import REGISTRY as _REG

UNGROUPED = tuple(n for n, s in _REG.items() if not s.grouped)

ARTICLE_CELLS = [(p, s, m) for p in (96, 8196) for s in (4, 256) for m in (2, 32)]
ROWS = list(UNGROUPED) + ["grouped:4", "grouped:8", "grouped:16"]
# The article's table (its grid of P, S and M: FlashInfer 0.6.15.post1, page_size 16, fp16, its GPU), ms.
ARTICLE_MS = {
    "naive": [0.037, 0.094, 0.086, 0.437, 9.883, 145.487, 10.469, 154.564],
    "split_cache": [0.049, 0.060, 0.137, 0.404, 5.361, 5.909, 6.039, 14.692],
    "ragged": [0.036, 0.043, 0.113, 0.346, 5.425, 7.422, 5.953, 14.094],
    "cascade": [0.114, 0.115, 0.163, 0.505, 5.452, 5.557, 6.312, 15.245],
    "multi_item": [0.038, 0.059, 0.131, 0.551, 5.295, 5.448, 5.906, 14.133],
    "custom_mask": [0.048, 0.071, 0.159, 12.508, 12.668, 13.007, 14.085, 51.788],
}
FAMILY_COLORS = {
    "naive": "#7f7f7f",
    "split_cache": "#bcbd22",
    "ragged": "#1f77b4",
    "cascade": "#d62728",
    "multi_item": "#2ca02c",
    "custom_mask": "#9467bd",
    "grouped": "#ff7f0e",
}


def cell_name(p: int, s: int, m: int) -> str:
    return f"P{p} S{s} M{m}"


def family(label: str) -> str:
    return label.split("/")[0].split(":")[0]


def timed(results: dict, key: str = "mean_ms") -> dict[str, float]:
    return {k: r[key] for k, r in results.items() if isinstance(r, dict) and key in r}


def fmt(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:.{digits}f}"


def article_tables(data: dict) -> str:
    """The article's layout: kernel ms per scheme and cell, then speed-up over naive."""
    cells = {(c["P"], c["S"], c["M"]): c for c in data["cells"] if "results" in c}
    head = "| scheme | " + " | ".join(cell_name(*c) for c in ARTICLE_CELLS) + " |\n"
    head += "|---" * (len(ARTICLE_CELLS) + 1) + "|\n"
    out = []
    for kernel, key, title in [
        ("fa3", "mean_ms", "FA3 (custom_mask: FA2), kernel ms, mean of 100"),
        ("fa2", "mean_ms", "FA2, kernel ms, mean of 100"),
        ("fa3", "graph", "FA3 (custom_mask: FA2) replayed from a CUDA graph, ms"),
    ]:
        table = {}
        for row in ROWS:
            k = f"{row}/{'fa2' if row == 'custom_mask' else kernel}"
            vals = []
            for c in ARTICLE_CELLS:
                r = cells.get(c, {}).get("results", {}).get(k, {})
                v = r.get("graph", {}).get("mean_ms") if key == "graph" else r.get(key)
                vals.append(v)
            table[row] = vals
        lines = [f"| {row} | " + " | ".join(fmt(v) for v in vals) + " |" for row, vals in table.items()]
        out.append(f"**{title}**\n\n" + head + "\n".join(lines))
        naive = table["naive"]
        sp = [
            f"| {row} | "
            + " | ".join(fmt(n / v if n and v else None, 2) for n, v in zip(naive, vals, strict=True))
            for row, vals in table.items()
            if row != "naive"
        ]
        out.append(f"**{title}: speed-up over naive**\n\n" + head + " |\n".join(sp) + " |")
    lines = [f"| {row} | " + " | ".join(fmt(v) for v in vals) + " |" for row, vals in ARTICLE_MS.items()]
    out.append("**The article's numbers (its GPU, page_size 16), ms**\n\n" + head + "\n".join(lines))
    return "\n\n".join(out) + "\n"


def best_table(data: dict) -> str:
    """Per cell: the fastest variant, the article's pick (on FA3) and the margin between them."""
    lines = [
        "| P | S | M | best | best ms | article pick | article ms | article / best | naive / best |",
        "|---:|---:|---:|---|---:|---|---:|---:|---:|",
    ]
    for c in data["cells"]:
        t = timed(c.get("results", {}))
        if not t:
            continue
        best = min(t, key=t.get)
        pick = f"{c['article_choice']}/fa3"
        a, n = t.get(pick), t.get("naive/fa3")
        lines.append(
            f"| {c['P']} | {c['S']} | {c['M']} | {best} | {fmt(t[best], 4)} | {c['article_choice']} | "
            f"{fmt(a, 4)} | {fmt(a / t[best] if a else None, 2)} | {fmt(n / t[best] if n else None, 2)} |"
        )
    return "\n".join(lines) + "\n"


def heatmap(
    cells: list[dict], title: str, path: Path, key: str = "mean_ms", pick_key: str = "article_choice"
) -> None:
    """One panel per M: P across, S up; colour = fastest scheme family, text = its margin over the
    article's pick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ms = sorted({c["M"] for c in cells})
    ps = sorted({c["P"] for c in cells})
    ss = sorted({c["S"] for c in cells})
    fig, axes = plt.subplots(1, len(ms), figsize=(3.2 * len(ms), 3.6), squeeze=False)
    for ax, m in zip(axes[0], ms, strict=True):
        for c in (c for c in cells if c["M"] == m):
            t = timed(c.get("results", {}), key)
            if not t:
                continue
            best = min(t, key=t.get)
            x, y = ps.index(c["P"]), ss.index(c["S"])
            ax.add_patch(
                plt.Rectangle((x - 0.5, y - 0.5), 1, 1, color=FAMILY_COLORS[family(best)], alpha=0.85)
            )
            pick = c.get(pick_key)
            a = next(
                (v for k, v in t.items() if k.split("/")[0] == pick and (k.endswith("fa3") or "/" not in k)),
                None,
            )
            short = best.replace("grouped:", "g").replace("/fa3", "").replace("/fa2", "*")
            ax.text(
                x, y, f"{short}\n{a / t[best]:.2f}x" if a else short, ha="center", va="center", fontsize=6
            )
        ax.set_xticks(range(len(ps)), [str(p) for p in ps], fontsize=7, rotation=45)
        ax.set_yticks(range(len(ss)), [str(s) for s in ss], fontsize=7)
        ax.set_xlim(-0.5, len(ps) - 0.5)
        ax.set_ylim(-0.5, len(ss) - 0.5)
        ax.set_title(f"M = {m}", fontsize=9)
        ax.set_xlabel("P (prefix tokens)", fontsize=8)
    axes[0][0].set_ylabel("S (tokens per doc)", fontsize=8)
    handles = [Patch(color=c, label=f) for f, c in FAMILY_COLORS.items()]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=7, frameon=False)
    fig.suptitle(title + "  (text: fastest; margin over the article's pick; * = FA2)", fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    fig.savefig(path, dpi=130)
    plt.close(fig)


def ratio_table(base: dict, other: dict, pair, header: str) -> str:
    """Per row name: geometric mean of base time / other time over the cells both ran, and how often
    ``other`` is faster. ``pair(label)`` maps a label of ``other`` to (row name, label in ``base``)
    or None."""
    a = {(c["P"], c["S"], c["M"]): timed(c["results"]) for c in base["cells"] if "results" in c}
    ratios: dict[str, list[float]] = {}
    for c in other["cells"]:
        for label, ms in timed(c.get("results", {})).items():
            paired = pair(label)
            ref = paired and a.get((c["P"], c["S"], c["M"]), {}).get(paired[1])
            if ref:
                ratios.setdefault(paired[0], []).append(ref / ms)
    lines = [header, "|---|---:|---:|---:|"]
    for name, r in ratios.items():
        lines.append(f"| {name} | {len(r)} | {geometric_mean(r):.2f} | {sum(x > 1 for x in r)} |")
    return "\n".join(lines) + "\n"


def kernel_ratio_table(fa3: dict, fa2: dict) -> str:
    """Per scheme over the wide grid: geometric mean of FA3 time / FA2 time and how often FA2 wins."""
    header = "| scheme | cells | FA3 ms / FA2 ms (geomean) | FA2 faster in |"
    pair = lambda k: "/fa2" in k and (k.split("/")[0], k.replace("/fa2", "/fa3"))  # noqa: E731
    return ratio_table(fa3, fa2, pair, header)


def page_size_table(data: dict) -> str:
    """Per scheme, kernel and page size: geometric mean of page_size-1 time / paged time."""
    header = "| scheme / kernel / page size | cells | page_size 1 ms / paged ms (geomean) | paged faster in |"
    return ratio_table(data, data, lambda k: "/p" in k and (k, k.rsplit("/", 1)[0]), header)


CURVE_ROWS = (16, 256, 1024, 2048, 4096, 8192, 16384, 65536)


def curves_table(e2e: dict) -> str:
    """The forward without attention in each configuration, at the nearest measured row count
    at or above each of CURVE_ROWS (the graphs run padded to their bucket)."""
    curves = e2e.get("gemm_curves") or {"graphs+fused": e2e["gemm_curve"]}
    names = list(curves)
    lines = ["| rows | " + " | ".join(names) + " |", "|---:" * (len(names) + 1) + "|"]
    for n in CURVE_ROWS:
        cells = []
        for name in names:
            pts = sorted((int(k), v) for k, v in curves[name].items())
            at = next(((k, v) for k, v in pts if k >= n), None)
            cells.append("-" if at is None else f"{at[1]:.2f}" + ("" if at[0] == n else f" ({at[0]})"))
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def eager_vs_graphs_table(e2e: dict) -> str:
    """Held-out cells: the fastest scheme and the article's pick eager with HF's op order and in
    the serving configuration (graphs, fused kernels); empty where the run timed no eager forward
    (``bench.e2e --compare ""``)."""
    from scorer.planning import Shape, article_choice

    lines = [
        "| P | S | M | eager: fastest | ms | rule ms | graphs+fused: fastest | ms | rule ms | speed-up |",
        "|---:|---:|---:|---|---:|---:|---|---:|---:|---:|",
    ]
    from scorer.planning.cost_model import CostModel, label

    model, fastest, product = CostModel.load(), [], []
    for c in e2e["cells"]:
        if c.get("split") != "heldout" or "results_eager" not in c:
            continue
        shape = Shape(c["P"], (c["S"],) * c["M"])
        rule, auto = article_choice(shape), label(*model.choose(shape))
        e, g = timed(c["results_eager"], "forward_ms"), timed(c["results"], "forward_ms")
        be, bg = min(e, key=e.get), min(g, key=g.get)
        fastest.append(e[be] / g[bg])
        product.append(e[rule] / g[auto])
        lines.append(
            f"| {c['P']} | {c['S']} | {c['M']} | {be} | {e[be]:.2f} | {fmt(e.get(rule), 2)} | {bg} | "
            f"{g[bg]:.2f} | {fmt(g.get(rule), 2)} | {e[be] / g[bg]:.2f}x |"
        )

    lines.append(
        f"\nGeometric mean over the {len(fastest)} cells: fastest scheme, eager -> graphs+fused "
        f"{geometric_mean(fastest):.2f}x; the article's rule on the eager forward -> calibrated auto on "
        f"graphs+fused {geometric_mean(product):.2f}x."
    )
    return "\n".join(lines) + "\n"


def e2e_section(e2e: dict) -> str:
    """The forward without attention, eager vs graphs, the held-out evaluation (both objectives)
    and every cell's fastest scheme."""
    from scorer.planning.cost_model import CostModel

    from .cost_fit import evaluate, evaluation_markdown

    model = CostModel.load()
    parts = [
        "**Forward without attention (attention replaced by a copy), ms**\n\n" + curves_table(e2e),
    ]
    if any("results_eager" in c for c in e2e["cells"]):
        parts.append(
            "**Held-out shapes: eager with HF's op order vs CUDA graphs with fused kernels, forward ms**\n\n"
            + eager_vs_graphs_table(e2e)
        )
    for objective in ("forward", "latency"):
        rows, summary = evaluate(e2e, model, "heldout", objective)
        parts.append(
            f"**Held-out shapes, objective {objective} (ms)**\n\n" + evaluation_markdown(rows, summary)
        )
    rows, summary = evaluate(e2e, model, "train", "forward")
    parts.append(
        "**Train shapes (fitted on), objective forward (ms)**\n\n" + evaluation_markdown(rows, summary)
    )
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=Path("bench/data"))
    ap.add_argument("--out", type=Path, default=Path("bench"))
    a = ap.parse_args(argv)
    parts = []
    kern, model = a.data / "kernels", a.data / "cost_model"
    art = kern / "kernels_article.json"
    if art.exists():
        d = json.loads(art.read_text())
        parts.append("## Article grid\n\n" + article_tables(d) + "\n" + best_table(d))
    wide = kern / "kernels_wide.json"
    if wide.exists():
        from .cost_fit import merge_grids

        fa3 = merge_grids(
            [json.loads(p.read_text()) for p in (wide, kern / "kernels_wide_p16384.json") if p.exists()]
        )
        parts.append("## Wide grid, FA3\n\n" + best_table(fa3))
        heatmap(
            [c for c in fa3["cells"] if "results" in c], "Kernel time, H200, FA3", a.out / "kernels_wide.png"
        )
        fa2_path = kern / "kernels_wide_fa2.json"
        if fa2_path.exists():
            fa2 = json.loads(fa2_path.read_text())
            both = merge_grids([fa3, fa2])
            parts.append("## Wide grid, FA2 against FA3 per scheme\n\n" + kernel_ratio_table(fa3, fa2))
            parts.append("## Wide grid, fastest of FA2 and FA3\n\n" + best_table(both))
    pages = kern / "kernels_article_pages.json"
    if pages.exists():
        parts.append("## Article grid, page sizes\n\n" + page_size_table(json.loads(pages.read_text())))
    (a.out / "kernels.md").write_text("\n".join(parts))
    e2e_path = model / "e2e.json"
    if e2e_path.exists():
        from scorer.planning import Shape, article_choice

        from .cost_fit import load_e2e

        e2e = load_e2e(e2e_path, sorted(model.glob("e2e_*.json")))
        (a.out / "e2e.md").write_text("## Model level (Qwen3-0.6B shape, bf16)\n\n" + e2e_section(e2e))
        cells = [c for c in e2e["cells"] if c["split"] == "train"]
        for c in cells:
            c["article_choice"] = article_choice(Shape(c["P"], (c["S"],) * c["M"]))
        heatmap(cells, "Model-level forward, H200 (train shapes)", a.out / "e2e_train.png", "forward_ms")


if __name__ == "__main__":
    main()
