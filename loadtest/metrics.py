"""The server's own counts from its Prometheus ``/metrics``, and their reconciliation with the client's.

The names are the scorer's (scorer/metrics.py); the stub server exports the same ones. Calls and errors
are counted for one front end (``api``: grpc, cohere, jina or tei), samples without an ``api`` label
(a server from before it) for any; docs scored, refusals and calls in flight have no such label.
"""

from __future__ import annotations

import time
import urllib.request
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

REQUESTS = "scorer_requests_total"  # labels api, scheme (concrete), code
ERRORS = "scorer_errors_total"  # labels api, code
DOCS = "scorer_docs_scored_total"  # label scheme
REJECTED = "scorer_requests_rejected_total"
INFLIGHT = "scorer_inflight_requests"
STAGE = "scorer_stage_duration_seconds"  # label stage: queue, tokenize, forward (a call's batch's)
BATCH_CALLS = "scorer_batch_requests"
BATCH_TOKENS = "scorer_batch_tokens"
SUMS = {f"{STAGE}_sum", f"{STAGE}_count", f"{BATCH_CALLS}_sum", f"{BATCH_CALLS}_count", f"{BATCH_TOKENS}_sum"}
"""Histogram sums and counts kept by ``stage`` (or the metric alone): where a call's time went on the
server, and the batches it ran in."""


