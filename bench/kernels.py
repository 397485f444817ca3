"""Kernel-level benchmark: one attention layer of every scheme on FlashInfer, P x S x M.

One prompt of ``P`` tokens and ``M`` docs of ``S`` tokens; 16 query heads, 8 kv heads,
head_dim 128, fp16 (the article's setting). Q/K/V of the logical tokens are random; each
scheme's rows (and, for ``split_cache``, its K/V pool) are gathered before timing, and each
pass is planned before timing, so the kernel times EXCLUDE ``plan()`` and the planner, as the
article's do; both are timed separately (``plan_ms``: FlashInferBackend.plan of all passes,
host wall time; ``planner_ms``: the Python planner). Times are device times from CUDA events.

    python -m bench.kernels --grid article --out out/        # 10 warm-ups, 100 timed runs
    python -m bench.kernels --grid wide --cap 0.1 --out out/ # ~120 log-spaced cells, capped
    python -m bench.kernels --grid article --page-sizes 1,16,64 --tag pages --out out/

With ``--page-sizes`` every variant also runs on K/V copied into pages of that size
(``bench.paging``; the copy is made before timing), labelled ``scheme/kernel/pN``.
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from scorer.attention.base import HeadSpec
from scorer.attention.flashinfer import FlashInferBackend
from scorer.planning import REGISTRY, Plan, Shape, article_choice, check_plan, get

from .paging import to_pages
from .timing import capture_graph, environment, time_gpu, time_host, write_json

SCHEMES = tuple(n for n, s in REGISTRY.items() if not s.grouped)

HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128
DTYPE = torch.float16
GROUP_SIZES = (4, 8, 16, 64)
GRIDS: dict[str, list[tuple[int, int, int]]] = {
    "article": [(p, s, m) for p in (96, 8196) for s in (4, 256) for m in (2, 32)],
    "wide": [
        (p, s, m)
        for p in (32, 128, 512, 2048, 8192, 16384)
        for s in (1, 16, 128, 1024)
        for m in (1, 4, 16, 64, 256)
    ],
    "smoke": [(96, 4, 2), (700, 33, 5)],
}
MAX_NAIVE_ROWS = 2_200_000
MAX_MASK_TOKENS = {"article": 16_400, "wide": 8_448, "smoke": 4_096}


@dataclass(frozen=True)
class Variant:
    scheme: str
    group: int
    kernel: str
    page: int = 1

    @property
    def label(self) -> str:
        name = get(self.scheme).label(self.group)
        return f"{name}/{self.kernel}" + (f"/p{self.page}" if self.page != 1 else "")

    def planner(self):
        return get(self.scheme).planner(self.group or 8)


def variants(kernels: tuple[str, ...], m: int, pages: tuple[int, ...] = (1,)) -> list[Variant]:
    out = []
    for page in pages:
        for k in kernels:
            out += [Variant(s, 0, k, page) for s in SCHEMES if s != "custom_mask"]
            out += [Variant("grouped", g, k, page) for g in GROUP_SIZES if g < m]
        out.append(Variant("custom_mask", 0, "fa2", page))
    return out


def skip_reason(v: Variant, shape: Shape, grid: str) -> str | None:
    p, m, s = shape.prefix_len, len(shape.item_lens), shape.item_lens[0]
    if v.scheme == "naive" and m * (p + s) > MAX_NAIVE_ROWS:
        return f"naive recomputes {m * (p + s)} rows (cap {MAX_NAIVE_ROWS})"
    if v.scheme == "custom_mask" and shape.num_tokens > MAX_MASK_TOKENS[grid]:
        return f"explicit mask over {shape.num_tokens} tokens (cap {MAX_MASK_TOKENS[grid]})"
    return None


class Runner:
    """Keeps one FlashInferBackend per (kernel, pass) and the logical Q/K/V of the current cell."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.spec = HeadSpec(HEADS, KV_HEADS, HEAD_DIM, DTYPE, device)
        self.backends: dict[tuple[str, int], FlashInferBackend] = {}

    def backend(self, kernel: str, index: int) -> FlashInferBackend:
        key = (kernel, index)
        if key not in self.backends:
            self.backends[key] = FlashInferBackend(self.spec, kernels=kernel)
        return self.backends[key]

    def inputs(self, plan: Plan, qkv: list[torch.Tensor]):
        """Per pass: (pass, q rows, K pool, V pool); the pool holds every pass's K/V already."""
        q, k, v = qkv
        idx = [p.logical.to(self.device) for p in plan.passes]
        if len(plan.passes) == 1:
            return [(plan.passes[0], q[idx[0]], k[idx[0]], v[idx[0]])]
        kp = torch.empty(plan.num_slots, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=self.device)
        vp = torch.empty_like(kp)
        for p, i in zip(plan.passes, idx, strict=True):
            kp[p.slot_offset : p.slot_offset + p.num_rows] = k[i]
            vp[p.slot_offset : p.slot_offset + p.num_rows] = v[i]
        return [(p, q[i], kp, vp) for p, i in zip(plan.passes, idx, strict=True)]

    def measure(self, v: Variant, shape: Shape, qkv, article: bool, cap: float | None, graphs: bool) -> dict:
        t0 = time.perf_counter()
        plan = v.planner()([shape])
        check_plan(plan, 1 << 30)
        planner_ms = (time.perf_counter() - t0) * 1e3
        passes = self.inputs(plan, qkv)
        if v.page != 1:
            paged = [(to_pages(p, v.page), q, k, vv) for p, q, k, vv in passes]
            passes = [(pp.pass_, q, pp.pool(k, v.page), pp.pool(vv, v.page)) for pp, q, k, vv in paged]
        backends = [self.backend(v.kernel, i) for i in range(len(passes))]

        def plan_all():
            for b, (p, *_) in zip(backends, passes, strict=True):
                b.plan(p)

        for _ in range(2):  # every wrapper of the backends' plan ring exists before timing
            plan_all()
        plan_ms = time_host(plan_all, self.device, iters=3)

        def run():
            for b, (_, q, k, vv) in zip(backends, passes, strict=True):
                b.run(0, q, k, vv)

        t = time_gpu(run, self.device, 10, 100, None if article else cap)
        rec = {
            **t.as_dict(),
            "planner_ms": planner_ms,
            "plan_ms": plan_ms,
            "calls": plan.num_attention_calls,
            "passes": len(plan.passes),
            "rows": plan.num_slots,
            "page_size": v.page,
        }
        if graphs:
            rec["graph"] = self._graph_timing(run, article, cap)
        return rec

    def _graph_timing(self, run, article: bool, cap: float | None) -> dict:
        try:
            graph = capture_graph(run, self.device)
            return time_gpu(graph.replay, self.device, 10, 100, None if article else cap).as_dict()
        except Exception as e:  # noqa: BLE001  (recorded: graphs are an experiment)
            return {"error": f"{type(e).__name__}: {e}"[:300]}


