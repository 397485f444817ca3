"""The CPU benchmarks run and report every stage (their numbers are in bench/RESULTS.md)."""

import json
import math
import random
import time

import pytest
import torch

from bench import host_path


def test_host_path_reports_every_stage(tmp_path, capsys) -> None:
    threads = torch.get_num_threads()
    host_path.main(["--calls", "12", "--batch", "6", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "host_path.json").read_text())
    for kind in ("token_ids", "text"):
        ms = result["ms"][kind]
        assert set(ms) == {"parse", "convert", "tokenize", "respond", "link", "plan", "plan_1_thread"}
        assert all(v > 0 for v in ms.values()), ms
    lookup = result["label_lookup_ms"]
    assert lookup["lookup"] < lookup["get_vocab"]
    assert "| token_ids |" in capsys.readouterr().out
    assert torch.get_num_threads() == threads  # the one-thread plan put torch's threads back


def test_frontend_start_times_both_tokenizers_and_the_backend_is_the_lighter(tmp_path, capsys) -> None:
    from bench import frontend_start

    frontend_start.main(["--rounds", "1", "--out", str(tmp_path)])
    modes = json.loads((tmp_path / "frontend_start.json").read_text())["modes"]
    assert set(modes) == {"backend", "transformers"}
    assert all(m["median_s"] > 0 for m in modes.values())
    assert modes["backend"]["rss_mb"] < modes["transformers"]["rss_mb"]  # no AutoTokenizer's modules
    assert "transformers" in capsys.readouterr().out


def test_admission_replays_each_shape_under_each_rule(tmp_path, capsys) -> None:
    """bench.admission on a small pool: auto reads repeat10's prompts as admit 1 does (9 calls in
    10 against admit 2's 8), and writes a fraction of what admit 1 writes of unique prompts."""
    from bench import admission

    result = admission.main(["--pool-blocks", "2048", "--scale", "0.1", "--out", str(tmp_path)])
    got = {(r["shape"], r["admit"]): r for r in result["rows"]}
    assert len(got) == len(admission.SHAPES) * 3
    assert got["repeat10", "auto"]["read_share"] == got["repeat10", "1"]["read_share"] > 0.89
    assert 0.79 < got["repeat10", "2"]["read_share"] < 0.8
    assert got["unique", "auto"]["written_share"] < got["unique", "1"]["written_share"] / 4
    assert got["unique", "auto"]["read_share"] >= got["unique", "2"]["read_share"] > 0.15  # the head
    assert not got["unique", "auto"]["first_sight_at_end"]
    assert "| repeat10 | 100 | auto |" in capsys.readouterr().out


def test_fp8_check_ranks_labelled_calls_under_fp32_bf16_and_fp8(tmp_path, monkeypatch, capsys) -> None:
    """bench.fp8_check on the tiny model: NDCG@10 of each system against the labels, and bf16's and
    FP8's agreement with fp32; NDCG by its definition; a bad line named by number and field."""
    from bench import fp8_check

    assert fp8_check.ndcg([3.0, 2.0, 1.0], [2, 1, 0]) == 1.0
    worst = (1 / math.log2(3) + 3 / math.log2(4)) / (3 + 1 / math.log2(3))  # [0, 1, 2] ranked as given
    assert fp8_check.ndcg([3.0, 2.0, 1.0], [0, 1, 2]) == pytest.approx(worst)
    assert fp8_check.ndcg([1.0, 2.0], [0, 0]) == 1.0
    assert fp8_check.ndcg([1.0, 2.0, 3.0], [1, 0, 0], k=2) == 0.0  # the relevant doc is third
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"query": "q", "documents": ["a"], "relevance": [1]}\n{"query": "q", "documents": ["a", "b"]}\n'
    )
    with pytest.raises(ValueError, match=r"bad.jsonl:2: relevance needs one number per document \(2\)"):
        fp8_check.read_pairs(bad)
    rng = random.Random(0)
    words = ["shared", "prefix", "computed", "once", "reranker", "query", "document", "cache", "score"]
    pairs = tmp_path / "pairs.jsonl"
    lines = []
    for _ in range(3):
        docs = [" ".join(rng.choices(words, k=rng.randint(3, 9))) for _ in range(6)]
        rel = [rng.choice([0, 1, 2]) for _ in docs]
        lines.append(
            json.dumps({"query": " ".join(rng.choices(words, k=4)), "documents": docs, "relevance": rel})
        )
    pairs.write_text("\n".join(lines) + "\n")
    monkeypatch.setenv("SCORER_CACHE_DIR", str(tmp_path / "cache"))
    result = fp8_check.main(["--pairs", str(pairs), "--device", "cpu", "--out", str(tmp_path)])
    rows = result["rows"]
    assert result["calls"] == 3 and set(rows) == {"fp32", "bf16", "fp8"}
    assert all(0 < r["ndcg10_mean"] <= 1 for r in rows.values())
    assert (
        rows["bf16"]["spearman_mean"] > 0.9
        and rows["bf16"]["logprob_err_mean"] < rows["fp8"]["logprob_err_mean"]
    )
    assert "| fp8 |" in capsys.readouterr().out and (tmp_path / "fp8_check.json").exists()


