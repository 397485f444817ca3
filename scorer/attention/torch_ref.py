"""Reference attention in plain torch: the exact mask derived from the plan's metadata.

It is the oracle the planners and the FlashInfer backend are tested against, and the CPU path.
Masks are built once in ``plan`` and reused by every layer. Each request is cut into blocks of
query rows, and a block only gathers the K/V columns its mask can see, so a multi-item request
costs about what its visible pairs cost, not its full Q x K square.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from ..planning import Pass
from ..planning.base import AttentionCall
from ..planning.packbits import unpack_segment
from .base import HeadSpec

ROW_BLOCK = 128


@dataclass(frozen=True)
class _Block:
    q0: int
    q1: int
    kv: torch.Tensor  # slot indices of the columns this block can see
    mask: torch.Tensor  # bool [q1 - q0, len(kv)]


def request_mask(c: AttentionCall, i: int, q_len: int, kv_len: int) -> torch.Tensor:
    """Which K/V each query of request ``i`` of ``c`` may see, as FlashInfer defines it."""
    if c.custom_mask is not None:
        return unpack_segment(c.custom_mask, i, q_len, kv_len)
    if not c.causal:
        return torch.ones(q_len, kv_len, dtype=torch.bool)
    qi = torch.arange(q_len).unsqueeze(1) + (kv_len - q_len)
    j = torch.arange(kv_len).unsqueeze(0)
    mask = j <= qi
    if c.multi_item is not None:
        m = c.multi_item
        prefix = int(m.prefix_len[i])
        width = m.token_pos_in_items_len
        pos = m.token_pos_in_items[i * width : (i + 1) * width].to(torch.int64)
        pos_q = pos[(qi - prefix).clamp(0, width - 1)]
        mask &= (qi < prefix) | (j < prefix) | (j >= qi - pos_q + 1)
    return mask


class TorchBackend:
    name = "torch"

    def __init__(self, spec: HeadSpec) -> None:
        self.spec = spec
        self.stats: Counter = Counter()
        self._calls: list[tuple[tuple[int, int], list[_Block]]] = []
        self._groups: list[list[int]] = []

    def plan(self, p: Pass) -> None:
        dev = self.spec.device
        self._calls = []
        for c in p.calls:
            if c.page_size != 1:
                raise ValueError(f"the torch reference runs page_size 1, not {c.page_size}")
            qo, kvp = c.qo_indptr.tolist(), c.kv_indptr.tolist()
            blocks = []
            for i in range(c.num_requests):
                kv = c.kv_indices[kvp[i] : kvp[i + 1]].long()
                mask = request_mask(c, i, qo[i + 1] - qo[i], len(kv))
                for b in range(0, len(mask), ROW_BLOCK):
                    sub = mask[b : b + ROW_BLOCK]
                    cols = sub.any(0).nonzero().flatten()
                    q0 = c.q_start + qo[i] + b
                    blocks.append(_Block(q0, q0 + len(sub), kv[cols].to(dev), sub[:, cols].to(dev)))
            self._calls.append((c.rows, blocks))
        self._groups = p.merge_groups()

    def run(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = torch.empty_like(q) if out is None else out
        for group in self._groups:
            states = [self._call(q, k, v, i) for i in group]
            (q0, q1), _ = self._calls[group[0]]
            out[q0:q1] = merge_states(states).to(q.dtype)
            self.stats["merges"] += len(group) - 1
        self.stats["calls"] += len(self._calls)
        return out

    def _call(self, q, k, v, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        (q0, q1), blocks = self._calls[i]
        o = torch.zeros(q1 - q0, q.shape[1], q.shape[2], dtype=torch.float32, device=q.device)
        lse = torch.full((q1 - q0, q.shape[1]), float("-inf"), device=q.device)
        for b in blocks:
            o[b.q0 - q0 : b.q1 - q0], lse[b.q0 - q0 : b.q1 - q0] = attend(
                q[b.q0 : b.q1], k[b.kv], v[b.kv], b.mask, self.spec.sm_scale, self.spec.soft_cap
            )
        return o, lse


def attend(q, k, v, mask, scale: float, soft_cap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention in fp32 with GQA (the scaled logits soft-capped when ``soft_cap``);
    returns output [n, H, D] and LSE [n, H]."""
    rep = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(rep, dim=1)
    v = v.float().repeat_interleave(rep, dim=1)
    s = torch.einsum("nhd,mhd->hnm", q.float(), k) * scale
    if soft_cap:
        s = torch.tanh(s / soft_cap) * soft_cap
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("hnm,mhd->nhd", torch.exp(s - lse.unsqueeze(-1)), v)
    return out, lse.transpose(0, 1)


def merge_states(states: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """Combine partial attention states over disjoint K/V sets by their log-sum-exp."""
    if len(states) == 1:
        return states[0][0]
    lse = torch.stack([s[1] for s in states])  # [k, n, H]
    w = torch.softmax(lse, dim=0).unsqueeze(-1)
    return (torch.stack([s[0] for s in states]) * w).sum(0)
