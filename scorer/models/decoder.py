"""Decoder-only LM (the Qwen3, Qwen2, Llama, Mistral, Gemma and Gemma 2 families) over a flat token
batch, with pluggable attention, and the LM head or a score head (``*ForSequenceClassification``).

Parameter names equal those of transformers' *ForCausalLM / *ForSequenceClassification, so HF
safetensors load as they are. The attention callable gets RoPE'd (and, for Qwen3, q/k-normed) heads
and applies the softmax scale (``config.attn_scale``), the logit soft-cap and whatever masking it
wants itself. Each layer is two halves around attention (``layer_qkv``
and ``layer_finish``), so that a graph runner can replay everything but attention (``graphs.py``).
The elementwise kernels are chosen when the model is built: ``kernels="torch"`` (HF's op order and
rounding), ``"flashinfer"`` (FlashInfer's fused norm, RoPE and SiLU-and-mul, ``fused.py``, with
gate and up as one GEMM) or ``"fused"`` (those, and q/k/v as one GEMM whose output one Triton
kernel turns into attention's inputs: per-head q/k norm, RoPE and the v copy, and on Hopper the
gate/up GEMM writing ``silu(g) * u`` itself, ``triton_ops.py``);
``finalize`` prepares the weights for them once they are assigned.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from scorer.config import ModelConfig
from scorer.models import fp8_kernels, fused, triton_ops
from scorer.models.rope import Rope, RotaryEmbedding

MODEL_KERNELS = ("torch", "flashinfer", "fused")

AttnFn = Callable[..., torch.Tensor]
"""attn(layer_idx, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], out=None) -> out [T, Hq, D]."""
QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    """Llama's RMSNorm (``weight * x_normed`` rounded to x's dtype first), or with ``gemma`` Gemma's
    (``x_normed * (1 + weight)`` in fp32, then rounded)."""

    def __init__(self, dim: int, eps: float, fused: bool = False, gemma: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = fused
        self.gemma = gemma
        self.triton = False  # Triton's many-rows kernel instead of FlashInfer's (``DecoderLM.triton_norm``)
        self.quantize = False  # written in FP8 for the FP8 linears that read it (``quant.quantize_model``)

    def forward(
        self, x: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor | fp8_kernels.Quantized:
        if self.quantize:
            return fp8_kernels.rms_norm_quant(x, self.weight, self.eps)
        if self.fused and self.triton:  # its torch statement on the CPU
            return triton_ops.rms_norm(x, self.weight, self.eps, out)
        if self.fused:
            return fused.rms_norm(x, self.weight, self.eps, out)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        y = (x32 * (1.0 + self.weight.float())).to(x.dtype) if self.gemma else self.weight * x32.to(x.dtype)
        return y if out is None else out.copy_(y)


class Attention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, fused: bool = False, one_gemm: bool = False
    ) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.one_gemm = one_gemm  # q/k/v as one GEMM and the Triton kernel (after merge_qkv)
        self.in_place = True  # that kernel on the GEMM's output in place (``DecoderLM.qkv_in_place``)
        self.qkv_proj: tuple[torch.Tensor, torch.Tensor | None] | nn.Module | None = None  # or FP8's
        hidden, bias = config.hidden_size, config.attention_bias
        q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(hidden, q_size, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_size, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_size, bias=bias)
        self.o_proj = nn.Linear(q_size, hidden, bias=bias if config.o_bias is None else config.o_bias)
        self.qk_norm = config.qk_norm
        if self.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, fused, config.gemma)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, fused, config.gemma)

    def merge_qkv(self) -> None:
        """One GEMM for q, k and v: their weights become views of one tensor."""
        self.qkv_proj = _merge(self.q_proj, self.k_proj, self.v_proj)

    def qkv(self, x: torch.Tensor, rope: Rope, out: QKV | torch.Tensor | None = None) -> QKV:
        """RoPE'd (and q/k-normed) heads of x [T, hidden]; written into ``out`` when given. After
        ``merge_qkv``, ``out`` may instead be one ``[T, (Hq + 2 Hkv) D]`` buffer: the GEMM writes
        it, q and k are normed and rotated in place, and the heads returned are views of it
        (``in_place``, also without ``out``; else q, k and v are written into ``out``'s three)."""
        T = x.shape[0]
        if self.qkv_proj is not None:
            hq, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
            buf = out if isinstance(out, torch.Tensor) else None
            if isinstance(self.qkv_proj, nn.Module):  # FP8 (``quant.quantize_model``)
                qkv = self.qkv_proj(x, out=buf)
            else:
                w, b = self.qkv_proj
                if buf is None:
                    qkv = F.linear(x, w, b)
                else:
                    qkv = torch.mm(x, w.t(), out=buf) if b is None else torch.addmm(b, x, w.t(), out=buf)
            if out is None and not self.in_place:
                out = (qkv.new_empty(T, hq, d), qkv.new_empty(T, hkv, d), qkv.new_empty(T, hkv, d))
            qo, ko, vo = out if isinstance(out, tuple) else (*triton_ops.qkv_views(qkv, hq, hkv, d)[:2], None)
            norms = (
                (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
                if self.qk_norm
                else (None, None, 0.0)
            )
            return triton_ops.qk_norm_rope(
                qkv, *norms, rope.positions, rope.cache, hq, hkv, d, qo, ko, vo,
            )  # fmt: skip
        q = self.q_proj(x).view(T, -1, self.head_dim)
        k = self.k_proj(x).view(T, -1, self.head_dim)
        v = self.v_proj(x).view(T, -1, self.head_dim)
        qo, ko, vo = out or (None, None, None)
        if self.qk_norm and self.q_norm.fused:  # the norms write where the fused RoPE rotates in place
            q, k = self.q_norm(q, qo), self.k_norm(k, ko)
        elif self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope.apply(q, k, out=None if out is None else (qo, ko))
        return q, k, (v if vo is None else vo.copy_(v))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_proj = nn.Linear(hidden, inter, bias=bias)
        self.up_proj = nn.Linear(hidden, inter, bias=bias)
        self.down_proj = nn.Linear(inter, hidden, bias=bias)
        self.act_fn = ACTIVATIONS[config.hidden_act]
        self.gate_up: tuple[torch.Tensor, torch.Tensor | None] | nn.Module | None = None  # or FP8's
        self.swiglu_gemm = False  # ``DecoderLM.swiglu_gemm``
        self.quantize = False  # the FP8 gate/up writes its output in FP8 for an FP8 down projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP of x."""
        return self.down_proj(self.act(x))

    def act(self, x: torch.Tensor) -> torch.Tensor:
        """The down projection's input, ``act(gate(x)) * up(x)`` (merged, SiLU only: one GEMM, one
        kernel)."""
        if self.gate_up is None:
            return self.act_fn(self.gate_proj(x)) * self.up_proj(x)
        if isinstance(self.gate_up, nn.Module):  # FP8; an FP8 down GEMM's input quantized as it is made
            fp8 = self.gate_up
            if isinstance(x, fp8_kernels.Quantized) and self._one_gemm(x.q, fp8.weight, fp8.bias):
                act = triton_ops.gate_up_silu(x.q, fp8.weight, x_scale=x.scale, w_scale=fp8.weight_scale)
                return fp8_kernels.quantize(act) if self.quantize else act
            return fp8_kernels.silu_mul_quant(fp8(x)) if self.quantize else fused.silu_and_mul(fp8(x))
        w, b = self.gate_up
        if self._one_gemm(x, w, b):
            return triton_ops.gate_up_silu(x, w)
        return fused.silu_and_mul(F.linear(x, w, b))

    def _one_gemm(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
        """Does Triton's gate/up + SiLU GEMM take ``x`` [T, H] by the merged ``w`` (bf16 or FP8)?"""
        return (
            self.swiglu_gemm
            and b is None
            and x.shape[0] >= triton_ops.SWIGLU_MIN_ROWS
            and triton_ops.gate_up_silu_supported(x, w)
        )

    def merge_gate_up(self) -> None:
        """One GEMM for gate and up: their weights become views of one tensor."""
        self.gate_up = _merge(self.gate_proj, self.up_proj)


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_idx: int, fused: bool = False, one_gemm: bool = False
    ) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx, fused, one_gemm)
        self.mlp = MLP(config, fused)
        norm = partial(RMSNorm, config.hidden_size, config.rms_norm_eps, fused, config.gemma)
        self.input_layernorm = norm()
        self.post_attention_layernorm = norm()
        self.sandwich = config.sandwich_norms
        if self.sandwich:  # Gemma 2: post_attention_layernorm norms attention's output instead
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.residual_in_gemm = fused  # ``DecoderLM.residual_in_gemm``
        self.residual_in_norm = False  # ``defers_residual``; set by ``quant.quantize_model``

    def qkv(
        self,
        h: torch.Tensor,
        rope: Rope,
        out: QKV | torch.Tensor | None = None,
        pending: torch.Tensor | None = None,
    ) -> QKV:
        """The first half of the layer, up to attention. ``pending``: the previous layer's MLP
        output, not yet added to ``h`` (``finish(defer=True)``): the input norm adds it first."""
        x = self.input_layernorm(h) if pending is None else _add_norm(pending, h, self.input_layernorm)
        return self.self_attn.qkv(x, rope, out)

    @property
    def defers_residual(self) -> bool:
        """Can this layer's MLP output be left for the next layer's input norm to add (``finish``'s
        ``defer``)? With the FP8 fused path (``quant.quantize_model``): the next norm's kernel then
        adds it as it reads ``h`` (the same bf16 sum), and the add's own kernel, which read ``h``
        and the MLP output and wrote ``h`` again, is gone."""
        return self.residual_in_norm and not self.residual_in_gemm and not self.sandwich

    def finish(
        self,
        h: torch.Tensor,
        attn_out: torch.Tensor,
        out: torch.Tensor | None = None,
        defer: bool = False,
    ) -> torch.Tensor:
        """The second half: output projection, residuals and MLP; ``out`` may alias ``h``. The
        first residual add updates ``h`` in place (the second too with ``residual_in_gemm``). With
        ``defer`` (``defers_residual``) the MLP's output is returned, not added to ``h``."""
        if self.residual_in_gemm:
            _gemm_add_(h, attn_out.reshape(h.shape[0], -1), self.self_attn.o_proj)
            _gemm_add_(h, self.mlp.act(self.post_attention_layernorm(h)), self.mlp.down_proj)
            return h if out is None or out is h else out.copy_(h)
        o = self.self_attn.o_proj(attn_out.reshape(h.shape[0], -1))
        if self.sandwich:
            h.add_(self.post_attention_layernorm(o))
            x = self.mlp(self.pre_feedforward_layernorm(h))
            return torch.add(h, self.post_feedforward_layernorm(x), out=out)
        x = self.mlp(_add_norm(o, h, self.post_attention_layernorm))
        return x if defer else torch.add(h, x, out=out)


class Backbone(nn.Module):
    def __init__(self, config: ModelConfig, fused: bool = False, one_gemm: bool = False) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, fused, one_gemm) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, fused, config.gemma)
        self.rotary_emb = RotaryEmbedding(config)


