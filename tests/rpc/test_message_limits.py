"""A message is held to the limits before it is copied, and its answer's size before any compute:
refusals name the field, and an answer over ``--max-message-bytes`` is answered and counted as the
RESOURCE_EXHAUSTED the client gets. In process, through the call handler."""

from __future__ import annotations

import asyncio
import random
import re
import threading
import time
from types import SimpleNamespace

import grpc
import pytest
from rpc_harness import wait_for

from scorer import metrics
from scorer.request import MAX_DOC_ID, MAX_LABELS, Limits
from scorer.server import handler as handler_module
from scorer.server import wire
from scorer.server.batcher import BatchPolicy
from scorer.server.convert import Counts
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
def parsed(monkeypatch) -> list[int]:
    """The sizes of the messages the handler parsed."""
    sizes: list[int] = []

    def parse(data: bytes) -> pb.ScoreDocsRequest:
        sizes.append(len(data))
        return pb.ScoreDocsRequest.FromString(data)

    request = SimpleNamespace(FromString=parse)
    monkeypatch.setattr(handler_module, "pb", SimpleNamespace(ScoreDocsRequest=request))
    return sizes


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
    "a doc id past the limit, in a large message": (
        pb.ScoreDocsRequest(prompt="q", docs=[pb.Doc(text="t" * 2**20), pb.Doc(id="\u00e9" * 129, text="d")]),
        "docs[1].id",
    ),
}


@pytest.mark.parametrize("case", BEFORE_ANY_COPY)
def test_a_message_over_a_count_limit_is_refused_by_field_before_it_is_copied(copies, parsed, case):
    """A tuple of 20M ids took seconds of the event loop before the length check refused it, and
    parsing the 40 MB message ~0.3 s: the counts of a message over SCAN_ABOVE bytes are read off
    its wire form before any parse, a smaller one's off its containers; nothing is copied."""
    msg, field = BEFORE_ANY_COPY[case]
    data = msg.SerializeToString()
    before = requests_counted("INVALID_ARGUMENT")
    code, message, trailers = refusal(data)
    assert (code, trailers["x-invalid-field"]) == (INVALID, field), message
    assert message.startswith(f"{field}: ")
    assert copies == []
    assert parsed == ([] if len(data) > handler_module.SCAN_ABOVE else [len(data)])
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


def random_message(rng: random.Random) -> pb.ScoreDocsRequest:
    def ids(most: int) -> list[int]:
        return [
            rng.choice((0, 1, 127, 128, 300, 16383, 16384, 2**21, 2**32 - 1))
            for _ in range(rng.randint(0, most))
        ]

    docs = [
        pb.Doc(
            id=rng.choice(("", "d", "\u00e9t\u00e9", "x" * 300)),
            text=rng.choice(("", "text")),
            token_ids=ids(50),
        )
        for _ in range(rng.randint(0, 6))
    ]
    options = pb.ScoreOptions(
        label_token_ids=ids(5),
        top_n=rng.randint(0, 3),
        truncate=rng.choice(("", "doc_end")),
        max_doc_tokens=7,
    )
    return pb.ScoreDocsRequest(
        prompt=rng.choice(("", "q")),
        docs=docs,
        options=options if rng.random() < 0.8 else None,
        request_id=rng.choice(("", "rid")),
        prompt_token_ids=ids(40),
    )


def test_the_wire_counts_are_the_parsed_messages():
    rng = random.Random(3)
    for _ in range(300):
        msg = random_message(rng)
        assert wire.counts(msg.SerializeToString(), max_docs=1024) == Counts.of(msg), msg


def test_a_message_in_another_form_is_left_to_the_parser():
    """Token ids one by one (not packed: every protobuf parser takes them), a truncated message."""
    doc = pb.Doc(id="d", token_ids=[5, 6]).SerializeToString()
    unpacked_prompt = b"\x30\x05\x30\x06" + b"\x12" + bytes([len(doc)]) + doc  # prompt_token_ids 5, 6
    assert list(pb.ScoreDocsRequest.FromString(unpacked_prompt).prompt_token_ids) == [5, 6]
    assert wire.counts(unpacked_prompt, max_docs=1024) is None
    unpacked_doc = b"\x12\x04\x18\x05\x18\x06"  # a doc with token_ids 5, 6
    assert list(pb.ScoreDocsRequest.FromString(unpacked_doc).docs[0].token_ids) == [5, 6]
    assert wire.counts(unpacked_doc, max_docs=1024) is None
    assert wire.counts(pb.ScoreDocsRequest(prompt="q" * 50).SerializeToString()[:-1], max_docs=1024) is None


def test_a_server_refuses_20m_prompt_ids_promptly_and_small_calls_beside_it_go_on(server):
    """Before, the refusal came after 2.8-9.9 s and small calls waited up to 8.8 s. The bounds are
    generous (a loaded 2-core machine); the refusal's handling, as the server logs it, took 24 ms
    on one at load 8 (the client's round trip, the 40 MB sent: 0.16 s)."""
    data = pb.ScoreDocsRequest(prompt_token_ids=[1000] * 20_000_000, docs=[ids_doc(3)]).SerializeToString()
    small = pb.ScoreDocsRequest(prompt="q", docs=[pb.Doc(text="d")])
    waits: list[float] = []
    big_done = threading.Event()

    def small_calls() -> None:
        stub = server.stub()
        while not big_done.is_set() or len(waits) < 3:
            sent = time.monotonic()
            stub.ScoreDocs(small, timeout=30)
            waits.append(time.monotonic() - sent)

    beside = threading.Thread(target=small_calls)
    beside.start()
    try:
        with server.channel() as channel, pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary("/scorer.v1.Scorer/ScoreDocs")(data, timeout=60)
    finally:
        big_done.set()
        beside.join()
    assert caught.value.code() == INVALID and caught.value.details().startswith("prompt_token_ids: 20000000 ")
    # The server logs a call after its answer is sent: wait for the line rather than race it.
    line = re.compile(r"INVALID_ARGUMENT scheme=none ([\d.]+) ms: prompt_token_ids: 20000000 ")
    handled = wait_for(lambda: line.findall(server.log()), 30, "the refusal was not logged")
    assert float(handled[-1]) < 2000, handled
    assert max(waits) < 3.0, waits
