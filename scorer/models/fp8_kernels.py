"""FP8 activations quantized where they are made: one Triton kernel each for the hidden-state
RMSNorm (and the residual add before it) writing FP8 and per-token scales for the QKV and gate/up
GEMMs, and a plain per-row quantization (the attention output, for the output projection). The
down projection's input is quantized per token and ``GROUP`` columns: by the epilogue of Triton's
gate/up + SiLU GEMM (``gate_up_silu_quant``), or under its row minimum by a SiLU-and-mul kernel
writing FP8 (``silu_mul_quant``).

``quantize_rows`` is the definition, in torch: each row's absmax in fp32, ``scale = absmax / 448``
(a row of zeros gets ``MIN_AMAX``'s), ``q = x / scale`` in fp32 rounded to e4m3; ``quantize_groups``
is the same on each 128-wide group of a row. The kernels compute their bf16 result as the unfused
kernels would (fp32, rounded once to the activations' dtype), then quantize it exactly as the
definition does (the scale a product with ``INV_FP8_MAX``, the values an IEEE division, ``div_rn``;
round to nearest even): on the same bf16 values they give the same bits, so the CPU reference
(``quant.py``) sees the FP8 values the GPU multiplies. A row-wise program holds its rows whole in
registers (rows of up to ``MAX_WIDTH`` values; wider ones go to the torch path).

Without them each quantization is five eager kernels (absmax, clamp, two divisions, the cast) that
read the bf16 row twice; with them the norm kernels, which the bf16 path runs anyway, write one
byte a value instead of two, and the gate/up GEMM writes its output in FP8 (one byte a value, where
bf16 out and a quantizing pass wrote two, read two and wrote one). CPU tensors (and CUDA without
Triton) take the torch statement of the same semantics.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from scorer.models import triton_ops
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


GROUP = 128
"""The down projection's input is quantized per token and ``GROUP``-wide group of columns
(``quantize_groups``): Triton's gate/up GEMM holds 128 columns of a row at a time, so its epilogue
writes the down GEMM's FP8 input and scales itself (a whole row's scale would need every tile of the
row first), and cuBLAS multiplies it with 1x128 block scaling (``quant.Fp8Linear.groups``)."""


class Quantized(NamedTuple):
    """An activation in FP8: ``q`` [M, K] e4m3 and its ``scale`` fp32, ``x ~= q * scale``: per row
    [M, 1], or per row and ``GROUP`` columns [M, K / GROUP] (column-major, ``quantize_groups``).
    What the FP8 linears take instead of a bf16 tensor."""

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
    # bf16 / fp32 divides in fp32 (one temporary). No clamp: the row's largest lands within a few
    # ulps of 448, which rounds to 448 (a value would need 464 to round past it)
    q = (x / scale).to(FP8)
    return q, scale


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows`` of each ``GROUP``-wide group of columns of ``x`` [M, K]: ``(q [M, K],
    scale [M, K / GROUP])``, the scales column-major (stride ``(1, M)``, as cuBLAS's 1x128 block
    scaling reads them)."""
    m, k = x.shape
    if k % GROUP:
        raise ValueError(f"quantizing by groups of {GROUP} columns needs a multiple of {GROUP}, not {k}")
    q, scale = quantize_rows(x.reshape(m * k // GROUP, GROUP))
    return q.view(m, k), scale.view(m, k // GROUP).t().contiguous().t()


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


def silu_mul_quant(gate_up: torch.Tensor, groups: bool = True) -> Quantized:
    """``silu(g) * u`` of ``gate_up`` [M, 2I] (the merged gate/up GEMM's output) quantized per row
    and ``GROUP`` columns (``quantize_groups``): the down projection's input, without its bf16
    [M, I] written and read again. A width that 128 does not divide, or ``groups=False``, is
    quantized per row (``quant.Fp8Linear.groups`` is off for it)."""
    width = gate_up.shape[-1] // 2
    if width % GROUP or not groups:
        return quantize(silu_mul_reference(gate_up))
    if reference_path(gate_up):
        return Quantized(*quantize_groups(silu_mul_reference(gate_up)))
    return _launch_groups(gate_up, width, silu=True)


def quantize_by_groups(x: torch.Tensor) -> Quantized:
    """``quantize_groups`` of ``x`` [M, K] (the last dim contiguous), on CUDA in one kernel."""
    if reference_path(x):
        return Quantized(*quantize_groups(x))
    return _launch_groups(x, x.shape[-1], silu=False)


def gate_up_silu_quant(x: Quantized, w: torch.Tensor, w_scale: torch.Tensor) -> Quantized:
    """Triton's gate/up + SiLU GEMM on FP8 operands (``triton_ops.gate_up_silu``: ``x`` per row,
    ``w`` [2I, H] per weight row) writing ``silu(g) * u`` in FP8 with a scale per row and
    ``GROUP`` columns, from its epilogue: the value rounded to bf16 first, then quantized as
    ``quantize_groups`` does. The CPU runs the same statements in torch."""
    if reference_path(x.q):
        act = triton_ops.gate_up_silu(x.q, w, x_scale=x.scale, w_scale=w_scale)
        return Quantized(*quantize_groups(act))
    rows, width = x.q.shape[0], w.shape[0] // 2
    q = torch.empty(rows, width, dtype=FP8, device=x.q.device)
    scale = torch.empty(width // GROUP, rows, dtype=torch.float32, device=x.q.device)
    triton_ops.gate_up_silu(
        x.q, w, q, x_scale=x.scale, w_scale=w_scale, out_scale=scale, quant=(MIN_AMAX, INV_FP8_MAX)
    )
    return Quantized(q, scale.t())


def _launch_groups(x: torch.Tensor, width: int, silu: bool) -> Quantized:
    """``_group_quant_kernel`` over ``x``'s rows: [M, width] (or gate|up [M, 2 width] with ``silu``)."""
    if width % GROUP:
        raise ValueError(f"quantizing by groups of {GROUP} columns needs a multiple of {GROUP}, not {width}")
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    if x2.stride(-1) != 1:
        raise ValueError(f"FP8 quantization needs rows with a contiguous last dim, got {tuple(x.shape)}")
    q = torch.empty(rows, width, dtype=FP8, device=x.device)
    scale = torch.empty(width // GROUP, rows, dtype=torch.float32, device=x.device)
    if rows:
        _group_quant_kernel[(triton.cdiv(rows, GROUP_ROWS), width // GROUP)](
            x2, q, scale, rows, x2.stride(0), N=width, GROUP=GROUP, BLOCK_ROWS=GROUP_ROWS, SILU=silu,
            INV_FP8_MAX=INV_FP8_MAX, MIN_AMAX=MIN_AMAX, num_warps=4,
        )  # fmt: skip
    return Quantized(q, scale.t())


GROUP_ROWS = 32
"""Rows a program of ``_group_quant_kernel``: 32 x 128 values (4k, as ``row_config``'s)."""

_PLAIN, _NORM, _ADD_NORM = range(3)


def row_config(width: int, mode: int) -> tuple[int, int]:
    """(rows a program, num_warps): ~4k values a program in 4 warps (8 rows of Qwen3-0.6B's 1,024),
    a wider row alone with up to 16 warps, so that a thread holds at most 64 of a tensor's values
    (the bf16 ``rms_norm``'s measured rule: more spilled)."""
    block = triton.next_power_of_2(width)
    return max(1, 4096 // block), min(16, max(4, block // 1024))


def _launch(
    mode: int,
    x: torch.Tensor,
    width: int,
    weight: torch.Tensor | None = None,
    eps: float = 0.0,
    residual: torch.Tensor | None = None,
    config: tuple[int, int] | None = None,
    recip: bool = False,
) -> Quantized:
    """One ``_quant_kernel`` over ``x``'s rows; ``config`` (rows a program, num_warps) overrides
    ``row_config`` and ``recip`` multiplies by the scale's reciprocal instead of dividing
    (``bench.fp8_quant`` measures both)."""
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
            INV_FP8_MAX=INV_FP8_MAX, MIN_AMAX=MIN_AMAX, RECIP=recip, num_warps=num_warps,
        )  # fmt: skip
    return Quantized(q, scale)


if triton is not None:

    @triton.jit(do_not_specialize=["n_rows"])
    def _quant_kernel(
        x_ptr, r_ptr, w_ptr, q_ptr, s_ptr, n_rows, stride_x, stride_r, eps,
        N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_ROWS: tl.constexpr, MODE: tl.constexpr,
        INV_FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr, RECIP: tl.constexpr,
    ):  # fmt: skip
        """One program per BLOCK_ROWS rows, each whole in registers: the row's value in the
        activations' dtype (MODE: as it is; RMSNorm; residual add then RMSNorm), then its absmax,
        scale and FP8 values."""
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.arange(0, BLOCK_N)
        row_ok = rows < n_rows
        ok = row_ok[:, None] & (cols < N)[None, :]
        r64 = rows.to(tl.int64)[:, None]
        src = x_ptr + r64 * stride_x + cols[None, :]
        x = tl.load(src, mask=ok, other=0.0)
        dtype = x.dtype
        if MODE == 0:
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
        if RECIP:
            q = (y * tl.div_rn(1.0, scale)[:, None]).to(q_ptr.dtype.element_ty)
        else:
            q = tl.div_rn(y, scale[:, None]).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + r64 * N + cols[None, :], q, mask=ok)
        tl.store(s_ptr + rows, scale, mask=row_ok)

    @triton.jit(do_not_specialize=["n_rows"])
    def _group_quant_kernel(
        x_ptr, q_ptr, s_ptr, n_rows, stride_x,
        N: tl.constexpr, GROUP: tl.constexpr, BLOCK_ROWS: tl.constexpr, SILU: tl.constexpr,
        INV_FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
    ):  # fmt: skip
        """One program per BLOCK_ROWS rows and GROUP columns: the value in the activations' dtype
        (as it is, or SiLU(gate) * up of gate columns [0, N) and up columns [N, 2N)), then each
        row's absmax over the group, its scale (stored at [group, row]) and FP8 values."""
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
        row_ok = rows < n_rows
        r64 = rows.to(tl.int64)[:, None]
        src = x_ptr + r64 * stride_x + cols[None, :]
        x = tl.load(src, mask=row_ok[:, None], other=0.0)
        if SILU:
            g = x.to(tl.float32)
            u = tl.load(src + N, mask=row_ok[:, None], other=0.0).to(tl.float32)
            y = (tl.fdiv(g, 1.0 + tl.exp(-g), ieee_rounding=False) * u).to(x.dtype).to(tl.float32)
        else:
            y = x.to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(y), axis=1), MIN_AMAX) * INV_FP8_MAX
        q = tl.div_rn(y, scale[:, None]).to(q_ptr.dtype.element_ty)
        tl.store(q_ptr + r64 * N + cols[None, :], q, mask=row_ok[:, None])
        tl.store(s_ptr + tl.program_id(1) * n_rows + rows, scale, mask=row_ok)
