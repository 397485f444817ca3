"""Test knobs: faults and delays injected around the forward pass. Never set them in production.

They make the RPC tests deterministic: a forward delay holds calls in the queue long enough for
a deadline to expire there; an out-of-memory threshold and a fault prompt exercise the error
paths without a real accelerator running out of memory or a real bug.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from ..lazy_torch import torch
from ..request import Job
from .batcher import ScoreFn


@dataclass(frozen=True)
class DebugKnobs:
    forward_delay_s: float = 0.0
    oom_above_tokens: int = 0  # a forward batch over this many tokens raises torch.OutOfMemoryError
    fault_prompt: str = ""  # a batch holding a call with this prompt raises RuntimeError
    tokenize_delay_s: float = 0.0  # every call sleeps this long on its tokenizer thread first

    @property
    def active(self) -> bool:
        return bool(
            self.forward_delay_s or self.oom_above_tokens or self.fault_prompt or self.tokenize_delay_s
        )


def with_faults(score: ScoreFn, knobs: DebugKnobs) -> ScoreFn:
    def faulty_score(batch: Sequence[Job]):
        if knobs.forward_delay_s:
            time.sleep(knobs.forward_delay_s)
        if knobs.fault_prompt and any(t.request.prompt == knobs.fault_prompt for t in batch):
            raise RuntimeError("injected fault (--debug-fault-prompt)")
        tokens = sum(job.tokens for job in batch)
        if knobs.oom_above_tokens and tokens > knobs.oom_above_tokens:
            raise torch.OutOfMemoryError(f"injected: {tokens} tokens > --debug-oom-above-tokens")
        return score(batch)

    return faulty_score


def with_tokenize_delay(tokenize, seconds: float):
    def slow_tokenize(*args):
        time.sleep(seconds)
        return tokenize(*args)

    return slow_tokenize
