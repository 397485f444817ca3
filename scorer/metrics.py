"""Every Prometheus collector of the scorer, in one registry.

Names are prefixed ``scorer_``, durations are in seconds, counters end in ``_total``; the
standalone gRPC server and a Ray deployment import this module and so export the same names.
The per-call families carry ``api``, the front end a call came through (``APIS``); their ``code``
is the gRPC status name of the answer whatever the front end, so one dashboard and one set of
alerts serve them all.
"""

from __future__ import annotations

from collections.abc import Callable
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Metric,
    ProcessCollector,
    multiprocess,
    start_http_server,
)

REGISTRY = CollectorRegistry(auto_describe=True)
ProcessCollector(namespace="scorer", registry=REGISTRY)

APIS = ("grpc", "cohere", "jina", "tei")
"""The ``api`` label: gRPC (the standalone server and Ray's gRPC proxy), or an HTTP rerank shape."""
UNRESOLVED_SCHEME = "none"
"""The ``scheme`` label of a call that failed before its scheme was known."""

LATENCY_BUCKETS = (
    0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
BATCH_REQUEST_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256)
TOKEN_BUCKETS = tuple(2**k for k in range(6, 21))

REQUEST_DURATION = Histogram(
    "scorer_request_duration_seconds",
    "ScoreDocs latency from the call's arrival to its response, by front end, concrete scheme and gRPC code.",
    ["api", "scheme", "code"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
STAGE_DURATION = Histogram(
    "scorer_stage_duration_seconds",
    "Time a call spends in one stage: queue (waiting for its batch), tokenize, forward (its batch's).",
    ["stage"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
REQUESTS = Counter(
    "scorer_requests_total",
    "ScoreDocs calls answered, by front end, concrete scheme and gRPC code.",
    ["api", "scheme", "code"],
    registry=REGISTRY,
)
ERRORS = Counter(
    "scorer_errors_total",
    "ScoreDocs calls answered with a status other than OK, by front end and gRPC code.",
    ["api", "code"],
    registry=REGISTRY,
)
DROPPED = Counter(
    "scorer_requests_dropped_total",
    "Calls removed from the queue before their forward pass (no compute spent), by reason.",
    ["reason"],
    registry=REGISTRY,
)
DROP_REASONS = ("deadline", "unreachable", "cancelled")
for _reason in DROP_REASONS:  # exported at 0 from the start: a dashboard's rate() has a series
    DROPPED.labels(reason=_reason)
REJECTED = Counter(
    "scorer_requests_rejected_total",
    "Calls refused at once (RESOURCE_EXHAUSTED): the queue was full, or the queue ahead would push"
    " the call past its deadline.",
    registry=REGISTRY,
)
OOM_RETRIES = Counter(
    "scorer_oom_retries_total",
    "Merged batches that ran out of memory and were retried one request at a time.",
    registry=REGISTRY,
)
INLINE_BATCHES = Counter(
    "scorer_batches_inline_total",
    "Batches that found the device idle and short, launched and waited for on the event loop"
    " (no hand-off to the worker threads).",
    registry=REGISTRY,
)
DOCS_SCORED = Counter(
    "scorer_docs_scored_total",
    "Documents scored, by concrete scheme.",
    ["scheme"],
    registry=REGISTRY,
)
TOKENS_COMPUTED = Counter(
    "scorer_tokens_computed_total",
    "Tokens put through the model, by concrete scheme.",
    ["scheme"],
    registry=REGISTRY,
)
TOKENS_SAVED = Counter(
    "scorer_tokens_saved_total",
    "Tokens a prompt-per-document run would have computed on top, by concrete scheme.",
    ["scheme"],
    registry=REGISTRY,
)
FORWARD_PASSES = Counter(
    "scorer_forward_passes_total",
    "Model forward passes run for calls (warm-up excluded).",
    registry=REGISTRY,
)
FRONTEND_RESTARTS = Counter(
    "scorer_frontend_restarts_total",
    "Front-end processes (scorer serve --frontends) that died and were started again.",
    registry=REGISTRY,
)
HTTP_CONNECTIONS_CLOSED = Counter(
    "scorer_http_connections_closed_total",
    "HTTP connections the server closed at its limits, by reason: evicted (idle, for a new one at"
    " --max-connections), over_cap (every open one busy: 503), idle_timeout, header_timeout (408),"
    " headers_too_large (431), malformed (bytes that do not parse: 400).",
    ["reason"],
    registry=REGISTRY,
)
PREFIX_CACHE_HIT_TOKENS = Counter(
    "scorer_prefix_cache_hit_tokens_total",
    "Prompt tokens whose K/V the prefix cache held for a batch: read instead of computed, unless the"
    " batch declined them (scorer_prefix_cache_declined_tokens_total).",
    registry=REGISTRY,
)
PREFIX_CACHE_DECLINED_TOKENS = Counter(
    "scorer_prefix_cache_declined_tokens_total",
    "Prompt tokens the prefix cache held that a batch computed anyway: its reads would have saved"
    " fewer rows than --prefix-cache-min-read, which the pool's paged reads cost more than.",
    registry=REGISTRY,
)
PREFIX_CACHE_LOOKUP_TOKENS = Counter(
    "scorer_prefix_cache_lookup_tokens_total",
    "Prompt tokens looked up in the prefix cache (the hit ratio's denominator).",
    registry=REGISTRY,
)
PREFIX_CACHE_EVICTIONS = Counter(
    "scorer_prefix_cache_evictions_total",
    "Cached blocks of prompt K/V evicted (least recently used, held by no batch) to make room.",
    registry=REGISTRY,
)
PREFIX_CACHE_REUSE = Gauge(
    "scorer_prefix_cache_reuse",
    "Share of prompt blocks that came back lately (read after their first sighting's write, or seen"
    " again before forgotten): --prefix-cache-admit auto writes blocks on their first sighting while"
    " it is at least 1/16, else on their second.",
    registry=REGISTRY,
    multiprocess_mode="livemax",
)
PREFIX_CACHE_BYTES = Gauge(
    "scorer_prefix_cache_bytes",
    "The prefix cache's K/V pool: bytes holding cached prompt blocks (used) and its size (capacity).",
    ["kind"],
    registry=REGISTRY,
    multiprocess_mode="livemax",
)
BATCH_REQUESTS = Histogram(
    "scorer_batch_requests",
    "Calls merged into one forward batch.",
    buckets=BATCH_REQUEST_BUCKETS,
    registry=REGISTRY,
)
BATCH_TOKENS = Histogram(
    "scorer_batch_tokens",
    "Tokens of one forward batch, as the batcher counts them against its budget.",
    buckets=TOKEN_BUCKETS,
    registry=REGISTRY,
)
GC_PAUSE = Histogram(
    "scorer_gc_pause_seconds",
    "Pauses of Python's cyclic garbage collector, which stop every thread of the process, by the"
    " process's role (server, engine, frontend, replica) and the generation collected.",
    ["process", "generation"],
    buckets=LATENCY_BUCKETS,
    registry=REGISTRY,
)
QUEUE_DEPTH = Gauge(
    "scorer_queue_depth",
    "Calls waiting for a forward batch.",
    registry=REGISTRY,
    multiprocess_mode="livemax",
)
INFLIGHT = Gauge(
    "scorer_inflight_requests",
    "ScoreDocs calls accepted and not yet answered.",
    registry=REGISTRY,
    multiprocess_mode="livesum",
)
READY = Gauge(
    "scorer_ready",
    "1 while the server reports SERVING, else 0.",
    registry=REGISTRY,
    multiprocess_mode="livemax",
)
MODEL_INFO = Gauge(
    "scorer_model_info",
    "The loaded model (value 1), labelled by its name, the attention backend it runs and the one"
    " asked for (they differ after --attention-fallback torch), device and dtype.",
    ["model", "attention_backend", "attention_requested", "device", "dtype"],
    registry=REGISTRY,
    multiprocess_mode="livemax",
)


def observe_request(api: str, scheme: str, code: str, seconds: float) -> None:
    REQUEST_DURATION.labels(api=api, scheme=scheme, code=code).observe(seconds)
    REQUESTS.labels(api=api, scheme=scheme, code=code).inc()
    if code != "OK":
        ERRORS.labels(api=api, code=code).inc()


def observe_usage(scheme: str, docs: int, tokens_computed: int, tokens_saved: int) -> None:
    DOCS_SCORED.labels(scheme=scheme).inc(docs)
    TOKENS_COMPUTED.labels(scheme=scheme).inc(tokens_computed)
    TOKENS_SAVED.labels(scheme=scheme).inc(tokens_saved)


def serve_http(
    port: int,
    host: str,
    multiprocess_dir: str | None = None,
    authorized: Callable[[str | None], bool] | None = None,
) -> WSGIServer:
    """Expose ``/metrics`` on a background thread; ``shutdown()`` the returned server to stop.
    ``multiprocess_dir``: other processes (``scorer serve --frontends``) write their metrics
    there (prometheus-client's multiprocess mode); they are served with this process's as one set.
    ``authorized``: whether a request's ``Authorization`` header (None: none) may read them (401
    otherwise)."""
    registry = REGISTRY
    if multiprocess_dir is not None:
        registry = CollectorRegistry()
        registry.register(_Merged(REGISTRY, multiprocess.MultiProcessCollector(None, multiprocess_dir)))
    server, _ = start_http_server(port, addr=host, registry=registry)
    if authorized is not None:
        server.set_app(_guarded(server.get_app(), authorized))
    return server


def _guarded(app, authorized: Callable[[str | None], bool]):
    def guarded(environ, start_response):
        if authorized(environ.get("HTTP_AUTHORIZATION")):
            return app(environ, start_response)
        start_response("401 Unauthorized", [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")])
        return [b"Authorization: Bearer <api key> required\n"]

    return guarded


class _Merged:
    """The families of several collectors as one: the samples of one name and labels summed (a
    counter that this process and the front ends both count is one series)."""

    def __init__(self, *collectors) -> None:
        self.collectors = collectors

    def collect(self) -> list[Metric]:
        families: dict[str, Metric] = {}
        values: dict[str, dict[tuple, float]] = {}
        for collector in self.collectors:
            for family in collector.collect():
                into = families.setdefault(
                    family.name, Metric(family.name, family.documentation, family.type, family.unit)
                )
                sums = values.setdefault(family.name, {})
                for s in family.samples:
                    key = (s.name, tuple(sorted(s.labels.items())))
                    sums[key] = sums.get(key, 0.0) + s.value
                if not into.documentation:
                    into.documentation = family.documentation
        for name, family in families.items():
            for (sample, labels), value in values[name].items():
                family.add_sample(sample, dict(labels), value)
        return list(families.values())
