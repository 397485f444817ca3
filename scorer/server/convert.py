"""Protobuf <-> engine types, and the limits a message is held to before it is copied into them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..request import (
    DEFAULT_LABELS,
    MAX_DOC_ID,
    Doc,
    InvalidInput,
    Job,
    Limits,
    ScoreOptions,
    ScoreRequest,
    check_labels,
)
from ..token_ids import token_ids
from ..v1 import scorer_pb2 as pb
from .batcher import Scored

ANSWER_BYTES = 1024
"""At most, the bytes of an answer besides its docs: scheme, usage, timing, model, template (the
request id is counted apart)."""
DOC_SCORE_BYTES = 48
"""At most, the bytes of one doc's entry in an answer besides its id and label log-probs: every
field's tag, length and largest value (uint32 varints of 5 bytes, a 4-byte float)."""


@dataclass(frozen=True)
class Counts:
    """What the limits hold a ScoreDocsRequest to, without its contents: its options, the count of
    its prompt's token ids, and each doc's count of token ids and its id's UTF-8 bytes. Read off a
    parsed message (``of``: a protobuf container's length is known without copying it) or off
    its bytes before any parse (``wire.counts``)."""

    options: pb.ScoreOptions
    prompt_ids: int
    doc_ids: Sequence[int]
    id_bytes: Sequence[int]
    request_id_bytes: int = 0

    @classmethod
    def of(cls, msg: pb.ScoreDocsRequest) -> Counts:
        docs = msg.docs
        return cls(
            msg.options,
            len(msg.prompt_token_ids),
            [len(d.token_ids) for d in docs],
            [len(d.id.encode()) for d in docs],
            len(msg.request_id),
        )


def check_counts(counts: Counts, limits: Limits) -> None:
    """``counts`` against ``limits``, before anything is copied out of the message (a tuple of 20M
    ids took seconds of the event loop): docs, labels, the prompt's ids against the model's
    positions, each doc's ids against its limit where ``truncate`` is error, all ids against what
    a call at every limit can use, and the ids the answer echoes. Raises InvalidInput naming the
    field; ``tokenize`` checks the same exactly (the template's tokens counted) once copied."""
    o = counts.options
    check_labels(len(o.label_tokens), len(o.label_token_ids))
    docs = len(counts.doc_ids)
    if docs > limits.max_docs:
        raise InvalidInput("docs", f"{docs} documents exceed the limit of {limits.max_docs}")
    prompt = counts.prompt_ids
    if prompt >= limits.max_positions:
        raise InvalidInput(
            "prompt_token_ids",
            f"{prompt} tokens leave no room for a document in the model's {limits.max_positions} positions",
        )
    room = limits.max_positions - prompt
    cap = min(o.max_doc_tokens or limits.max_doc_tokens, limits.max_doc_tokens, room)
    strict = (o.truncate or "error") == "error"
    for i, (count, id_bytes) in enumerate(zip(counts.doc_ids, counts.id_bytes, strict=True)):
        if id_bytes > MAX_DOC_ID:  # bytes: a bound on its characters
            raise InvalidInput(f"docs[{i}].id", f"{id_bytes} bytes exceed the limit of {MAX_DOC_ID}")
        if strict and count > cap:
            why = "the prompt + document exceed the model's positions" if cap == room else "max_doc_tokens"
            raise InvalidInput(
                f"docs[{i}]", f"{count} tokens exceed the limit of {cap} ({why}); set truncate=doc_end"
            )
    total, most = prompt + sum(counts.doc_ids), limits.max_positions + limits.max_docs * limits.max_doc_tokens
    if total > most:
        raise InvalidInput(
            "docs",
            f"{total} token ids in all exceed the limit of {most} (the model's positions + max_docs x"
            " max_doc_tokens: what a call can use)",
        )


def answer_bytes(counts: Counts) -> int:
    """At most, the size of the answer: the docs returned (``top_n`` or all) with their ids (the
    longest, where ``top_n`` picks) and a float per label each with ``return_label_logprobs``."""
    o = counts.options
    ids = sorted(counts.id_bytes, reverse=True)
    returned = min(o.top_n, len(ids)) if o.top_n else len(ids)
    labels = len(o.label_token_ids) or len(o.label_tokens) or len(DEFAULT_LABELS)
    per_doc = DOC_SCORE_BYTES + (4 * labels if o.return_label_logprobs else 0)
    return ANSWER_BYTES + counts.request_id_bytes + returned * per_doc + sum(ids[:returned])


def request_from_proto(msg: pb.ScoreDocsRequest, request_id: str) -> ScoreRequest:
    o = msg.options
    options = ScoreOptions(
        scheme=o.scheme,
        template=o.template,
        label_tokens=tuple(o.label_tokens),
        label_token_ids=tuple(o.label_token_ids),
        score_mode=o.score_mode,
        truncate=o.truncate,
        max_doc_tokens=o.max_doc_tokens,
        group_size=o.group_size,
        doc_special_tokens=o.doc_special_tokens,
        special_tokens=o.special_tokens,
        top_n=o.top_n,
        return_label_logprobs=o.return_label_logprobs,
        prefix_cache=o.prefix_cache,
        cache_salt=o.cache_salt,
    )
    # long lists of token ids copied out of the message as numpy arrays (upb's container copies
    # itself in C: 4 us for 8,000 ids, where a tuple took 330 on a 2-core VM)
    docs = [Doc(text=d.text, id=d.id, token_ids=token_ids(d.token_ids)) for d in msg.docs]
    return ScoreRequest(
        prompt=msg.prompt,
        docs=docs,
        instruction=msg.instruction,
        prompt_token_ids=token_ids(msg.prompt_token_ids),
        options=options,
        request_id=request_id,
    )


def response_to_proto(
    job: Job, request_id: str, model: str, scored: Scored, tokenize_seconds: float, total_seconds: float
) -> pb.ScoreDocsResponse:
    result, o = scored.result, job.options
    usage = result.usage
    return pb.ScoreDocsResponse(
        results=[
            pb.DocScore(
                id=d.id,
                index=d.index,
                score=d.score,
                label_logprobs=d.label_logprobs if o.return_label_logprobs else (),
                doc_tokens=d.doc_tokens,
                truncated_tokens=d.truncated_tokens,
                truncated_chars=d.truncated_chars,
            )
            for d in result.results
        ],
        scheme=result.scheme,
        usage=pb.Usage(
            prompt_tokens=usage.prompt_tokens,
            doc_tokens=usage.doc_tokens,
            tokens_computed=usage.tokens_computed,
            tokens_saved=usage.tokens_saved,
            cached_prompt_tokens=usage.cached_prompt_tokens,
        ),
        timing=pb.Timing(
            queue_seconds=scored.queue_seconds,
            tokenize_seconds=tokenize_seconds,
            forward_seconds=scored.forward_seconds,
            total_seconds=total_seconds,
        ),
        model=model,
        template=o.template or ScoreOptions.template,
        request_id=request_id,
    )