def run_grid(
    grid: str,
    kernels: tuple[str, ...],
    cap: float,
    graphs: bool,
    out: Path,
    deadline: float,
    device: torch.device,
    prefixes: tuple[int, ...] = (),
    tag: str = "",
    pages: tuple[int, ...] = (1,),
) -> dict:
    runner = Runner(device)
    result = {"grid": grid, "env": environment(device), "heads": [HEADS, KV_HEADS, HEAD_DIM], "dtype": "fp16"}
    result.update(timing="CUDA events, device time; plan() and planner excluded (plan_ms, planner_ms)")
    result["cells"] = []
    g = torch.Generator(device=device).manual_seed(0)
    for p, s, m in GRIDS[grid]:
        if prefixes and p not in prefixes:
            continue
        if time.monotonic() > deadline:
            result["cells"].append({"P": p, "S": s, "M": m, "skipped": "time budget of the run"})
            continue
        shape = Shape(p, (s,) * m)
        n = shape.num_tokens
        qkv = [torch.randn(n, h, HEAD_DIM, generator=g, device=device, dtype=DTYPE) for h in (16, 8, 8)]
        cell = {"P": p, "S": s, "M": m, "article_choice": article_choice(shape), "results": {}}
        for v in variants(kernels, m, pages):
            why = skip_reason(v, shape, grid)
            if why:
                cell["results"][v.label] = {"skipped": why}
                continue
            try:
                cell["results"][v.label] = runner.measure(v, shape, qkv, grid == "article", cap, graphs)
            except Exception as e:  # noqa: BLE001  (one failing variant must not lose the grid)
                cell["results"][v.label] = {"error": f"{type(e).__name__}: {e}"[:400]}
            gc.collect()
        result["cells"].append(cell)
        timed = [(r["mean_ms"], k) for k, r in cell["results"].items() if "mean_ms" in r]
        print(f"{grid} P={p} S={s} M={m}: best {min(timed, default=None)}", flush=True)
        del qkv
        torch.cuda.empty_cache()
        write_json(out / f"kernels_{grid}{'_' + tag if tag else ''}.json", result)
    return result


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", choices=sorted(GRIDS), default="article")
    ap.add_argument("--kernels", default="fa2,fa3")
    ap.add_argument("--cap", type=float, default=0.1, help="seconds of timed runs per variant (not article)")
    ap.add_argument("--graphs", action="store_true", help="also time CUDA-graph replays")
    ap.add_argument("--budget", type=float, default=1e9, help="seconds; later cells are skipped")
    ap.add_argument("--out", type=Path, default=Path("out"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prefixes", default="", help="comma-separated P values: only these rows of the grid")
    ap.add_argument("--tag", default="", help="suffix of the output file: kernels_GRID_TAG.json")
    ap.add_argument("--page-sizes", default="1", help="comma-separated; K/V copied into pages of each")
    a = ap.parse_args(argv)
    prefixes = tuple(int(x) for x in a.prefixes.split(",") if x)
    kernels = tuple(k for k in a.kernels.split(",") if k)
    deadline = time.monotonic() + a.budget
    pages = tuple(int(x) for x in a.page_sizes.split(",") if x)
    dev = torch.device(a.device)
    run_grid(a.grid, kernels, a.cap, a.graphs, a.out, deadline, dev, prefixes, a.tag, pages)


if __name__ == "__main__":
    main()
