"""FP8 (e4m3) linear layers of the decoder: ``--quantization fp8``.

The seven linears of every layer (q/k/v/o, gate/up/down) become ``Fp8Linear``: the weight in FP8
with one fp32 scale per output channel (its row's absmax / 448, computed at load from the
checkpoint's weights, or read from a pre-quantized checkpoint, ``fp8_checkpoint.py``), and each
call's activations quantized per token (row) the same way, on the device, inside the CUDA graphs
(no ``.item()``). The LM head, the embeddings and the norms stay in the model's dtype, and so does
attention (FlashInfer's FP8 attention cannot take multi-item scoring's parameters).

On CUDA the product is ``torch._scaled_mm`` with rowwise scales (``scale_a`` [M, 1], ``scale_b``
[1, N], bf16 out; the weight column-major as ``[N, K]``'s transpose; K and N multiples of 16; SM
8.9+). Elsewhere it is the reference: the same FP8 values and scales, dequantized and multiplied
in fp32. Both quantize with ``quantize_rows``, so the CPU reference sees the FP8 values the GPU
multiplies.

With the fused kernels on CUDA the merged QKV and gate/up GEMMs stay merged (FP8 weights side by
side), and their inputs arrive in FP8 from the kernels that make them (``fp8_kernels``: the
hidden-state norms, SiLU-and-mul); Triton's bf16 gate/up + SiLU GEMM and the residual adds in the
output and down GEMMs give way. Elsewhere (the torch kernels, the CPU) the linears run one by one.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from scorer.models import fp8_kernels
from scorer.models.fp8_kernels import FP8, Quantized, quantize_rows

ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
UNITS = (ATTENTION_LINEARS[:3], ATTENTION_LINEARS[3:], MLP_LINEARS[:2], MLP_LINEARS[2:])
"""The linears of a layer that run in one precision together: q, k and v read one input, and so do
gate and up (one GEMM each on the fused path)."""


def whole_units(modules: set[str]) -> set[str]:
    """The decoder linears of ``modules`` (``model.layers.0.self_attn.q_proj``) whose unit
    (``UNITS``) is all in ``modules``."""
    whole = set()
    for module in modules:
        parent, _, name = module.rpartition(".")
        unit = next(u for u in UNITS if name in u)
        if all(f"{parent}.{n}" in modules for n in unit):
            whole.add(module)
    return whole


def _quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows``: on CUDA in one Triton kernel (``fp8_kernels.quantize``), the same bits."""
    return fp8_kernels.quantize(rows) if rows.is_cuda else quantize_rows(rows)


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``q * scale`` (``scale`` broadcast over ``q``'s rows: [M, 1] or [1, N] for [N, K]'s rows)."""
    return q.float() * scale.float()


def scaled_mm_supported(device: torch.device) -> str | None:
    """What keeps ``torch._scaled_mm``'s rowwise FP8 GEMM from running on ``device``, or None."""
    if device.type != "cuda":
        return None  # the fp32 reference runs
    if torch.cuda.get_device_capability(device) < (8, 9):
        name = torch.cuda.get_device_name(device)
        return f"FP8 GEMMs need a GPU of compute capability 8.9 or later (Ada, Hopper); {name} is not"
    return None


class SharedInput:
    """One quantization of an input that several linears read one after another (q, k and v;
    gate and up read the same tensor): the first of them to see ``x`` quantizes it, each other one
    called on the same tensor object reuses that, and once every linear of the group has read it
    it is let go. A linear called twice gets a fresh quantization, so nothing serves a tensor
    changed in place since (the decoder calls a group's linears on consecutive lines)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._x: torch.Tensor | None = None
        self._q: tuple[torch.Tensor, torch.Tensor] | None = None
        self._readers: set[int] = set()

    def __call__(
        self, reader: nn.Module, x: torch.Tensor, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows``: ``x`` as [M, K]."""
        if self._x is not x or id(reader) in self._readers:
            self._x, self._q, self._readers = x, _quantize(rows), set()
        q = self._q
        self._readers.add(id(reader))
        if len(self._readers) == self.size:
            self._x = self._q = None
        return q