def test_host_path_times_the_long_repeated_prompt_stage_by_stage(tmp_path, monkeypatch, capsys) -> None:
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its 40,960-position checkpoint
    args = ["--workload", "long", "--calls", "20", "--prompt-tokens", "8000,500", "--label", "this tree"]
    host_path.main([*args, "--out", str(tmp_path)])
    records = json.loads((tmp_path / "host_path_long.json").read_text())["records"]
    assert [r["prompt_tokens"] for r in records] == [500, 8000]
    for r in records:
        assert set(r["ms"]) == set(host_path.LONG_STAGES) and all(v > 0 for v in r["ms"].values())
        assert r["label"] == "this tree" and r["ms_per_1k_prompt_ids"] is not None
    # per prompt, 9 of its 10 calls read all of it but its last block (the first writes it: admit auto)
    assert records[1]["cache_hit_share"] == pytest.approx(9 * (8000 - 16) / (10 * 8000))
    assert records[0]["cache_hit_share"] == pytest.approx(9 * (500 - 4) / (10 * 500))  # 496: 31 whole blocks
    out = capsys.readouterr().out
    assert "| this tree | 8000 |" in out and "per 1,000 prompt ids (500 -> 8000)" in out


def test_the_host_only_engine_answers_every_call_from_the_prefix_cache_s_plan(tmp_path, monkeypatch):
    """bench.host_served's engine: the host work of a batch (the cache's lease, the plan on its
    pool), no forward, a result per call with what the cache saved."""
    from bench.host_served import HostOnlyEngine
    from scorer.request import Doc, ScoreOptions, ScoreRequest
    from scorer.runtime import build_engine

    monkeypatch.setenv("SCORER_CACHE_DIR", str(tmp_path))
    engine = build_engine(attention_backend="torch", prefix_cache_mib=4, prefix_cache_admit=2)
    engine.__class__ = HostOnlyEngine
    forward = engine.runner.forward
    engine.runner.forward = None  # never called
    docs = [Doc(token_ids=(5, 6), id="a"), Doc(token_ids=(7,), id="b")]
    req = ScoreRequest("", docs, prompt_token_ids=tuple(range(1, 66)), options=ScoreOptions(template="plain"))
    results = [engine.score(req) for _ in range(3)]
    engine.runner.forward = forward
    assert [r.usage.cached_prompt_tokens for r in results] == [0, 0, 64]  # seen, written, read
    engine.simulated = (0.5, 1.0)  # a simulated device: half a second a batch, a second a row computed
    engine._device_free = free = time.monotonic() + 1e6  # busy: this batch queues behind
    engine.launch([engine.tokenize(req)])  # not collected: the device's clock is what is checked
    assert engine._device_free - free == pytest.approx(0.5 + 4)  # 64 prompt ids read: 1 + 3 doc rows
    assert [d.id for d in results[2].results] == [
        "a",
        "b",
    ] and engine.cache.free_slots < engine.cache.capacity