@dataclass
class ServerCounts:
    requests_by_code: dict[str, float] = field(default_factory=dict)
    requests_by_scheme: dict[str, float] = field(default_factory=dict)
    errors_by_code: dict[str, float] = field(default_factory=dict)
    docs_by_scheme: dict[str, float] = field(default_factory=dict)
    rejected: float = 0.0
    inflight: float = 0.0
    sums: dict[str, float] = field(default_factory=dict)  # SUMS' samples, "name" or "name:stage"

    @property
    def requests(self) -> float:
        return sum(self.requests_by_code.values())

    @property
    def docs(self) -> float:
        return sum(self.docs_by_scheme.values())

    def minus(self, before: ServerCounts) -> ServerCounts:
        def sub(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
            return {k: v - b.get(k, 0.0) for k, v in a.items() if v - b.get(k, 0.0)}

        return ServerCounts(
            sub(self.requests_by_code, before.requests_by_code),
            sub(self.requests_by_scheme, before.requests_by_scheme),
            sub(self.errors_by_code, before.errors_by_code),
            sub(self.docs_by_scheme, before.docs_by_scheme),
            self.rejected - before.rejected,
            self.inflight,
            {k: v - before.sums.get(k, 0.0) for k, v in self.sums.items()},
        )

    def stages(self) -> dict:
        """Mean ms a call spent in each server stage, and the batches' mean calls and tokens (of what
        the server counted; empty where it exports none of them)."""
        out: dict = {}
        for key, total in self.sums.items():
            name, _, stage = key.partition(":")
            if name == f"{STAGE}_sum" and self.sums.get(f"{STAGE}_count:{stage}"):
                out[f"{stage}_ms_mean"] = round(1e3 * total / self.sums[f"{STAGE}_count:{stage}"], 2)
        batches = self.sums.get(f"{BATCH_CALLS}_count", 0.0)
        if batches:
            out["batches"] = batches
            out["batch_calls_mean"] = round(self.sums.get(f"{BATCH_CALLS}_sum", 0.0) / batches, 2)
            out["batch_tokens_mean"] = round(self.sums.get(f"{BATCH_TOKENS}_sum", 0.0) / batches, 1)
        return out


def parse(text: str, api: str | None = None) -> ServerCounts:
    """The counts in a /metrics page; with ``api``, calls and errors of that front end only."""
    out = ServerCounts()
    acc: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if api is not None and s.name in (REQUESTS, ERRORS) and s.labels.get("api", api) != api:
                continue
            if s.name == REQUESTS:
                acc["code"][s.labels.get("code", "").upper()] += s.value
                acc["scheme"][s.labels.get("scheme", "")] += s.value
            elif s.name == ERRORS:
                acc["errors"][s.labels.get("code", "").upper()] += s.value
            elif s.name == DOCS:
                acc["docs"][s.labels.get("scheme", "")] += s.value
            elif s.name == REJECTED:
                out.rejected += s.value
            elif s.name == INFLIGHT:
                out.inflight += s.value
            elif s.name in SUMS:
                key = f"{s.name}:{s.labels['stage']}" if "stage" in s.labels else s.name
                out.sums[key] = out.sums.get(key, 0.0) + s.value
    out.requests_by_code, out.requests_by_scheme = dict(acc["code"]), dict(acc["scheme"])
    out.errors_by_code, out.docs_by_scheme = dict(acc["errors"]), dict(acc["docs"])
    return out


def scrape(url: str, timeout: float = 5.0, api: str | None = None) -> ServerCounts:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return parse(resp.read().decode(), api)


def scrape_settled(
    url: str,
    expected: int,
    before: ServerCounts,
    wait_s: float = 5.0,
    api: str | None = None,
    most_s: float = 120.0,
    read: Callable[[], ServerCounts] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> ServerCounts:
    """Scrape until the server has answered ``expected`` calls since ``before``, or has answered
    none for ``wait_s`` (``most_s`` at most).

    Calls the client gave up on (deadline) may still be finishing on the server when the run ends:
    an overloaded server answers them a batch at a time, which can take longer than ``wait_s`` in
    all, so the wait restarts with each answer. ``read``, ``clock`` and ``sleep``: the scrape (of
    ``url`` by default) and time, for tests.
    """
    read = read or (lambda: scrape(url, api=api))
    start = last = clock()
    answered = -1.0
    while True:
        delta = read().minus(before)
        now = clock()
        if delta.requests > answered:
            answered, last = delta.requests, now
        if delta.requests >= expected or now - last >= wait_s or now - start >= most_s:
            return delta
        sleep(0.1)


DEADLINE_OR_CANCELLED = "DEADLINE_EXCEEDED/CANCELLED"
"""A call the client gave up on at its deadline may end as CANCELLED on the server: one row for both."""


def _merge_deadline(by_code: dict[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    for code, n in by_code.items():
        key = DEADLINE_OR_CANCELLED if code in ("DEADLINE_EXCEEDED", "CANCELLED") else code
        out[key] = out.get(key, 0) + n
    return out


def _explain(table: dict, client_codes: dict[str, float], server_codes: dict[str, float]) -> str:
    """Calls done on the server just after the client's deadline: OK there, DEADLINE_EXCEEDED here."""
    late = server_codes.get("OK", 0) - client_codes.get("OK", 0)
    dl = client_codes.get(DEADLINE_OR_CANCELLED, 0) - server_codes.get(DEADLINE_OR_CANCELLED, 0)
    others = [k for k, r in table.items() if not r["match"]]
    expected = {"ok", "failed", "docs", "code OK", f"code {DEADLINE_OR_CANCELLED}"}
    if late > 0 and dl == late and set(others) <= expected and table["docs"]["diff"] >= late:
        return (
            f"match but for {late:g} call(s) the server answered OK after the client's deadline "
            "(DEADLINE_EXCEEDED here)"
        )
    return "do not match"


def reconcile(client: dict, server: ServerCounts, api: str | None = None) -> dict:
    """Side by side: requests, ok, failed, docs scored (ok calls), and calls by status code; ``api``:
    the front end whose calls the server's counts are (None: every one)."""
    client_codes, server_codes = _merge_deadline(client["by_code"]), _merge_deadline(server.requests_by_code)
    rows = {
        "requests": (client["requests"], server.requests),
        "ok": (client_codes.get("OK", 0), server_codes.get("OK", 0)),
        "failed": (client["failed"], server.requests - server_codes.get("OK", 0)),
        "docs": (client["docs_ok"], server.docs),
    }
    for c in sorted(set(client_codes) | set(server_codes)):
        rows[f"code {c}"] = (client_codes.get(c, 0), server_codes.get(c, 0))
    table = {
        k: {"client": c, "server": s, "diff": s - c, "match": abs(s - c) < 1e-6} for k, (c, s) in rows.items()
    }
    matched = all(r["match"] for r in table.values())
    verdict = "match" if matched else _explain(table, client_codes, server_codes)
    return {
        "matched": matched,
        "explained": verdict != "do not match",
        "verdict": verdict,
        "api": api,
        "rows": table,
        "server_requests_by_code": server.requests_by_code,
        "server_errors_by_code": server.errors_by_code,
        "server_requests_by_scheme": server.requests_by_scheme,
        "server_docs_by_scheme": server.docs_by_scheme,
        "server_rejected": server.rejected,
        "server_stages": server.stages(),
    }
