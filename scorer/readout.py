"""The read-out: label log-probs (or logits) at each item's score row from the LM head or a score
head, score modes, usage, ``top_n``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from .devices import to_device
from .lazy_torch import torch
from .options import RAW_MODES
from .request import Job


@dataclass(frozen=True)
class DocScore:
    index: int
    id: str
    score: float
    label_logprobs: tuple[float, ...]
    doc_tokens: int
    truncated_tokens: int
    truncated_chars: int = 0


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    doc_tokens: int
    tokens_computed: int
    tokens_saved: int
    cached_prompt_tokens: int = 0


@dataclass(frozen=True)
class ScoreResult:
    results: tuple[DocScore, ...]  # input order, or the best ``top_n`` by score
    scheme: str
    usage: Usage


def label_logprobs(model, rows: torch.Tensor, jobs: Sequence[Job]) -> torch.Tensor:
    """Log-probs of each item's labels over the whole head (the vocabulary, or a score head's
    outputs; a one-output head against a constant 0) from its last hidden row ([items, hidden],
    the items of ``jobs`` in order), flat in item order; for a job whose score mode is ``raw`` or
    ``sigmoid``, the labels' logits. On the device, not waited for."""
    logits = model.score_logits(rows).float()
    if logits.shape[1] == 1:
        logits = torch.cat([logits, torch.zeros_like(logits)], dim=1)
    lse = torch.logsumexp(logits, dim=-1)
    item, label_ids, raw, at = [], [], [], 0
    for job in jobs:
        k, n = len(job.label_ids), len(job.items)
        item += [i for i in range(at, at + n) for _ in range(k)]
        label_ids += job.label_ids * n
        raw += [job.options.score_mode in RAW_MODES] * (k * n)
        at += n
    item = to_device(torch.tensor(item, dtype=torch.long), rows.device)
    label_ids = to_device(torch.tensor(label_ids, dtype=torch.long), rows.device)
    picked = logits[item, label_ids]
    if not any(raw):
        return picked - lse[item]
    keep = to_device(torch.tensor(raw), rows.device)
    return torch.where(keep, picked, picked - lse[item])


def results(
    jobs: Sequence[Job],
    requests: Sequence[int],
    flat: Sequence[float],
    cached: Sequence[int] = (),
    computed: Sequence[int] = (),
) -> list[ScoreResult]:
    """Each request's result in batch order, from the flat label log-probs of ``jobs`` (plan
    order; ``requests``: the batch index of each; ``cached``: the prompt tokens each read from
    the prefix cache, () for none; ``computed``: the rows each put through the model where the
    plan says otherwise than its scheme, as a split that computes its prompt again, () for none)."""
    out: list[ScoreResult | None] = [None] * len(requests)
    at = 0
    for r, (pos, job) in enumerate(zip(requests, jobs, strict=True)):
        k = len(job.label_ids)
        lps = [tuple(flat[at + i * k : at + (i + 1) * k]) for i in range(len(job.items))]
        at += k * len(job.items)
        out[pos] = result(job, lps, cached[r] if cached else 0, computed[r] if computed else None)
    return out  # type: ignore[return-value]


def result(
    job: Job, logprobs: Sequence[tuple[float, ...]], cached: int = 0, computed: int | None = None
) -> ScoreResult:
    o = job.options
    docs = job.request.docs
    scores = [
        DocScore(
            i,
            docs[i].id,
            score(lps, o.score_mode),
            lps,
            job.doc_tokens[i],
            job.truncated[i],
            job.truncated_chars[i] if job.truncated_chars else 0,
        )
        for i, lps in enumerate(logprobs)
    ]
    if computed is None:
        computed = job.scheme.rows(replace(job.shape, cached=cached))
    usage = Usage(
        len(job.prefix_ids),
        sum(job.doc_tokens),
        computed,
        job.shape.prompt_per_doc_tokens - computed,
        cached,
    )
    return ScoreResult(tuple(ranked(scores, o.top_n)), job.scheme.name, usage)


def score(values: Sequence[float], mode: str) -> float:
    """A doc's score from its labels' log-probs (``raw``, ``sigmoid``: logits), label 0 the relevant
    one: ``softmax`` P(label 0) over the labels, ``logprob`` log P(label 0), ``raw`` its logit,
    ``sigmoid`` the logit's sigmoid."""
    if mode in ("logprob", "raw"):
        return values[0]
    if mode == "sigmoid":  # exp of a negative number only: no overflow
        x = values[0]
        return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
    return math.exp(values[0] - _logsumexp(values))


def ranked(results: Sequence[DocScore], top_n: int) -> list[DocScore]:
    """Input order when ``top_n`` is 0, else the best ``top_n`` by score, ties in input order."""
    if not top_n:
        return list(results)
    return sorted(results, key=lambda d: -d.score)[:top_n]


def _logsumexp(xs: Sequence[float]) -> float:
    m = max(xs)
    return m + math.log(sum(math.exp(x - m) for x in xs))
