"""The CPU benchmarks run and report every stage (their numbers are in bench/RESULTS.md)."""

import json
import shutil

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


def test_link_pickle_compares_a_whole_job_with_what_the_link_sends(tmp_path, capsys) -> None:
    from bench import link_pickle

    link_pickle.main(["--out", str(tmp_path)])
    rows = json.loads((tmp_path / "link_pickle.json").read_text())["rows"]
    assert len(rows) == 2 * len(link_pickle.SIZES)
    for whole, sent in zip(rows[::2], rows[1::2], strict=True):
        assert (whole["sent"], sent["sent"]) == ("whole Job", "for_engine")
        assert sent["mb"] < 0.7 * whole["mb"]
    assert "| 1000 x 500 | for_engine |" in capsys.readouterr().out


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


def test_a_ready_engine_leaves_its_heap_frozen_and_a_full_collection_cheap(tmp_path):
    """ready_engine ends with freeze_heap: what it loaded is out of the collector's reach, so a full
    collection scans a small part of the heap (bench.gc_pause undoes the freeze to compare)."""
    import gc

    from bench import gc_pause

    gc.unfreeze()
    try:
        gc_pause.main(["--calls", "3", "--out", str(tmp_path)])
        rows = json.loads((tmp_path / "gc_pause.json").read_text())["rows"]
        frozen, unfrozen = rows["frozen (as served)"], rows["unfrozen"]
        assert frozen["frozen"] > 10 * frozen["objects"]  # the heap, frozen; only later objects scanned
        assert frozen["median_ms"] < unfrozen["median_ms"]
    finally:
        gc.unfreeze()


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
             "--schemes", "auto,multi_item", "--kernels", "fused,fused/noaddmm",
             "--out", str(tmp_path)])  # fmt: skip
    records = json.loads((tmp_path / "kernel_profile.json").read_text())["records"]
    assert [(r["kernels"], r["scheme_used"]) for r in records] == [
        ("fused", ["ragged"]), ("fused", ["multi_item"]), ("fused/noaddmm", ["ragged"]),
        ("fused/noaddmm", ["multi_item"]),
    ]  # fmt: skip
    assert all(r["docs_s"] > 0 and r["wall_ms_per_batch"] > 0 for r in records)
    names = {
        "void flashinfer::PrefillWithKVCacheKernel<flashinfer::SparseCollectiveMainloop<cutlass::": (
            "attention"
        ),
        "nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN": "gemm",
        "_qk_norm_rope_kernel": "qk_norm_rope",
        "_gate_up_silu_kernel": "gate_up_silu",  # not silu_and_mul's family: it is the GEMM too
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


def test_padding_counts_the_rows_each_bucket_table_pads(tmp_path, capsys):
    from bench import padding

    padding.main(["--calls", "48", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "padding.json").read_text())
    e = result["workloads"]["E"]  # 11 calls of 1,400 tokens: 15,400 rows, bucket 16,384 or 15,616
    assert e["tokens"] == 15400
    assert e["padded_rows"] == {
        "1/8 growth": 984,
        "fine top quarter": 216,
        "128-row steps from a quarter": 88,
    }
    # C's 4,100-row second pass had a lucky 1/8-growth bucket (4,112); the 128-row steps pad it 124
    assert all(result["workloads"][w]["saved_ms_est"] > 0 for w in ("A", "E", "B", "D"))
    assert "| B | 12,000 |" in capsys.readouterr().out


@pytest.mark.parametrize("server", ["aio", "aio-busy"])
def test_grpc_floor_times_a_bare_server_at_each_gap(tmp_path, capsys, server):
    """bench.grpc_floor: a server in its own process that answers at once, one call at a time
    against it at each gap, a median per gap in the JSON and the table."""
    from bench import grpc_floor
    from loadtest import gen

    reqs = tmp_path / "reqs.jsonl"
    gen.main(["--out", str(reqs), "--requests", "12", "--docs", "3", "--prompt-tokens", "20", "--doc-tokens",
              "fixed:5", "--token-ids", "--template", "plain"])  # fmt: skip
    grpc_floor.main(["--requests", str(reqs), "--gap-ms", "0,5", "--calls", "6", "--server", server,
                     "--out", str(tmp_path)])  # fmt: skip
    records = json.loads((tmp_path / "grpc_floor.json").read_text())["records"]
    assert [(r["server"], r["gap_ms"]) for r in records] == [(server, 0.0), (server, 5.0)]
    assert all(0 < r["p50_ms"] < 1000 for r in records)
    assert f"| grpc {server} | grpc aio | 5 |" in capsys.readouterr().out


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_reuseport_spread_counts_each_connection_by_the_process_holding_it(tmp_path, capsys):
    """bench.reuseport_spread against a server in this process: every channel is a connection of
    its own, all held by this one process, in every trial."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    from bench import reuseport_spread

    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        out = tmp_path / "spread.json"
        reuseport_spread.main(["--target", f"127.0.0.1:{port}", "--channels", "3", "--trials", "2",
                               "--out", str(out)])  # fmt: skip
    finally:
        server.stop(None)
    assert json.loads(out.read_text()) == {"channels": 3, "trials": 2, "busiest": {"3": 2}}
    assert "| 3 | 2 |" in capsys.readouterr().out


def test_the_busy_poll_selector_still_waits_out_its_timeout_and_sleeps_when_idle():
    """Polling stops at the caller's timeout, and once its window after the last event is over
    it blocks (a select with no timeout would otherwise spin forever)."""
    import selectors
    import socket
    import time

    from bench.grpc_floor import BusyPollSelector

    a, b = socket.socketpair()
    with a, b:
        sel = BusyPollSelector(busy_poll_s=0.05)
        sel.register(a, selectors.EVENT_READ)
        t0 = time.monotonic()
        assert sel.select(0.01) == []
        assert 0.009 < time.monotonic() - t0 < 0.5
        time.sleep(0.06)  # the window is over: the next select blocks until its event
        b.send(b"x")
        assert [key.fileobj for key, _ in sel.select(None)] == [a]
        sel.close()


def test_batch_breakdown_times_every_stage_of_a_batch(tmp_path):
    """bench.batch_breakdown (issue 10's plan stage): batches formed under the budget, a median
    per stage, the whole call and the pipelined rate, on the CPU with one layer."""
    from bench import batch_breakdown
    from loadtest import gen

    reqs = tmp_path / "reqs.jsonl"
    gen.main(["--out", str(reqs), "--requests", "6", "--docs", "3", "--prompt-tokens", "30", "--doc-tokens",
              "fixed:8", "--token-ids", "--template", "plain"])  # fmt: skip
    batch_breakdown.main(["--requests", str(reqs), "--device", "cpu", "--layers", "1", "--batches", "2",
                          "--budget", "64", "--graph-max-tokens", "0", "--out", str(tmp_path)])  # fmt: skip
    result = json.loads((tmp_path / "batch_breakdown.json").read_text())
    stages = result["stages_ms_median"]
    assert set(stages) == set(batch_breakdown.STAGES) and all(v > 0 for v in stages.values())
    assert result["tokens_per_batch"] <= 64 and result["pipelined_ms_per_batch"] > 0