class Fp8Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` [N, K] in FP8 and one fp32 scale per output channel, and ``x``
    quantized per token at every call, or given quantized (``Quantized``: by the kernel that made
    it, ``fp8_kernels``). The weight and its scales are buffers (``weight``, ``weight_scale`` [N],
    compressed-tensors' names), not parameters: nothing casts them. ``out_dtype``: the product's."""

    def __init__(
        self,
        weight: torch.Tensor,
        weight_scale: torch.Tensor,
        bias: torch.Tensor | None,
        out_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        if weight.dtype != FP8 or weight.dim() != 2:
            raise ValueError(f"an FP8 weight is a 2-D {FP8} tensor, not {weight.dtype} {list(weight.shape)}")
        n, k = weight.shape
        if weight.is_cuda and (n % 16 or k % 16):
            raise ValueError(
                f"FP8 GEMMs on CUDA need both sides of the weight multiples of 16, not {n} x {k}"
            )
        self.out_features, self.in_features = n, k
        self.out_dtype = out_dtype
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale", weight_scale.reshape(1, n).float().contiguous())
        self.bias = bias
        self.shared: SharedInput | None = (
            None  # the input quantization this linear shares (``quantize_model``)
        )

    @classmethod
    def quantize(cls, linear: nn.Linear, out_dtype: torch.dtype | None = None) -> Fp8Linear:
        """The FP8 form of ``linear``: its weight quantized per output channel."""
        q, scale = quantize_rows(linear.weight.detach())
        return cls(q, scale, linear.bias, out_dtype or linear.weight.dtype)

    @classmethod
    def merge(cls, *linears: Fp8Linear) -> Fp8Linear:
        """One FP8 linear for several of the same input, their outputs side by side (q|k|v,
        gate|up): per-channel scales make it their concatenation. Each part's weight and scales
        become views of the merged ones (named as before, stored once)."""
        weight = torch.cat([lin.weight.view(torch.uint8) for lin in linears]).view(FP8)
        scale = torch.cat([lin.weight_scale for lin in linears], dim=1)
        biases = [lin.bias for lin in linears]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat(
                [b if b is not None else lin.weight_scale.new_zeros(lin.out_features, dtype=lin.out_dtype)
                 for b, lin in zip(biases, linears, strict=True)]
            )  # fmt: skip
        merged = cls(weight, scale, bias, linears[0].out_dtype)
        at = 0
        for lin in linears:
            n = lin.out_features
            lin.weight, lin.weight_scale = merged.weight[at : at + n], merged.weight_scale[:, at : at + n]
            at += n
        return merged

    def forward(self, x: torch.Tensor | Quantized, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [..., K] (or quantized [M, K]) -> [..., N], written into ``out`` [M, N] if given."""
        if isinstance(x, Quantized):
            lead, (qx, sx) = x.q.shape[:-1], x
        else:
            lead = x.shape[:-1]
            rows = x.reshape(-1, self.in_features)
            qx, sx = _quantize(rows) if self.shared is None else self.shared(self, x, rows)
        if qx.is_cuda:
            kw = {} if out is None else {"out": out}
            y = torch._scaled_mm(
                qx, self.weight.t(), scale_a=sx, scale_b=self.weight_scale, out_dtype=self.out_dtype, **kw
            )
        else:
            y = reference_mm(qx, sx, self.weight, self.weight_scale).to(self.out_dtype)
            y = y if out is None else out.copy_(y)
        if self.bias is not None:
            y.add_(self.bias)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def reference_mm(qx: torch.Tensor, sx: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """The CPU reference of the FP8 GEMM: ``x`` and ``W`` dequantized, multiplied in fp32 ([M, N])."""
    return dequantize(qx, sx) @ dequantize(qw, sw.reshape(-1, 1)).t()


def quantize_model(
    model: nn.Module,
    prequantized: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
    fused: bool | None = None,
) -> None:
    """Turn the decoder's linears into ``Fp8Linear``, in place, after ``DecoderLM.finalize``:
    every one quantized from its weight, or with ``prequantized`` (a pre-quantized checkpoint's
    FP8 linears by name, ``model.layers.0.self_attn.q_proj``, as weight and per-channel scales)
    exactly those; the checkpoint's other linears were left unquantized when it was made (its
    ``ignore`` list) and stay in the model's dtype. ``prequantized`` holds whole ``UNITS``.

    With the fused kernels on CUDA (``fused_path``; ``fused`` overrides: the CPU tests run the
    kernels' torch statements that way) the merged QKV and gate/up GEMMs stay merged,
    in FP8, and their inputs come quantized from the kernels that make them: the hidden-state norms
    (``RMSNorm.quantize``, the post-attention one with the residual add) and SiLU-and-mul
    (``MLP.act``; with ``DecoderLM.swiglu_gemm``, Triton's gate/up + SiLU GEMM on the FP8 operands,
    then a quantization); only the attention output is quantized on its own, in one kernel. The
    MLP's residual add moves into the next layer's input norm (``DecoderLM.residual_in_norm``).
    Elsewhere q, k and v share one quantization of their input, gate and up another
    (``SharedInput``), and the gate/up + SiLU GEMM is off. Either way the residual adds in the
    output and down GEMMs, which read bf16 weights, give way."""
    dev = model.model.embed_tokens.weight.device
    dtype = model.model.embed_tokens.weight.dtype
    if problem := scaled_mm_supported(dev):
        raise ValueError(problem)
    if prequantized is not None and (part := set(prequantized) - whole_units(set(prequantized))):
        raise ValueError(f"FP8 linears without the rest of their unit: {', '.join(sorted(part))}")
    fused = fused_path(model) if fused is None else fused
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for owner, part, names in ((attn, "self_attn", ATTENTION_LINEARS), (mlp, "mlp", MLP_LINEARS)):
            for name in names:
                linear = getattr(owner, name)
                if prequantized is None:
                    setattr(owner, name, Fp8Linear.quantize(linear, dtype))
                elif (given := prequantized.get(f"model.layers.{i}.{part}.{name}")) is not None:
                    setattr(owner, name, Fp8Linear(given[0].to(dev), given[1].to(dev), linear.bias, dtype))
        qkv = [getattr(attn, n) for n in ATTENTION_LINEARS[:3]]
        gate_up = [getattr(mlp, n) for n in MLP_LINEARS[:2]]
        qkv_fp8, gate_up_fp8 = isinstance(qkv[0], Fp8Linear), isinstance(gate_up[0], Fp8Linear)
        if fused:  # a unit left in the model's dtype keeps its bf16 merge and kernels
            if qkv_fp8 and attn.qkv_proj is not None:
                attn.qkv_proj = Fp8Linear.merge(*qkv)
            if gate_up_fp8:
                mlp.gate_up = Fp8Linear.merge(*gate_up)
            layer.input_layernorm.quantize = qkv_fp8
            layer.post_attention_layernorm.quantize = gate_up_fp8
            mlp.quantize = isinstance(mlp.down_proj, Fp8Linear)
        else:
            for group in (g for g, fp8 in ((qkv, qkv_fp8), (gate_up, gate_up_fp8)) if fp8):
                shared = SharedInput(len(group))
                for linear in group:
                    linear.shared = shared
            attn.qkv_proj = None
            mlp.gate_up = None
    if not fused:
        model.qkv_in_place = False
        model.swiglu_gemm = False
    model.residual_in_gemm = False
    model.residual_in_norm = fused


def fused_path(model: nn.Module) -> bool:
    """Does ``quantize_model`` keep ``model``'s merged GEMMs and quantize in its kernels: FlashInfer's
    or the fused kernels (SiLU, Llama's norms, no sandwich norms), on CUDA?"""
    return model.fused and model.model.embed_tokens.weight.is_cuda
