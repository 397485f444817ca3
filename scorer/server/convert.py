"""Protobuf <-> engine types, and nothing else."""

from __future__ import annotations

from ..request import Doc, Job, ScoreOptions, ScoreRequest
from ..v1 import scorer_pb2 as pb
from .batcher import Scored


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
    docs = [Doc(text=d.text, id=d.id, token_ids=tuple(d.token_ids)) for d in msg.docs]
    return ScoreRequest(
        prompt=msg.prompt,
        docs=docs,
        instruction=msg.instruction,
        prompt_token_ids=tuple(msg.prompt_token_ids),
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
