"""A message is held to the limits before it is copied, and its answer's size before any compute:
refusals name the field, and an answer over ``--max-message-bytes`` is answered and counted as the
RESOURCE_EXHAUSTED the client gets. In process, through the call handler."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import grpc
import pytest

from scorer import metrics
from scorer.request import MAX_DOC_ID, MAX_LABELS, Limits
from scorer.server import handler as handler_module
from scorer.server.batcher import BatchPolicy
from scorer.server.handler import CallHandler
from scorer.server.scoring import ScoringService
from scorer.v1 import scorer_pb2 as pb

LIMITS = Limits(max_docs=1024, max_doc_tokens=8192, max_positions=32768, vocab_size=151_936)
INVALID, EXHAUSTED = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED


class Front:
    """A transport that records the one answer of its call."""

    api = "grpc"
    request_id = ""

    def __init__(self) -> None:
        self.failed: tuple[grpc.StatusCode, str, dict] | None = None

    def deadline(self, started: float) -> float | None:
        return None

    def set_trailers(self, trailers) -> None:
        pass

    def cancelled_code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED

    async def fail(self, code, message, trailers, exc):
        self.failed = (code, message, dict(trailers))


def requests_counted(code: str) -> float:
    """gRPC calls counted under ``code``, every scheme."""
    return sum(
        s.value
        for family in metrics.REQUESTS.collect()
        for s in family.samples
        if s.name.endswith("_total") and s.labels["api"] == "grpc" and s.labels["code"] == code
    )


@pytest.fixture
def copies(monkeypatch) -> list[pb.ScoreDocsRequest]:
    """The messages the handler copied into a ScoreRequest (the copy then fails the call)."""
    copied: list[pb.ScoreDocsRequest] = []

    def copy(msg, request_id):
        copied.append(msg)
        raise AssertionError("copied")

    monkeypatch.setattr(handler_module, "request_from_proto", copy)
    return copied


def refusal(message: bytes | pb.ScoreDocsRequest, max_message_bytes: int | None = None):
    handler = CallHandler(max_message_bytes=max_message_bytes)
    handler.service = SimpleNamespace(engine=SimpleNamespace(limits=LIMITS), tokenize=None)
    front = Front()
    asyncio.run(handler.score_docs(message, front))
    assert front.failed is not None
    return front.failed


def ids_doc(count: int) -> pb.Doc:
    return pb.Doc(token_ids=[5] * count)


BEFORE_ANY_COPY = {
    "20M prompt ids": (
        pb.ScoreDocsRequest(prompt_token_ids=[7] * 20_000_000, docs=[ids_doc(3)]),
        "prompt_token_ids",
    ),
    "1,000 docs of 20k ids": (pb.ScoreDocsRequest(prompt="q", docs=[ids_doc(20_000)] * 1000), "docs[0]"),
    "a doc over its max_doc_tokens": (
        pb.ScoreDocsRequest(
            prompt="q", docs=[ids_doc(3), ids_doc(11)], options=pb.ScoreOptions(max_doc_tokens=10)
        ),
        "docs[1]",
    ),
    "more ids in all than a call can use, truncate=doc_end": (
        pb.ScoreDocsRequest(
            prompt="q", docs=[ids_doc(20_000)] * 1000, options=pb.ScoreOptions(truncate="doc_end")
        ),
        "docs",
    ),
    "more docs than max_docs": (pb.ScoreDocsRequest(prompt="q", docs=[ids_doc(1)] * 1025), "docs"),
    "label_token_ids past the limit": (
        pb.ScoreDocsRequest(
            prompt="q", docs=[ids_doc(1)], options=pb.ScoreOptions(label_token_ids=range(MAX_LABELS + 1))
        ),
        "options.label_token_ids",
    ),
    "label_tokens past the limit": (
        pb.ScoreDocsRequest(
            prompt="q", docs=[ids_doc(1)], options=pb.ScoreOptions(label_tokens=["x"] * (MAX_LABELS + 1))
        ),
        "options.label_tokens",
    ),
    "a doc id past the limit": (
        pb.ScoreDocsRequest(prompt="q", docs=[ids_doc(1), pb.Doc(id="i" * (MAX_DOC_ID + 1), text="d")]),
        "docs[1].id",
    ),
}


@pytest.mark.parametrize("case", BEFORE_ANY_COPY)
def test_a_message_over_a_count_limit_is_refused_by_field_before_it_is_copied(copies, case):
    """A tuple of 20M ids took seconds of the event loop before the length check refused it; the
    counts are read off the message's containers, nothing is copied."""
    msg, field = BEFORE_ANY_COPY[case]
    before = requests_counted("INVALID_ARGUMENT")
    code, message, trailers = refusal(msg.SerializeToString())
    assert (code, trailers["x-invalid-field"]) == (INVALID, field), message
    assert message.startswith(f"{field}: ")
    assert copies == []
    assert requests_counted("INVALID_ARGUMENT") == before + 1


def test_an_answer_estimated_over_max_message_bytes_is_refused_before_any_work(copies):
    """1,024 docs x 64 labels' log-probs with 200-character ids: about 330 KB of answer."""
    options = pb.ScoreOptions(label_token_ids=range(MAX_LABELS), return_label_logprobs=True)
    msg = pb.ScoreDocsRequest(prompt="q", docs=[pb.Doc(id="i" * 200, text="d")] * 1024, options=options)
    limit = 300_000
    assert msg.ByteSize() < limit
    code, message, _ = refusal(msg, max_message_bytes=limit)
    assert code == EXHAUSTED and "--max-message-bytes" in message and "top_n" in message
    assert copies == []
    msg.options.top_n = 10  # ten docs come back: small, and on to the copy
    refusal(msg, max_message_bytes=limit)
    assert copies == [msg]


def test_an_answer_over_max_message_bytes_is_answered_and_counted_resource_exhausted(engine, monkeypatch):
    """Were the estimate short, gRPC would refuse to send the answer (the client gets
    RESOURCE_EXHAUSTED) after the handler counted OK: the handler measures the answer itself."""
    monkeypatch.setattr(handler_module, "answer_bytes", lambda msg: 0)
    msg = pb.ScoreDocsRequest(prompt="q", docs=[pb.Doc(id=str(i) * 100, text="d") for i in range(10)])
    ok, exhausted = requests_counted("OK"), requests_counted("RESOURCE_EXHAUSTED")

    async def scenario():
        handler = CallHandler(max_message_bytes=1000)
        service = ScoringService(engine, BatchPolicy())
        service.start()
        handler.service = service
        front = Front()
        try:
            await handler.score_docs(msg, front)
        finally:
            await service.close()
        return front.failed

    code, message, _ = asyncio.run(scenario())
    assert code == EXHAUSTED and "the answer takes" in message
    assert requests_counted("OK") == ok and requests_counted("RESOURCE_EXHAUSTED") == exhausted + 1
