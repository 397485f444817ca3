"""Reports of the load tool built from synthetic runs (no load sent): comparing reports of different
offered rates, and plots of schemes whose calls all failed."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from loadtest import plots, report, stats
from loadtest.driver import DriveConfig, Samples
from loadtest.stats import Arrays

N = 20  # calls per run


def _run(scheme: str, rate: float, code: str = "OK") -> tuple[dict, Arrays]:
    """A run of N calls at ``rate``, every one answered with ``code``, as loadtest.run would record it."""
    s = Samples(
        sched=[i / rate for i in range(N)],
        lag=[0.0] * N,
        latency=[0.010 + 0.001 * (i % 5) for i in range(N)],
        code=[code] * N,
        scheme=[scheme] * N,
        ran=[scheme if code == "OK" else ""] * N,
        docs=[3] * N,
    )
    s.wall_s = N / rate
    if code != "OK":
        s.error_examples[code] = "synthetic"
    summary = stats.summarize(s, DriveConfig(target="x", duration_s=N / rate, rate=rate))
    label = f"{scheme} @ {rate:g}/s"
    return {"label": label, "scheme": scheme, **summary}, Arrays.of(s)


def _report(*runs: tuple[dict, Arrays]) -> tuple[dict, list[tuple[str, Arrays]]]:
    rs = [r for r, _ in runs]
    rep = {
        "loadtest_version": 1,
        "created": "2025-01-01T00:00:00+00:00",
        "config": {"target": "x", "requests_file": "r.jsonl", "duration_s": 1.0, "deadline_s": 1.0},
        "workload": {"requests": N, "docs_mean": 3.0, "schemes": sorted({r["scheme"] for r in rs})},
        "sweep": True,
        "runs": rs,
        "capacity": stats.capacity(rs, None),
    }
    return rep, [(r["label"], a) for r, a in runs]


# --- compare ------------------------------------------------------------------------------------


def test_compare_pairs_runs_by_rate_and_warns_when_the_rates_differ(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A swept 100 and 200 calls/s, B 200 and 400: only the 200s side by side, and a warning."""
    a, _ = _report(_run("mixed", 100), _run("mixed", 200))
    b, _ = _report(_run("auto", 200), _run("auto", 400))
    text = report.compare(a, b)
    assert "## mixed @ 200/s vs auto @ 200/s" in text
    assert text.count("\n## ") == 1, text  # 100/s is not set beside 200/s, nor 200/s beside 400/s
    assert "- **Warning**: the offered rates differ: A ran 100/s, 200/s; B ran 200/s, 400/s." in text
    assert "only in A: mixed @ 100/s" in text and "only in B: auto @ 400/s" in text

    for name, rep in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps(rep))
    assert report.main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out, err = capsys.readouterr()
    assert "## mixed @ 200/s vs auto @ 200/s" in out
    assert "warning: the offered rates differ" in err and "100/s, 200/s" in err and "400/s" in err


def test_compare_pairs_the_same_rates_whatever_the_labels_without_a_warning() -> None:
    a, _ = _report(_run("naive", 100), _run("naive", 200))
    b, _ = _report(_run("auto", 200), _run("auto", 100))
    pairs, notes = report.pair_runs(a, b)
    assert notes == []
    assert [(ra["label"], rb["label"]) for ra, rb in pairs] == [
        ("naive @ 100/s", "auto @ 100/s"),
        ("naive @ 200/s", "auto @ 200/s"),
    ]
    assert "Warning" not in report.compare(a, b)


# --- plots --------------------------------------------------------------------------------------