def test_host_served_starts_scorer_serve_from_its_flags_with_the_host_only_engine(monkeypatch):
    """bench.host_served's server process: its flags checked as ``scorer serve`` checks them, and
    the server built from those settings with the host-only engine."""
    from bench import host_served
    from scorer.server import app
    from scorer.settings import Settings

    seen = []
    monkeypatch.setattr(app, "run", lambda settings: seen.append(settings) or 0)
    monkeypatch.setattr(Settings, "build_engine", Settings.build_engine)  # the patch is undone
    assert host_served.serve(["--port", "99999"]) == 2  # refused before the server's imports
    assert host_served.serve(["--device", "cpu", "--frontends", "1"]) == 0
    (settings,) = seen
    assert isinstance(settings, Settings) and settings.frontends == "1"
    assert Settings.build_engine.__name__ == "host_only"


def test_throughput_benchmark_runs_every_kind_of_system(tmp_path):
    """bench.throughput on a toy model on the CPU (torch reference, no graphs): an engine system,
    a forced scheme and both transformers baselines each give docs/s and MFU in the JSON."""
    import json

    from bench import throughput

    throughput.main(
        ["--device", "cpu", "--models", "smoke", "--workloads", "A'", "--calls", "3", "--seconds", "0.2",
         "--systems", "auto,multi_item,hf_naive,hf_prefix", "--out", str(tmp_path)]
    )  # fmt: skip
    records = json.loads((tmp_path / "throughput.json").read_text())["records"]
    assert [r["system"] for r in records] == ["auto", "multi_item", "hf_naive", "hf_prefix"]
    for r in records:
        assert r["docs_s"] > 0 and 0 < r["mfu"] < 1, r
    assert records[0]["scheme_used"] == ["ragged"] and records[1]["idle_p50_ms"] > 0
    assert all("docs_s_rounds" not in r for r in records)  # one round: the record as it was


def test_throughput_rounds_interleave_systems_and_report_the_median(tmp_path):
    """``--rounds 3``: each engine system measured three times (its docs/s the median of the three,
    each kept), the idle calls once; a transformers baseline once."""
    import json
    import statistics

    from bench import throughput

    throughput.main(
        ["--device", "cpu", "--models", "smoke", "--workloads", "A'", "--calls", "3", "--seconds", "0.1",
         "--systems", "auto,ragged,hf_prefix", "--rounds", "3", "--out", str(tmp_path)]
    )  # fmt: skip
    records = json.loads((tmp_path / "throughput.json").read_text())["records"]
    assert [r["system"] for r in records] == ["auto", "ragged", "hf_prefix"]
    for r in records[:2]:
        assert len(r["docs_s_rounds"]) == 3 and r["docs_s"] == statistics.median(r["docs_s_rounds"])
        assert r["idle_p50_ms"] > 0 and 0 < r["mfu"] < 1
    assert "docs_s_rounds" not in records[2] and records[2]["docs_s"] > 0


def test_plan_on_cache_times_every_path(tmp_path, capsys):
    """bench.plan_on_cache: the plan alone, prompts seen once (off the pool), prompts written, and
    each call's peek at prompts unknown and held."""
    from bench import plan_on_cache

    plan_on_cache.main(["--out", str(tmp_path), "--label", "test"])
    plan_on_cache.main(["--out", str(tmp_path), "--label", "test", "--workload", "A'"])
    records = json.loads((tmp_path / "plan_on_cache.json").read_text())["records"]
    assert [r["workload"] for r in records] == ["A", "A'"]
    for record in records:
        times = {k: v for k, v in record.items() if k not in ("label", "workload")}
        assert len(times) == 10 and all(v > 0 for v in times.values()), record
        assert record["plan on the cache, prompts written, 19 calls"] > record["plan, 19 calls"]


