"""Bad input is answered with INVALID_ARGUMENT naming the field, and the server stays healthy."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from scorer.v1 import scorer_pb2 as pb

DOC = pb.Doc(text="a document")
INVALID = grpc.StatusCode.INVALID_ARGUMENT


def req(prompt: str = "q", docs=(DOC,), **options) -> pb.ScoreDocsRequest:
    return pb.ScoreDocsRequest(prompt=prompt, docs=list(docs), options=pb.ScoreOptions(**options))


BAD_INPUTS = {
    "empty prompt": (req(prompt=""), INVALID, "prompt"),
    "blank prompt": (req(prompt=" \n "), INVALID, "prompt"),
    "no docs": (req(docs=()), INVALID, "docs"),
    "empty prompt and no docs": (req(prompt="", docs=()), INVALID, "docs"),
    "empty doc": (req(docs=(DOC, pb.Doc(id="x"))), INVALID, "docs[1].text"),
    "control-only prompt": (req(prompt="\u0000"), INVALID, "prompt"),
    "control-only doc": (req(docs=(DOC, pb.Doc(text="\u0000\x7f "))), INVALID, "docs[1].text"),
    "more docs than --max-docs": (req(docs=[DOC] * 65), INVALID, "docs"),
    "unknown scheme": (req(scheme="fastest"), INVALID, "options.scheme"),
    "unknown template": (req(template="chatml"), INVALID, "options.template"),
    "unknown score mode": (req(score_mode="odds"), INVALID, "options.score_mode"),
    "unknown truncate mode": (req(truncate="middle"), INVALID, "options.truncate"),
    "unknown doc_special_tokens": (req(doc_special_tokens="strip"), INVALID, "options.doc_special_tokens"),
    "label of two tokens": (req(label_tokens=["yes", "maybe not"]), INVALID, "options.label_tokens[1]"),
    "label id outside the vocabulary": (req(label_token_ids=[10**6]), INVALID, "options.label_token_ids"),
    "prompt id outside the vocabulary": (
        pb.ScoreDocsRequest(prompt_token_ids=[1, 10**6], docs=[DOC]),
        INVALID,
        "prompt_token_ids",
    ),
    "doc id outside the vocabulary": (req(docs=[pb.Doc(token_ids=[10**6])]), INVALID, "docs[0].token_ids"),
    "an id of a long prompt outside the vocabulary": (  # a long list: checked as one array
        pb.ScoreDocsRequest(prompt_token_ids=[1] * 500 + [10**6] + [2] * 9, docs=[DOC]),
        INVALID,
        "prompt_token_ids",
    ),
    "an id of a long doc outside the vocabulary": (
        req(docs=[DOC, pb.Doc(token_ids=[3] * 300 + [2**32 - 1])]),
        INVALID,
        "docs[1].token_ids",
    ),
    "doc over max_doc_tokens": (req(docs=[pb.Doc(text="x" * 50)], max_doc_tokens=5), INVALID, "docs[0]"),
    "prompt and prompt_token_ids": (
        pb.ScoreDocsRequest(prompt="q", prompt_token_ids=[1, 2], docs=[DOC]),
        INVALID,
        "prompt_token_ids",
    ),
    "instruction and prompt_token_ids": (
        pb.ScoreDocsRequest(instruction="i", prompt_token_ids=[1, 2], docs=[DOC]),
        INVALID,
        "prompt_token_ids",
    ),
    "doc with text and token_ids": (req(docs=[DOC, pb.Doc(text="t", token_ids=[3])]), INVALID, "docs[1]"),
    "label_tokens and label_token_ids": (
        req(label_tokens=["yes", "no"], label_token_ids=[5, 6]),
        INVALID,
        "options.label_token_ids",
    ),
    "the same label twice": (req(label_tokens=["yes", "yes"]), INVALID, "options.label_tokens[1]"),
    "the same label id twice": (req(label_token_ids=[5, 5]), INVALID, "options.label_token_ids[1]"),
    "one label under softmax": (req(label_tokens=["yes"]), INVALID, "options.label_tokens"),
    "unknown special_tokens": (req(special_tokens="strip"), INVALID, "options.special_tokens"),
    "doc over --max-doc-bytes": (req(docs=[pb.Doc(text="x" * (2**20 + 1))]), INVALID, "docs[0].text"),
    "text over --max-request-bytes": (req(docs=[pb.Doc(text="y" * 2**20)] * 17), INVALID, "request"),
    "65 label_token_ids": (req(label_token_ids=range(65)), INVALID, "options.label_token_ids"),
    "65 label_tokens": (req(label_tokens=["yes"] * 65), INVALID, "options.label_tokens"),
    "a doc id of 257 characters": (req(docs=[DOC, pb.Doc(id="i" * 257, text="d")]), INVALID, "docs[1].id"),
    "prompt ids past the positions": (
        pb.ScoreDocsRequest(prompt_token_ids=[1] * 100_000, docs=[DOC]),
        INVALID,
        "prompt_token_ids",
    ),
    "special_tokens and doc_special_tokens differ": (
        req(special_tokens="text", doc_special_tokens="parse"),
        INVALID,
        "options.doc_special_tokens",
    ),
}
BAD_REQUEST_IDS = {
    "a newline": "abc\ndef",
    "non-ASCII": "caf\u00e9",
    "a space": "a b",
    "over 128 characters": "x" * 129,
    "100 KB": "y" * 100_000,
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_answered_with_its_code_and_field(server, case):
    msg, code, field = BAD_INPUTS[case]
    msg.request_id = f"bad-{case.replace(' ', '-')}"
    with pytest.raises(grpc.RpcError) as caught:
        server.stub().ScoreDocs(msg, timeout=30)
    error = caught.value
    trailers = dict(error.trailing_metadata())
    assert error.code() == code
    assert error.details().startswith(f"{field}: ")
    assert trailers["x-invalid-field"] == field
    assert trailers["x-request-id"] == msg.request_id


@pytest.mark.parametrize("case", BAD_REQUEST_IDS)
def test_a_bad_request_id_is_refused_by_name_before_any_work(server, case):
    """No forged log line, no metadata the transport refuses: INVALID_ARGUMENT naming request_id,
    the x-request-id trailer a generated id, counted under its code."""
    before = server.settled("scorer_requests_total", code="INVALID_ARGUMENT")
    msg = req(docs=(DOC, pb.Doc(id="x")))  # a bad doc too: the id is checked first
    msg.request_id = BAD_REQUEST_IDS[case]
    with pytest.raises(grpc.RpcError) as caught:
        server.stub().ScoreDocs(msg, timeout=30)
    error = caught.value
    trailers = dict(error.trailing_metadata())
    assert error.code() == INVALID and error.details().startswith("request_id: ")
    assert trailers["x-invalid-field"] == "request_id" and len(trailers["x-request-id"]) == 32
    assert server.wait_metric("scorer_requests_total", before + 1, code="INVALID_ARGUMENT") == before + 1
    assert "\ndef" not in server.log()


def test_good_request_ids_come_back(server):
    msg = req()
    msg.request_id = "Ab.9_:-" + "z" * 121
    call = server.stub().ScoreDocs.with_call(msg, timeout=30)
    assert (
        call[0].request_id == msg.request_id
        and dict(call[1].trailing_metadata())["x-request-id"] == msg.request_id
    )


def test_garbage_bytes_are_invalid_argument_and_counted(server):
    before = server.settled("scorer_requests_total", code="INVALID_ARGUMENT")
    with server.channel() as channel:
        raw = channel.unary_unary("/scorer.v1.Scorer/ScoreDocs")  # bytes in, bytes out
        with pytest.raises(grpc.RpcError) as caught:
            raw(b"\xff\xff\xff garbage", timeout=30)
    assert caught.value.code() == INVALID and caught.value.details().startswith("request: ")
    assert server.wait_metric("scorer_requests_total", before + 1, code="INVALID_ARGUMENT") == before + 1


def test_server_is_healthy_and_scores_after_every_bad_input(server):
    for msg, _, _ in BAD_INPUTS.values():
        with pytest.raises(grpc.RpcError):
            server.stub().ScoreDocs(msg, timeout=30)
    assert server.health() == health_pb2.HealthCheckResponse.SERVING
    assert len(server.stub().ScoreDocs(req(), timeout=30).results) == 1
    assert server.metric("scorer_errors_total", code="INVALID_ARGUMENT") >= len(BAD_INPUTS)
    assert server.metric("scorer_request_duration_seconds_count", scheme="none", code="INVALID_ARGUMENT") > 0
    assert server.metric("scorer_errors_total", code="INTERNAL") <= 1  # the batching test's injected fault


def test_truncate_doc_end_cuts_instead_of_failing(server, engine):
    text = "x" * 50
    tokens = len(engine.tokenizer.encode(text, add_special_tokens=False))
    long_doc = req(docs=[pb.Doc(text=text)], max_doc_tokens=5, truncate="doc_end", template="plain")
    reply = server.stub().ScoreDocs(long_doc, timeout=30)
    assert tokens > 5 and (reply.results[0].doc_tokens, reply.results[0].truncated_tokens) == (5, tokens - 5)


def test_a_message_above_grpcs_4_mb_default_passes(server):
    """(An answer stays far below it: 64 labels and 256-character ids at most.)"""
    big = [pb.Doc(id=str(i), text=f"{i} " * 2**19) for i in range(5)]
    msg = req(docs=big, scheme="ragged", truncate="doc_end", template="plain")
    assert msg.ByteSize() > 5 * 2**20
    reply = server.stub().ScoreDocs(msg, timeout=60)
    assert [r.id for r in reply.results] == ["0", "1", "2", "3", "4"]
    assert all(r.truncated_tokens + r.truncated_chars > 0 for r in reply.results)


def test_reflection_lists_the_scorer_and_health_services(server):
    with server.channel() as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in next(replies).list_services_response.service}
    assert {"scorer.v1.Scorer", "grpc.health.v1.Health"} <= names
