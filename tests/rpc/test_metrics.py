"""/metrics: scorer_-prefixed names in base units, a latency histogram for every scheme used."""

from __future__ import annotations

import time

from prometheus_client.parser import text_string_to_metric_families

from scorer.planning import REGISTRY
from scorer.v1 import scorer_pb2 as pb

EXPECTED_FAMILIES = {
    "scorer_request_duration_seconds": "histogram",
    "scorer_stage_duration_seconds": "histogram",
    "scorer_requests": "counter",
    "scorer_errors": "counter",
    "scorer_requests_dropped": "counter",
    "scorer_requests_rejected": "counter",
    "scorer_docs_scored": "counter",
    "scorer_tokens_computed": "counter",
    "scorer_tokens_saved": "counter",
    "scorer_forward_passes": "counter",
    "scorer_batch_requests": "histogram",
    "scorer_batch_tokens": "histogram",
    "scorer_queue_depth": "gauge",
    "scorer_inflight_requests": "gauge",
    "scorer_ready": "gauge",
    "scorer_gc_pause_seconds": "histogram",
}


def test_every_scheme_used_has_its_latency_histogram_with_buckets_from_1_ms(server):
    stub = server.stub()
    for scheme in REGISTRY:
        docs = [pb.Doc(text="first doc"), pb.Doc(text="second doc")]
        options = pb.ScoreOptions(scheme=scheme, template="plain")
        stub.ScoreDocs(pb.ScoreDocsRequest(prompt="q", docs=docs, options=options), timeout=30)

    for scheme in REGISTRY:
        labels = {"scheme": scheme, "code": "OK"}
        assert server.metric("scorer_request_duration_seconds_count", **labels) >= 1, scheme
        buckets = [
            float(s.labels["le"])
            for f in text_string_to_metric_families(server.metrics_text())
            for s in f.samples
            if s.name == "scorer_request_duration_seconds_bucket" and s.labels.items() >= labels.items()
        ]
        assert min(buckets) == 0.001
        assert server.metric("scorer_docs_scored_total", scheme=scheme) >= 2
        assert server.metric("scorer_tokens_computed_total", scheme=scheme) > 0
    assert server.metric("scorer_tokens_saved_total", scheme="ragged") > 0


def test_metric_names_are_prefixed_and_the_contract_families_are_there(server):
    server.stub().ScoreDocs(pb.ScoreDocsRequest(prompt="q", docs=[pb.Doc(text="d")]), timeout=30)
    families = {f.name: f.type for f in text_string_to_metric_families(server.metrics_text())}
    assert all(name.startswith("scorer_") for name in families), sorted(families)
    assert EXPECTED_FAMILIES.items() <= families.items()
    for stage in ("queue", "tokenize", "forward"):
        assert server.metric("scorer_stage_duration_seconds_count", stage=stage) > 0
    assert server.metric("scorer_forward_passes_total") > 0
    assert server.metric("scorer_ready") == 1


def test_the_collectors_pauses_are_timed_once_the_heap_is_frozen(server):
    """The server froze its heap when ready (``freeze_heap``) and times each collection since:
    calls allocate enough for the youngest generation to be collected."""
    before = server.metric("scorer_gc_pause_seconds_count", process="server", generation="0")
    stub = server.stub()
    for i in range(20):
        stub.ScoreDocs(pb.ScoreDocsRequest(prompt=f"q{i}", docs=[pb.Doc(text="d")] * 8), timeout=30)
    assert (
        server.wait_metric("scorer_gc_pause_seconds_count", before + 1, process="server", generation="0")
        > before
    )


def test_the_collectors_callback_only_queues_and_a_thread_of_its_own_observes(monkeypatch):
    """A collection can start inside a metric's update, which holds a lock the histogram's own
    update would wait for forever (the split server once hung so): the callback observes nothing;
    the pauses reach the histogram from the drain thread."""
    import gc
    import threading

    from scorer import metrics
    from scorer.server import scoring

    observed_on = []
    labels = metrics.GC_PAUSE.labels
    monkeypatch.setattr(
        metrics.GC_PAUSE,
        "labels",
        lambda **kw: observed_on.append(threading.current_thread().name) or labels(**kw),
    )
    monkeypatch.setattr(scoring, "GC_DRAIN_S", 0.05)
    scoring._time_gc("test")
    try:
        gc.collect()
        deadline = time.monotonic() + 5
        while "gc-pauses-test" not in observed_on and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "gc-pauses-test" in observed_on  # (other tests' servers in this process drain too)
        assert all(name.startswith("gc-pauses-") for name in observed_on), observed_on
    finally:
        gc.callbacks[:] = [cb for cb in gc.callbacks if getattr(cb, "role", None) != "test"]