@pytest.mark.parametrize("failing", [False, True], ids=["all ok", "one scheme all failed"])
def test_plots_draw_no_legend_without_labelled_artists(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], failing: bool
) -> None:
    rep, arrays = _report(
        _run("naive", 50),
        _run("naive", 100),
        _run("cascade", 50, "UNAVAILABLE" if failing else "OK"),
        _run("cascade", 100, "UNAVAILABLE" if failing else "OK"),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report.write(tmp_path, rep, arrays)
    assert [str(w.message) for w in caught] == []
    assert "No artists with labels" not in "".join(capfd.readouterr())
    assert rep["plots"] == list(report.PLOTS.values())


def test_cdf_panel_of_a_scheme_whose_calls_all_failed_says_so() -> None:
    _, arrays = _report(_run("naive", 50), _run("cascade", 50, "UNAVAILABLE"))
    fig = plots.latency_cdf_figure([(label, label.split()[0], a) for label, a in arrays])
    try:
        panels = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
        assert [t.get_text() for t in panels["cascade"].texts] == [f"all {N} calls failed (UNAVAILABLE)"]
        assert len(panels["cascade"].lines) == 3  # the p50/p90/p99 guides, no CDF
        assert not panels["naive"].texts and panels["naive"].get_legend() is not None
    finally:
        plt.close(fig)


def test_cdf_panel_names_the_failed_run_among_ok_ones() -> None:
    _, arrays = _report(_run("naive", 50), _run("naive", 400, "RESOURCE_EXHAUSTED"))
    fig = plots.latency_cdf_figure([(label, "naive", a) for label, a in arrays])
    try:
        (ax,) = fig.axes
        assert [t.get_text() for t in ax.texts] == [
            f"naive @ 400/s: all {N} calls failed (RESOURCE_EXHAUSTED)"
        ]
    finally:
        plt.close(fig)


def test_latency_chart_marks_a_step_whose_calls_all_failed() -> None:
    rep, _ = _report(
        _run("naive", 50), _run("naive", 100), _run("cascade", 50), _run("cascade", 100, "UNAVAILABLE")
    )
    fig = plots.latency_throughput_figure(rep["runs"])
    try:
        ax = fig.axes[0]
        crosses = [ln for ln in ax.lines if ln.get_marker() == "x"]
        assert len(crosses) == 1
        (x,), (y,) = crosses[0].get_data()
        assert x == 0.0 and y == 0  # no ok call/s, at the x axis (axes coordinates)
        assert crosses[0].get_transform() == ax.get_xaxis_transform()
        assert f"cascade @ 100/s: all {N} calls failed (UNAVAILABLE)" in [t.get_text() for t in ax.texts]
        assert "no ok call" in [t.get_text() for t in ax.get_legend().get_texts()]
    finally:
        plt.close(fig)


def test_failed_note() -> None:
    assert plots.failed_note(5, {"UNAVAILABLE": 5}) == "all 5 calls failed (UNAVAILABLE)"
    assert (
        plots.failed_note(5, {"UNAVAILABLE": 2, "DEADLINE_EXCEEDED": 3})
        == "all 5 calls failed (DEADLINE_EXCEEDED 3, UNAVAILABLE 2)"
    )
    assert plots.failed_note(0, {}) == "no calls"


def test_latency_chart_of_a_sweep_without_any_ok_call_saves(tmp_path) -> None:
    """A sweep every step of which failed (a server still drowning in an earlier flood) still gets
    its chart: no latency to put on a log axis, so the axis stays linear, and each step says why."""
    rep, _ = _report(_run("naive", 50, "DEADLINE_EXCEEDED"), _run("naive", 100, "RESOURCE_EXHAUSTED"))
    plots.latency_throughput(rep["runs"], tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 0
    fig = plots.latency_throughput_figure(rep["runs"])
    try:
        ax = fig.axes[0]
        assert ax.get_yscale() == "linear"
        assert len([t for t in ax.texts if "calls failed" in t.get_text()]) == 2
    finally:
        plt.close(fig)


# --- rate rows ----------------------------------------------------------------------------------


def test_rate_rows_give_each_runs_rates_and_p99_in_ms_and_none_where_no_call_succeeded(tmp_path) -> None:
    rep, runs = _report(_run("auto", 100.0), _run("auto", 200.0, code="UNAVAILABLE"))
    report.write(tmp_path, rep, runs, samples=False)
    ok, failed = report.rate_rows(report.load(tmp_path))
    assert (ok["offered_calls_s"], ok["failed"]) == (100.0, 0)
    assert ok["docs_s"] == rep["runs"][0]["achieved_docs_per_s"]
    assert ok["p99_ms"] == pytest.approx(rep["runs"][0]["latency_seconds"]["p99"] * 1e3)
    assert failed["p99_ms"] is None and failed["failed"] == N