def test_kernel_profile_sorts_kernels_into_families_and_times_a_batch(tmp_path, capsys):
    """bench.kernel_profile on the CPU (no kernels to trace: the batch's wall time only), and its
    family rules on the H200's kernel names (FA3's hold "cutlass", FA2's norm ones "flashinfer")."""
    from bench import kernel_profile as kp

    kp.main(["--device", "cpu", "--model", "smoke", "--workloads", "A", "--batches", "1",
             "--schemes", "auto,multi_item", "--kernels", "fused,fused/noaddmm,fused/fp8",
             "--out", str(tmp_path)])  # fmt: skip
    records = json.loads((tmp_path / "kernel_profile.json").read_text())["records"]
    assert [(r["kernels"], r["scheme_used"]) for r in records] == [
        ("fused", ["ragged"]), ("fused", ["multi_item"]), ("fused/noaddmm", ["ragged"]),
        ("fused/noaddmm", ["multi_item"]), ("fused/fp8", ["ragged"]), ("fused/fp8", ["multi_item"]),
    ]  # fmt: skip
    assert all(r["docs_s"] > 0 and r["wall_ms_per_batch"] > 0 for r in records)
    names = {
        "void flashinfer::PrefillWithKVCacheKernel<flashinfer::SparseCollectiveMainloop<cutlass::": (
            "attention"
        ),
        "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN": "gemm",
        "_qk_norm_rope_kernel": "qk_norm_rope",
        "_gate_up_silu_kernel": "gate_up_silu",  # not silu_and_mul's family: it is the GEMM too
        "_quant_kernel": "fp8_quant",  # FP8's norms and SiLU-and-mul: not the bf16 ones' families
        "void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>": "add_rmsnorm",
        "void flashinfer::norm::RMSNormKernel<8u, __nv_bfloat16>": "rmsnorm",
        "void flashinfer::activation::act_and_mul_kernel<__nv_bfloat16, &(silu(float const&))>": (
            "silu_and_mul"
        ),
        "void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>": (
            "residual_add"
        ),
        "void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::Tenso": (
            "copy_index"
        ),
        "Memset (Device)": "copy_index",
    }
    assert {n: kp.family(n) for n in names} == names
    assert kp.busy_us([{"ts": 0, "dur": 10}, {"ts": 5, "dur": 10}, {"ts": 30, "dur": 1}]) == 16
    gemm, attn, norm = "nvjet_sm90_x", "PrefillWithKVCacheKernel", "RMSNormKernel"
    trace = [{"name": gemm, "ts": 0, "dur": 10}, {"name": norm, "ts": 2, "dur": 3},  # inside the GEMM
             {"name": attn, "ts": 14, "dur": 5}, {"name": gemm, "ts": 20, "dur": 5},
             {"name": attn, "ts": 30, "dur": 1}]  # fmt: skip
    assert kp.idle_by_neighbours(trace) == {"gemm -> attention": 9, "attention -> gemm": 1}
    assert (
        kp.short_name("void flashinfer::norm::RMSNormKernel<8u, __nv_bfloat16>(x)")
        == "flashinfer::norm::RMSNormKernel"
    )
    named = kp.idle_by_neighbours(trace, kp.short_name)
    assert named == {
        "PrefillWithKVCacheKernel -> nvjet_sm90_x": 1,
        "nvjet_sm90_x -> PrefillWithKVCacheKernel": 9,
    }
    assert "| A | fused | auto | default | multi_item (multi_item) |" in capsys.readouterr().out


def test_full_batches_drop_the_runt_a_saturated_batcher_never_forms():
    from types import SimpleNamespace

    from bench.throughput import full_batches

    calls = [SimpleNamespace(tokens=800) for _ in range(64)]  # workload A: 20 calls fill 16,384
    assert [len(b) for b in full_batches(calls, 16384)] == [20, 20, 20]  # not the 4 left over
    big = [SimpleNamespace(tokens=8128) for _ in range(5)]  # D: two a batch; the last one alone is
    assert [len(b) for b in full_batches(big, 16384)] == [2, 2]  # a runt too (another would fit)
    assert [len(b) for b in full_batches(big[:1], 16384)] == [1]  # but never the only batch
    assert [len(b) for b in full_batches([SimpleNamespace(tokens=9000)] * 3, 16384)] == [1, 1, 1]


