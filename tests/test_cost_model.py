"""The packaged cost model is the fit of the committed H200 measurements, and on the held-out
shapes it picks within the goal (numbers in bench/RESULTS.md; no GPU needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cost_fit import evaluate, fit, load_e2e, merge_grids
from scorer.planning.cost_model import DATA, CostModel

BENCH = Path(__file__).resolve().parents[1] / "bench" / "data" / "cost_model"
KERNELS = ("kernels_wide.json",)
E2E = (BENCH / "e2e.json", [BENCH / "e2e_cascade.json"])
KNOWN_MISSES = {
    # (P, S, M): what auto picks and what is fastest on the measured engine (bench/RESULTS.md, model level)
    "forward": {(96, 4, 32): ("ragged", "grouped:16"), (64, 12, 3): ("ragged", "naive")},
    "latency": {
        (96, 4, 32): ("ragged", "grouped:16"),
        (1200, 24, 160): ("grouped:16", "grouped:64"),  # a 24.9 ms outlier in grouped:16's planner time
    },
}


def load(name: str) -> dict:
    return json.loads((BENCH / name).read_text())


def test_packaged_model_is_the_fit_of_the_committed_measurements():
    """``python -m bench.cost_fit fit bench/data/cost_model/e2e.json
    bench/data/cost_model/kernels_wide.json --e2e-more bench/data/cost_model/e2e_cascade.json``
    reproduces scorer/planning/cost_model.json."""
    refit = fit(merge_grids([load(k) for k in KERNELS]), load_e2e(*E2E))
    packaged = json.loads(DATA.read_text())
    assert refit["gemm_curve"] == packaged["gemm_curve"]
    assert refit["graph_buckets"] == packaged["graph_buckets"]
    assert refit["attention"] == packaged["attention"]
    for name, coef in packaged["fit"].items():
        assert refit["fit"][name] == pytest.approx(coef, rel=1e-9)
    for name, coef in packaged["planner"].items():
        assert refit["planner"][name] == pytest.approx(coef, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("objective", ["forward", "latency"])
def test_auto_is_within_the_goal_on_the_heldout_shapes_but_the_known_misses(objective):
    """Within 5% of the fastest on every held-out shape but those listed (host-bound shapes of a
    few tokens, and a planner-time outlier), and faster than the article's rule on average."""
    rows, summary = evaluate(load_e2e(*E2E), CostModel.load(), "heldout", objective)
    assert summary["cells"] == 21
    missed = {(r["P"], r["S"], r["M"]): (r["auto"], r["best"]) for r in rows if not r["auto_ok"]}
    assert missed == KNOWN_MISSES[objective]
    assert summary["geomean_article_over_auto"] > 1.0


def test_a_prompt_read_from_the_pool_runs_multi_item_where_cascade_was_chosen():
    """Cascade's edge, the prompt's own attention computed once, is gone when the prefix cache
    holds the prompt: such a call runs multi-item (one attention call a layer, not two and a
    merge); the same shape computing its prompt keeps the tables' choice, and a cached shape
    the tables give to another scheme keeps it."""
    from scorer.planning.base import Shape

    model = CostModel.load()
    for p, items in ((8000, (4,) * 32), (2000, (100,) * 100)):
        assert model.choose(Shape(p, items)) == ("cascade", 0)
        assert model.choose(Shape(p, items, cached=p - 16)) == ("multi_item", 0)
    a = Shape(300, (50,) * 10)
    assert model.choose(Shape(300, a.item_lens, cached=288)) == model.choose(a) != ("cascade", 0)
