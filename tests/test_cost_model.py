"""The packaged cost model is the fit of the committed H200 measurements, and on the held-out
shapes it picks within the goal (numbers in bench/RESULTS.md; no GPU needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.cost_fit import evaluate, fit, merge_grids
from scorer.planning.cost_model import DATA, CostModel

BENCH = Path(__file__).resolve().parents[1] / "bench" / "data"
KERNELS = ("kernels_wide.json", "kernels_wide_p16384.json")


def load(name: str) -> dict:
    return json.loads((BENCH / name).read_text())


def test_packaged_model_is_the_fit_of_the_committed_measurements():
    """``python -m bench.cost_fit fit bench/data/e2e.json bench/data/kernels_wide*.json``
    (without the FA2 grid) reproduces scorer/planning/cost_model.json."""
    refit = fit(merge_grids([load(k) for k in KERNELS]), load("e2e.json"))
    packaged = json.loads(DATA.read_text())
    assert refit["gemm_curve"] == packaged["gemm_curve"]
    assert refit["graph_buckets"] == packaged["graph_buckets"]
    assert refit["attention"] == packaged["attention"]
    for name, coef in packaged["fit"].items():
        assert refit["fit"][name] == pytest.approx(coef, rel=1e-9)
    for name, coef in packaged["planner"].items():
        assert refit["planner"][name] == pytest.approx(coef, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("objective", ["forward", "latency"])
def test_auto_is_within_the_goal_on_every_heldout_shape(objective):
    rows, summary = evaluate(load("e2e.json"), CostModel.load(), "heldout", objective)
    assert summary["cells"] == 21
    missed = [(r["P"], r["S"], r["M"], r["auto"], r["best"]) for r in rows if not r["auto_ok"]]
    assert not missed
    assert summary["geomean_article_over_auto"] > 1.0
