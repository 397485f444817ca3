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

The linears run one by one (``quantize_model`` undoes the fused kernels' merged QKV and gate/up
GEMMs, Triton's gate/up + SiLU GEMM and the residual adds in the output and down GEMMs, which read
bf16 weights); the norms, RoPE, SiLU-and-mul and the graphs stay as the kernels chose.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_AMAX = 1e-12
"""A row whose absmax is below this (all zeros: padding rows of a graph bucket) gets the scale of
this absmax, so its quantized values are finite (zero)."""
ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` [M, K] in FP8 with a scale of its own: ``(q [M, K] e4m3, scale [M, 1]
    fp32)`` with ``x ~= q * scale``, ``scale = absmax / 448``. The absmax is exact in ``x``'s dtype
    and the division is in fp32, so the CPU and the GPU give the same bits for the same ``x``."""
    amax = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True, dtype=torch.float32)
    scale = amax.clamp(min=MIN_AMAX) / FP8_MAX
    # bf16 / fp32 divides in fp32 (one temporary). No clamp: the row's largest lands within a few
    # ulps of 448, which rounds to 448 (a value would need 464 to round past it)
    q = (x / scale).to(FP8)
    return q, scale


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
            self._x, self._q, self._readers = x, quantize_rows(rows), set()
        q = self._q
        self._readers.add(id(reader))
        if len(self._readers) == self.size:
            self._x = self._q = None
        return q


class Fp8Linear(nn.Module):
    """``y = x @ W.T + b`` with ``W`` [N, K] in FP8 and one fp32 scale per output channel, and ``x``
    quantized per token at every call. The weight and its scales are buffers (``weight``,
    ``weight_scale`` [N], compressed-tensors' names), not parameters: nothing casts them."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if weight.dtype != FP8 or weight.dim() != 2:
            raise ValueError(f"an FP8 weight is a 2-D {FP8} tensor, not {weight.dtype} {list(weight.shape)}")
        n, k = weight.shape
        if weight.is_cuda and (n % 16 or k % 16):
            raise ValueError(
                f"FP8 GEMMs on CUDA need both sides of the weight multiples of 16, not {n} x {k}"
            )
        self.out_features, self.in_features = n, k
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("weight_scale", weight_scale.reshape(1, n).float().contiguous())
        self.bias = bias
        self.shared: SharedInput | None = (
            None  # the input quantization this linear shares (``quantize_model``)
        )

    @classmethod
    def quantize(cls, linear: nn.Linear) -> Fp8Linear:
        """The FP8 form of ``linear``: its weight quantized per output channel."""
        q, scale = quantize_rows(linear.weight.detach())
        return cls(q, scale, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        rows = x.reshape(-1, self.in_features)
        qx, sx = quantize_rows(rows) if self.shared is None else self.shared(self, x, rows)
        if x.is_cuda:
            y = torch._scaled_mm(
                qx, self.weight.t(), scale_a=sx, scale_b=self.weight_scale, out_dtype=torch.bfloat16
            ).to(x.dtype)
        else:
            y = reference_mm(qx, sx, self.weight, self.weight_scale).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def reference_mm(qx: torch.Tensor, sx: torch.Tensor, qw: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """The CPU reference of the FP8 GEMM: ``x`` and ``W`` dequantized, multiplied in fp32 ([M, N])."""
    return dequantize(qx, sx) @ dequantize(qw, sw.reshape(-1, 1)).t()


def quantize_model(
    model: nn.Module, prequantized: Mapping[str, tuple[torch.Tensor, torch.Tensor]] | None = None
) -> None:
    """Turn the decoder's linears into ``Fp8Linear``, in place, after ``DecoderLM.finalize``:
    ``prequantized`` maps a linear's name (``model.layers.0.self_attn.q_proj``) to its FP8 weight
    and per-channel scales from the checkpoint; every other linear is quantized from its weight.
    q, k and v share one quantization of their input, gate and up another (``SharedInput``). The
    fused kernels' merged GEMMs, which read the bf16 weights, are switched off (see the module)."""
    dev = model.lm_head.weight.device
    if problem := scaled_mm_supported(dev):
        raise ValueError(problem)
    for i, layer in enumerate(model.model.layers):
        for owner, part, names in (
            (layer.self_attn, "self_attn", ATTENTION_LINEARS),
            (layer.mlp, "mlp", MLP_LINEARS),
        ):
            for name in names:
                linear = getattr(owner, name)
                given = (prequantized or {}).get(f"model.layers.{i}.{part}.{name}")
                if given is None:
                    fp8 = Fp8Linear.quantize(linear)
                else:
                    fp8 = Fp8Linear(given[0].to(dev), given[1].to(dev), linear.bias)
                setattr(owner, name, fp8)
        for group in (
            [getattr(layer.self_attn, n) for n in ATTENTION_LINEARS[:3]],
            [getattr(layer.mlp, n) for n in MLP_LINEARS[:2]],
        ):
            shared = SharedInput(len(group))
            for linear in group:
                linear.shared = shared
        layer.self_attn.qkv_proj = None
        layer.mlp.gate_up = None
    model.qkv_in_place = False
    model.swiglu_gemm = False
    model.residual_in_gemm = False
