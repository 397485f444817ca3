"""FP8 activations quantized where they are made: one Triton kernel each for the hidden-state
RMSNorm (and the residual add before it) writing FP8 and per-token scales for the QKV and gate/up
GEMMs, SiLU-and-mul writing the down GEMM's input in FP8, and a plain per-row quantization (the
attention output, for the output projection).

``quantize_rows`` is the definition, in torch: each row's absmax in fp32, ``scale = absmax / 448``
(a row of zeros gets ``MIN_AMAX``'s), ``q = x * (1 / scale)`` in fp32 rounded to e4m3. The kernels
compute their bf16 result as the unfused kernels would (fp32, rounded once to the activations'
dtype), then quantize that row exactly as ``quantize_rows`` does (the scale a product with
``INV_FP8_MAX``, its reciprocal an IEEE division, ``div_rn``, each value a product with that;
round to nearest even): on the same bf16 row they give the same bits, so the CPU reference
(``quant.py``) sees the FP8 values the GPU multiplies. A row is whole in one program's registers
(rows of up to ``MAX_WIDTH`` values; wider ones go to the torch path).

Without them each quantization is five eager kernels (absmax, clamp, two divisions, the cast) that
read the bf16 row twice; with them the norm and SiLU-and-mul kernels, which the bf16 path runs
anyway, write one byte a value instead of two, and the separate quantization is gone. CPU tensors
(and CUDA without Triton) take the torch statement of the same semantics.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from scorer.models.triton_ops import reference_path, rms_norm_reference, tl, triton

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
MIN_AMAX = 1e-12
"""A row whose absmax is below this (all zeros: padding rows of a graph bucket) gets the scale of
this absmax, so its quantized values are finite (zero)."""
INV_FP8_MAX = float(torch.tensor(1 / FP8_MAX, dtype=torch.float32))
"""1 / 448 in fp32, exactly: the scale is ``absmax * INV_FP8_MAX``, one fp32 product that every
device rounds alike (torch on CUDA divides by a Python scalar as a product with its reciprocal, on
the CPU it divides: an H100 and the CPU differed in the last bit of some scales)."""
MAX_WIDTH = 32768
"""The widest row a kernel holds whole (16 warps, 64 fp32 values a thread, twice that for
SiLU-and-mul's gate and up): Qwen3-32B's MLP is 25,600 wide."""


class Quantized(NamedTuple):
    """An activation in FP8: ``q`` [M, K] e4m3 and its per-row ``scale`` [M, 1] fp32,
    ``x ~= q * scale``. What the FP8 linears take instead of a bf16 tensor."""

    q: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x`` [M, K] in FP8 with a scale of its own: ``(q [M, K] e4m3, scale [M, 1]
    fp32)`` with ``x ~= q * scale``, ``scale = absmax / 448`` (as ``absmax * INV_FP8_MAX``). The
    absmax is exact in ``x``'s dtype and the product and division are single fp32 operations, so the
    CPU and the GPU give the same bits for the same ``x``."""
    amax = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True, dtype=torch.float32)
    scale = amax.clamp(min=MIN_AMAX) * INV_FP8_MAX
    # bf16 * fp32 multiplies in fp32 (one temporary), by the scale's reciprocal: one IEEE division a
    # row, not a value (the kernels' per-value division took 25% longer on an H100,
    # bench/RESULTS.md). No clamp: the row's largest lands within a few ulps of 448, which rounds to
    # 448 (a value would need 464 to round past it)
    q = (x * (1.0 / scale)).to(FP8)
    return q, scale


def quantize(x: torch.Tensor) -> Quantized:
    """``quantize_rows`` of ``x`` [M, K] (rows may be strided, the last dim contiguous)."""
    if reference_path(x) or x.shape[-1] > MAX_WIDTH:
        return Quantized(*quantize_rows(x))
    return _launch(_PLAIN, x, x.shape[-1])


def rms_norm_quant(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> Quantized:
    """RMSNorm of the rows of ``x`` [M, H] (``triton_ops.rms_norm``: fp32, rounded once to ``x``'s
    dtype), quantized per row. With ``residual`` [M, H]: first ``residual += x`` in place (in fp32,
    rounded to the dtype), then the norm of that sum (``x`` is left as it was)."""
    if reference_path(x) or x.shape[-1] > MAX_WIDTH:
        if residual is not None:
            residual.add_(x)
            x = residual
        return Quantized(*quantize_rows(rms_norm_reference(x, weight, eps)))
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"rms_norm_quant needs a weight of [{x.shape[-1]}], got {list(weight.shape)}")
    return _launch(_NORM if residual is None else _ADD_NORM, x, x.shape[-1], weight, eps, residual)


