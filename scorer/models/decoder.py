"""Decoder-only LM (Qwen3 and Llama families) over a flat token batch, with pluggable attention.

Parameter names equal those of transformers' *ForCausalLM, so HF safetensors load as they are.
The attention callable gets RoPE'd (and, for Qwen3, q/k-normed) heads and applies the 1/sqrt(head_dim)
scale and whatever masking it wants itself.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from scorer.config import ModelConfig
from scorer.models.rope import RotaryEmbedding, apply_rope

AttnFn = Callable[..., torch.Tensor]
"""attn(layer_idx, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], out=None) -> out [T, Hq, D]."""
CosSin = tuple[torch.Tensor, torch.Tensor]
QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(hidden, q_size, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_size, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=bias)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def qkv(self, x: torch.Tensor, rope: CosSin, out: QKV | None = None) -> QKV:
        """RoPE'd (and q/k-normed) heads of x [T, hidden]; written into ``out`` when given."""
        T = x.shape[0]
        q = self.q_proj(x).view(T, -1, self.head_dim)
        k = self.k_proj(x).view(T, -1, self.head_dim)
        v = self.v_proj(x).view(T, -1, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if out is None:
            return (*apply_rope(q, k, rope), v)
        apply_rope(q, k, rope, out=out[:2])
        out[2].copy_(v)
        return out


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, rope: CosSin, attn: AttnFn) -> torch.Tensor:
        q, k, v = self.qkv(h, rope)
        return self.finish(h, attn(self.self_attn.layer_idx, q, k, v))

    def qkv(self, h: torch.Tensor, rope: CosSin, out: QKV | None = None) -> QKV:
        """The first half of the layer, up to attention."""
        return self.self_attn.qkv(self.input_layernorm(h), rope, out)

    def finish(
        self, h: torch.Tensor, attn_out: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The second half: output projection, residuals and MLP; ``out`` may alias ``h``."""
        h = h + self.self_attn.o_proj(attn_out.reshape(h.shape[0], -1))
        return torch.add(h, self.mlp(self.post_attention_layernorm(h)), out=out)


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)


class DecoderLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Backbone(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share lm_head with embed_tokens when the config says so; call again after assigning weights."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttnFn) -> torch.Tensor:
        """input_ids, positions: [T] long -> hidden states [T, hidden] before the final norm."""
        h = self.model.embed_tokens(input_ids)
        rope = self.model.rotary_emb(positions, h.dtype)
        for layer in self.model.layers:
            h = layer(h, rope, attn)
        return h

    def score_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """Final norm and lm_head on the given rows [R, hidden] only -> fp32 logits [R, vocab]."""
        return self.lm_head(self.model.norm(hidden_rows)).float()