BENCHMARKS = [
    "admission", "attention_layouts", "cost_fit", "cpu_schemes", "e2e", "fp8", "fp8_check", "fp8_quant",
    "frontend_start", "host_path", "host_served", "kernel_profile", "kernels", "light_load",
    "plan_on_cache", "qk_norm_rope", "report", "rms_norm", "throughput", "triton_gemm",
]  # fmt: skip


def test_bench_holds_the_listed_benchmarks_and_their_helpers():
    from pathlib import Path

    here = Path(__file__).resolve().parents[1] / "bench"
    helpers = {"__init__", "paging", "timing"}
    assert {p.stem for p in here.glob("*.py")} == set(BENCHMARKS) | helpers


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_imports_without_a_gpu_and_answers_help(name, monkeypatch, capsys):
    import importlib
    import sys

    module = importlib.import_module(f"bench.{name}")
    monkeypatch.setattr(sys, "argv", [f"python -m bench.{name}", "--help"])
    with pytest.raises(SystemExit) as stop:
        module.main()
    assert stop.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_results_name_only_what_the_tree_holds_and_every_data_file_is_named():
    """Every ``python -m bench.X``, script and data path in bench/RESULTS.md exists, and every
    file under bench/data lies under a path the page names (the data behind its tables only)."""
    import fnmatch
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = (root / "bench" / "RESULTS.md").read_text()
    for module in set(re.findall(r"python -m bench\.(\w+)", text)):
        assert (root / "bench" / f"{module}.py").exists(), module
    for script in set(re.findall(r"scripts/[\w/]+\.(?:sh|py)", text)):
        assert (root / script).exists(), script
    named = {m.rstrip(".,") for m in re.findall(r"bench/data/[\w./*-]+", text)}
    files = [p.relative_to(root).as_posix() for p in (root / "bench" / "data").rglob("*") if p.is_file()]
    for path in named:
        assert any(
            f == path or f.startswith(path.rstrip("/") + "/") or fnmatch.fnmatch(f, path) for f in files
        ), path
    for f in files:
        assert any(f == n or f.startswith(n.rstrip("/") + "/") or fnmatch.fnmatch(f, n) for n in named), f


def test_served_summary_takes_each_sweeps_best_rate_within_the_p99_bound(tmp_path):
    """scripts/gpu/served_summary.py on two sweeps' report.json: the best docs/s of a run with no
    failure within the bound, the sweep's most, and their ratio (None where a sweep has none)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts/gpu/served_summary.py"
    spec = importlib.util.spec_from_file_location("served_summary", path)
    summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summary)

    def sweep(name, runs):  # (offered, docs/s, p99 s or None, failed)
        rows = [
            {"offered_rps": o, "achieved_rps": o, "achieved_docs_per_s": d, "failed": f}
            | {"latency_seconds": {"p99": p}}
            for o, d, p, f in runs
        ]
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps({"runs": rows}))
        return tmp_path / name

    runs = [(100, 3000.0, 0.050, 0), (150, 4500.0, 0.099, 0), (170, 5000.0, 0.090, 2), (180, 5400.0, 0.2, 0)]
    cache = sweep("cache", runs)
    nocache = sweep("nocache", [(20, 640.0, 0.144, 0), (22, 700.0, None, 5)])
    out = tmp_path / "summary.json"
    assert summary.main([str(cache), str(nocache), str(out)]) == 0
    got = json.loads(out.read_text())
    best = got["cache"]
    assert (best["docs_s"], best["p99_ms"], best["most_docs_s"]) == (4500.0, 99.0, 5400.0)
    assert got["nocache"]["docs_s"] is None and got["nocache"]["most_docs_s"] == 700.0
    assert got["nocache"]["runs"][1]["p99_ms"] is None and got["ratio"] is None
    assert got["ratio_to_nocache_most"] == round(4500 / 700, 2)