def silu_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` of ``gate_up`` [M, 2I] (gate columns, then up) in fp32, rounded once."""
    g, u = gate_up.float().chunk(2, dim=-1)
    return (g / (1.0 + torch.exp(-g)) * u).to(gate_up.dtype)


def silu_mul_quant(gate_up: torch.Tensor) -> Quantized:
    """``silu(g) * u`` of ``gate_up`` [M, 2I] (the merged gate/up GEMM's output) quantized per row:
    the down projection's input, without its bf16 [M, I] written and read again."""
    width = gate_up.shape[-1] // 2
    if reference_path(gate_up) or width > MAX_WIDTH:
        return Quantized(*quantize_rows(silu_mul_reference(gate_up)))
    return _launch(_SILU, gate_up, width)


_PLAIN, _NORM, _ADD_NORM, _SILU = range(4)


def row_config(width: int, mode: int) -> tuple[int, int]:
    """(rows a program, num_warps): ~4k values a program in 4 warps (8 rows of Qwen3-0.6B's 1,024),
    a wider row alone with up to 16 warps, so that a thread holds at most 64 of a tensor's values
    (the bf16 ``rms_norm``'s measured rule: more spilled)."""
    block = triton.next_power_of_2(width) * (2 if mode == _SILU else 1)
    return max(1, 4096 // block), min(16, max(4, block // 1024))


def _launch(
    mode: int,
    x: torch.Tensor,
    width: int,
    weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    config: tuple[int, int] | None = None,
) -> Quantized:
    """One ``_quant_kernel`` over ``x``'s rows; ``config`` (rows a program, num_warps) overrides
    ``row_config`` (``bench.fp8_quant`` sweeps it)."""
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    q = torch.empty(rows, width, dtype=FP8, device=x.device)
    scale = torch.empty(rows, 1, dtype=torch.float32, device=x.device)
    r2 = x2 if residual is None else residual.view(-1, width)
    if x2.stride(-1) != 1 or r2.stride(-1) != 1 or (residual is not None and r2.shape != x2.shape):
        raise ValueError(f"FP8 quantization needs rows with a contiguous last dim, got {tuple(x.shape)}")
    if rows:
        block_rows, num_warps = config or row_config(width, mode)
        _quant_kernel[(triton.cdiv(rows, block_rows),)](
            x2, r2, x2 if weight is None else weight, q, scale, rows, x2.stride(0), r2.stride(0), float(eps),
            N=width, BLOCK_N=triton.next_power_of_2(width), BLOCK_ROWS=block_rows, MODE=mode,
            INV_FP8_MAX=INV_FP8_MAX, MIN_AMAX=MIN_AMAX, num_warps=num_warps,
        )  # fmt: skip
    return Quantized(q, scale)


if triton is not None:

    @triton.jit(do_not_specialize=["n_rows"])
    def _quant_kernel(
        x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, n_rows, stride_x, stride_r, eps,
        N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_ROWS: tl.constexpr, MODE: tl.constexpr,
        INV_FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
    ):  # fmt: skip
        """One program per BLOCK_ROWS rows, each whole in registers: the row's value in the
        activations' dtype (MODE: as it is; RMSNorm; residual add then RMSNorm; SiLU(gate) * up),
        then its absmax, scale and FP8 values."""
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.arange(0, BLOCK_N)
        row_ok = rows < n_rows
        ok = row_ok[:, None] & (cols < N)[None, :]
        r64 = rows.to(tl.int64)[:, None]
        src = x_ptr + r64 * stride_x + cols[None, :]
        x = tl.load(src, mask=ok, other=0.0)
        dtype = x.dtype
        if MODE == 3:  # SiLU-and-mul: gate columns [0, N), up columns [N, 2N)
            g = x.to(tl.float32)
            u = tl.load(src + N, mask=ok, other=0.0).to(tl.float32)
            y = (tl.fdiv(g, 1.0 + tl.exp(-g), ieee_rounding=False) * u).to(dtype).to(tl.float32)
        elif MODE == 0:
            y = x.to(tl.float32)
        else:
            if MODE == 2:  # the residual stream += x, stored, and normed
                res = r_ptr + r64 * stride_r + cols[None, :]
                h = (tl.load(res, mask=ok, other=0.0).to(tl.float32) + x.to(tl.float32)).to(dtype)
                tl.store(res, h, mask=ok)
                x = h
            x32 = x.to(tl.float32)
            rstd = tl.rsqrt(tl.sum(x32 * x32, axis=1) / N + eps)
            w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
            y = (x32 * rstd[:, None] * w[None, :]).to(dtype).to(tl.float32)
        amax = tl.max(tl.abs(y), axis=1)
        scale = tl.maximum(amax, MIN_AMAX) * INV_FP8_MAX
        q = (y * tl.div_rn(1.0, scale)[:, None]).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + r64 * N + cols[None, :], q, mask=ok)
        tl.store(s_ptr + rows, scale, mask=row_ok)