class DecoderLM(nn.Module):
    """``kernels``: the elementwise kernels, ``torch``, ``flashinfer`` (CUDA, fp16/bf16: RMSNorm,
    RoPE from an fp32 cos|sin cache, SiLU-and-mul, gate/up as one GEMM and the residual adds in the
    output and down GEMMs, ``residual_in_gemm``) or ``fused`` (``flashinfer``, with q/k/v as one
    GEMM and Triton's q/k norm + RoPE kernel, hidden-state norms and gate/up + SiLU GEMM). Call
    ``finalize`` once the weights are assigned."""

    def __init__(self, config: ModelConfig, kernels: str = "torch") -> None:
        super().__init__()
        if kernels not in MODEL_KERNELS:
            raise ValueError(f"unknown model kernels {kernels!r}; expected one of {', '.join(MODEL_KERNELS)}")
        if kernels != "torch" and not config.plain_kernels:
            raise ValueError(
                f"{config.architecture} runs on the torch kernels only (FlashInfer's and Triton's fused"
                f" ones do SiLU and Llama's RMSNorm, not its {_differences(config)}); use --model-kernels"
                " auto or torch"
            )
        self.config = config
        self.kernels = kernels
        self.model = Backbone(config, self.fused, one_gemm=kernels == "fused")
        if config.num_labels:  # a score head; no LM head
            self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        self.triton_norm = kernels == "fused"
        self.swiglu_gemm = kernels == "fused"

    @property
    def fused(self) -> bool:
        """FlashInfer's norms, RoPE cache and SiLU-and-mul (``flashinfer`` and ``fused``)."""
        return self.kernels != "torch"

    @property
    def residual_in_gemm(self) -> bool:
        """Do the output and down projections add their product to the residual stream in the
        GEMM (cuBLAS's ``beta = 1``: ``h += x @ W.T``, rounded once), the norms then reading the
        sum? The default with FlashInfer's kernels (4 KB a token a layer less traffic than the
        post-attention add fused into its norm and the MLP's added alone; 0.5-1.4% more docs/s on the
        H200); settable (benchmarks)."""
        return all(layer.residual_in_gemm for layer in self.model.layers)

    @residual_in_gemm.setter
    def residual_in_gemm(self, value: bool) -> None:
        if value and not self.fused:
            raise ValueError(
                "the residual in the GEMM needs the merged gate/up (flashinfer or fused kernels)"
            )
        for layer in self.model.layers:
            layer.residual_in_gemm = value

    @property
    def qkv_in_place(self) -> bool:
        """Do q, k and v stay where the one QKV GEMM wrote them (``kernels="fused"``), q and k
        normed and rotated in place, v never copied? Attention then reads strided heads: 4 KB a
        token a layer less traffic on Qwen3-0.6B. Settable before graphs are built (benchmarks)."""
        return self.kernels == "fused" and all(layer.self_attn.in_place for layer in self.model.layers)

    @qkv_in_place.setter
    def qkv_in_place(self, value: bool) -> None:
        for layer in self.model.layers:
            layer.self_attn.in_place = value

    @property
    def swiglu_gemm(self) -> bool:
        """Does the MLP's gate/up GEMM write ``silu(gate) * up`` itself (Triton's ``gate_up_silu``,
        on Hopper, for passes of at least ``triton_ops.SWIGLU_MIN_ROWS`` rows; else cuBLAS's GEMM
        into [T, 2I] and FlashInfer's SiLU-and-mul)? The default with ``kernels="fused"``.
        Settable before graphs are built (benchmarks)."""
        return all(layer.mlp.swiglu_gemm for layer in self.model.layers)

    @swiglu_gemm.setter
    def swiglu_gemm(self, value: bool) -> None:
        for layer in self.model.layers:
            layer.mlp.swiglu_gemm = value

    @property
    def triton_norm(self) -> bool:
        """Do the hidden-state norms run Triton's ``rms_norm`` (several rows a program) instead of
        FlashInfer's (a block a row)? The default with ``kernels="fused"``; the same fp32
        arithmetic and one rounding. Settable before graphs are built (benchmarks)."""
        return all(n.triton for n in self._hidden_norms())

    @triton_norm.setter
    def triton_norm(self, value: bool) -> None:
        for n in self._hidden_norms():
            n.triton = value

    def _hidden_norms(self) -> list[RMSNorm]:
        layers = self.model.layers
        return [
            self.model.norm,
            *(n for x in layers for n in (x.input_layernorm, x.post_attention_layernorm)),
        ]

    @property
    def num_layers(self) -> int:
        return len(self.model.layers)

    def tie_weights(self) -> None:
        """Share lm_head with embed_tokens when the config says so."""
        if self.config.tie_word_embeddings and not self.config.num_labels:
            self.lm_head.weight = self.model.embed_tokens.weight

    def finalize(self) -> DecoderLM:
        """After the weights are assigned: tie lm_head, and for the fused kernels merge gate/up and
        build the RoPE cache on the weights' device. Returns the model."""
        self.tie_weights()
        if self.fused:
            for layer in self.model.layers:
                layer.mlp.merge_gate_up()
                if layer.self_attn.one_gemm:
                    layer.self_attn.merge_qkv()
            self.model.rotary_emb.use_fused(self.model.embed_tokens.weight.device)
        return self

    @property
    def uses_rope_cache(self) -> bool:
        """RoPE reads positions and a cache (nothing to compute per forward), not HF's tables."""
        return self.model.rotary_emb.cos_sin_cache is not None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        if self.config.gemma:  # sqrt(hidden) rounded to the weights' dtype first, as transformers does
            h = h * torch.tensor(self.config.hidden_size**0.5).to(h.dtype)
        return h

    def rope(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """The rotation of token positions [T], once per forward pass."""
        return self.model.rotary_emb(positions, dtype)

    def layer_qkv(self, i: int, h: torch.Tensor, rope: Rope, out: QKV | torch.Tensor | None = None) -> QKV:
        """Layer ``i`` up to attention: its RoPE'd heads (into ``out`` when given: three buffers,
        or with ``qkv_in_place`` the one the QKV GEMM writes, ``Attention.qkv``)."""
        return self.model.layers[i].qkv(h, rope, out)

    def layer_finish(
        self, i: int, h: torch.Tensor, attn_out: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Layer ``i`` after attention: output projection, residuals, MLP; ``out`` may alias ``h``."""
        return self.model.layers[i].finish(h, attn_out, out)

    def layer_next(
        self,
        i: int,
        h: torch.Tensor,
        attn_out: torch.Tensor,
        rope: Rope,
        out: QKV | torch.Tensor | None = None,
    ) -> QKV:
        """Layer ``i`` after attention, ``h`` updated in place, then layer ``i + 1`` up to attention
        (``layer_qkv``); the MLP's residual add inside the next input norm where the layer
        ``defers_residual``."""
        layer, nxt = self.model.layers[i], self.model.layers[i + 1]
        if layer.defers_residual:
            return nxt.qkv(h, rope, out, pending=layer.finish(h, attn_out, defer=True))
        layer.finish(h, attn_out, out=h)
        return nxt.qkv(h, rope, out)

    @property
    def residual_in_norm(self) -> bool:
        """Does each layer's MLP output reach the residual stream in the next layer's input norm
        (``DecoderLayer.defers_residual``)? On with FP8's fused path; settable (benchmarks)."""
        return all(layer.residual_in_norm for layer in self.model.layers)

    @residual_in_norm.setter
    def residual_in_norm(self, value: bool) -> None:
        for layer in self.model.layers:
            layer.residual_in_norm = value

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttnFn) -> torch.Tensor:
        """input_ids, positions: [T] long -> hidden states [T, hidden] before the final norm."""
        h = self.embed(input_ids)
        rope = self.rope(positions, h.dtype)
        heads = self.layer_qkv(0, h, rope)
        for i in range(self.num_layers - 1):
            heads = self.layer_next(i, h, attn(i, *heads), rope)
        return self.layer_finish(self.num_layers - 1, h, attn(self.num_layers - 1, *heads))

    def score_logits(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        """Final norm and the head on the given rows [R, hidden] only -> fp32 logits [R, vocab] of
        the LM head (soft-capped where the config says so), or [R, num_labels] of a score head."""
        x = self.model.norm(hidden_rows)
        if self.config.num_labels:
            return self.score(x).float()
        logits = self.lm_head(x).float()
        cap = self.config.final_soft_cap
        return torch.tanh(logits / cap) * cap if cap else logits


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
}


def _differences(config: ModelConfig) -> str:
    """What keeps a model off the fused kernels, in words."""
    parts = [f"{config.hidden_act} MLP"] if config.hidden_act != "silu" else []
    parts += ["RMSNorm of 1 + weight"] if config.gemma else []
    parts += ["norms around attention's and the MLP's outputs"] if config.sandwich_norms else []
    return ", ".join(parts)


def _add_norm(x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """``residual += x`` in place, then ``norm(residual)``, written over ``x`` and returned (or in
    FP8, ``RMSNorm.quantize``)."""
    if norm.quantize:
        return fp8_kernels.rms_norm_quant(x, norm.weight, norm.eps, residual)
    if norm.fused:
        return fused.add_rms_norm_(x, residual, norm.weight, norm.eps)
    residual.add_(x)
    return norm(residual, out=x)


def _gemm_add_(h: torch.Tensor, x: torch.Tensor, linear: nn.Linear) -> None:
    """``h += linear(x)`` in place, the add in the GEMM's epilogue."""
    h.addmm_(x, linear.weight.t())
    if linear.bias is not None:
        h.add_(linear.bias)


def _merge(*linears: nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One weight (and bias) for several Linear layers of the same input, concatenated by output;
    each layer's parameters become views of it (so a state dict still reads as HF's)."""
    merged = []
    for name in ("weight", "bias"):
        parts = [getattr(lin, name) for lin in linears]
        if parts[0] is None:
            merged.append(None)
            continue
        both = torch.cat(parts)
        at = 0
        for lin, part in zip(linears, parts, strict=True):
            setattr(lin, name, nn.Parameter(both[at : at + len(part)], requires_grad=False))
            at += len(part)
        merged.append(both)
    return merged[0], merged[1]
