"""The fused GPU path's Triton kernels. ``qk_norm_rope`` goes from the fused QKV GEMM's output to
attention's inputs: per-head q/k RMSNorm (Qwen3; none for Llama), non-interleaved RoPE and the v
copy, in one pass over the bytes.

FlashInfer's ``rmsnorm`` is shaped for a few long rows; Qwen3's per-head norm is many short ones
(16 q heads of a 16k-token batch are 256k rows of 128), where it runs at a tenth of the memory
bandwidth, and its RoPE then reads and writes q and k a second time. Here one program takes a
block of tokens and a block of heads of the ``[T, (Hq + 2 * Hkv) * D]`` GEMM output, computes the
norm and the rotation in fp32 and rounds once (FlashInfer's pair rounds between the two)
(``qk_norm_rope_reference`` is the exact torch statement of the semantics, and the CPU fallback).
On an H200, Qwen3-0.6B heads, 16k tokens, bf16: 76 us with the v copy (83% of the bandwidth
floor) against 558 us for FlashInfer's two norms, RoPE and the copy (``bench/qk_norm_rope.py``).

``gate_up_silu`` is the MLP's gate/up GEMM writing ``silu(g) * u`` from its two fp32 accumulators
(a persistent TMA kernel, Hopper): no [T, 2I] intermediate and no SiLU-and-mul kernel, 18-21%
less time than cuBLAS's GEMM and FlashInfer's ``silu_and_mul`` on 2,400-16,128 rows of Qwen3-0.6B.

``rms_norm`` is the layers' RMSNorm over hidden rows (1,024 wide on Qwen3-0.6B) with several rows
to a program: FlashInfer's ``RMSNorm`` kernel gives each row a block of its own and ran at ~64% of
the memory bandwidth on a 20k-row batch (bench/RESULTS.md, The model's own kernels).

Triton is imported only if it is installed (the CPU CI has none); the kernels run on CUDA tensors.
Given their outputs (``q_out``/``k_out``/``v_out``, ``out``) they allocate nothing and never
synchronise with the host, so they can be captured into a CUDA graph (after a first, compiling call
outside capture).
"""

from __future__ import annotations

import os

import torch

try:  # optional: the CPU CI has no triton, and the reference below needs none
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised where triton is absent
    triton = None
    tl = None

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# Triton's interpreter (TRITON_INTERPRET=1) runs the kernel on CPU tensors, for debugging anywhere.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def reference_path(x: torch.Tensor, kernel: str | None = None) -> bool:
    """Does a kernel on ``x`` run its torch statement instead: ``x`` on the CPU (unless Triton's
    interpreter runs), or no Triton (a CUDA tensor then raises naming ``kernel``, when given)?"""
    if not x.is_cuda and not (_INTERPRET and triton is not None):
        return True
    if triton is None and kernel is not None:
        raise RuntimeError(f"{kernel} on CUDA needs triton")
    return triton is None


def qk_norm_rope_reference(
    qkv: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
    *,
    out_dtype: torch.dtype | None = None,
) -> QKV:
    """The semantics of ``qk_norm_rope`` in plain torch: fp32 throughout, one rounding at the end.

    ``out_dtype`` (default ``qkv.dtype``) is the dtype of the new q and k (``torch.float32`` gives
    the unrounded result); v is ``v_out`` after a copy, else a view into ``qkv``.
    """
    T, hq, hkv, d = qkv.shape[0], num_q_heads, num_kv_heads, head_dim
    half = d // 2
    cs = cos_sin_cache.float()[positions]
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def one(x: torch.Tensor, w: torch.Tensor | None, out: torch.Tensor | None) -> torch.Tensor:
        x = x.float()
        if w is not None:
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()
        x1, x2 = x[..., :half], x[..., half:]
        y = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return y.to(out_dtype or qkv.dtype) if out is None else out.copy_(y)

    q = one(qkv[:, : hq * d].view(T, hq, d), q_weight, q_out)
    k = one(qkv[:, hq * d : (hq + hkv) * d].view(T, hkv, d), k_weight, k_out)
    v = qkv[:, (hq + hkv) * d : (hq + 2 * hkv) * d].view(T, hkv, d)
    return q, k, (v if v_out is None else v_out.copy_(v))


def qkv_views(qkv: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int) -> QKV:
    """q [T, Hq, D], k and v [T, Hkv, D] as views of ``qkv``'s columns (row stride that of ``qkv``):
    ``qk_norm_rope(qkv, ..., *qkv_views(qkv, ...)[:2])`` normalises and rotates q and k in place
    and leaves v where the GEMM wrote it, so nothing is copied (attention reads strided heads)."""
    d = head_dim
    q_end, k_end = num_q_heads * d, (num_q_heads + num_kv_heads) * d
    return (
        qkv[:, :q_end].unflatten(1, (num_q_heads, d)),
        qkv[:, q_end:k_end].unflatten(1, (num_kv_heads, d)),
        qkv[:, k_end : k_end + num_kv_heads * d].unflatten(1, (num_kv_heads, d)),
    )


def default_config(
    num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int, in_place: bool = False
) -> tuple[int, int, int, bool]:
    """(BLOCK_T tokens, BLOCK_H heads, num_warps, heads_fastest) of one program, independent of
    ``num_tokens`` so that one compiled kernel serves every batch size; the best of the 22 shapes
    that ``bench/qk_norm_rope.py`` sweeps on an H200 (Qwen3-0.6B and -8B heads, 4k and 16k tokens).

    Into new tensors: 2k elements (4 KiB of bf16 in, as much out) in 2 warps, in blocks of 4
    heads (a block never straddles the q/k boundary when it divides Hkv), head blocks varying
    fastest; within 5% of most shapes. In place (the serving layout, ``qkv_views``): one head of
    16 tokens in 4 warps, tokens varying fastest, within 4% of the best shape in each of the four
    cases (2% on average) and 7-13% faster than the into-new-tensors one (bench/RESULTS.md, The
    model's own kernels)."""
    if in_place:
        return max(1, min(2048 // triton.next_power_of_2(head_dim), 64)), 1, 4, False
    block_h = 4 if num_kv_heads % 4 == 0 else 2 if num_kv_heads % 2 == 0 else 1
    block_t = max(1, min(2048 // (block_h * triton.next_power_of_2(head_dim)), 64))
    return block_t, block_h, 2, True


def qk_norm_rope(
    qkv: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
    v_out: torch.Tensor | None = None,
    *,
    config: tuple[int, int, int, bool] | None = None,
) -> QKV:
    """q [T, Hq, D], k [T, Hkv, D] (normed, RoPE'd) and v [T, Hkv, D] from ``qkv`` [T, (Hq+2Hkv)*D].

    ``qkv``'s columns are the q heads, then the k heads, then the v heads (the output of one GEMM
    with ``torch.cat((q_proj.weight, k_proj.weight, v_proj.weight))``; rows may be strided, columns
    contiguous). ``q_weight``/``k_weight`` [D]: HF Qwen3's per-head RMSNorm
    (``x * rsqrt(mean(x^2) + eps) * w``), or both None for none (Llama). RoPE is HF's rotate_half
    convention with the fp32 ``cos_sin_cache`` [max_pos, D] whose row p is cos | sin of
    ``p * inv_freq``, at ``positions`` [T] (int64 or int32). Computed in fp32, rounded once.

    Outputs go into ``q_out``/``k_out``/``v_out`` when given (any strides with contiguous last
    dims; ``q_out``/``k_out`` may be ``qkv``'s own q and k columns, ``qkv_views``: each program
    reads its tile before it writes it); otherwise q and k are new contiguous tensors and v is a
    VIEW of ``qkv``'s v columns (row stride that of ``qkv``: no copy is made). ``config`` =
    (BLOCK_T, BLOCK_H, num_warps, heads_fastest) overrides ``default_config``. CPU tensors go to
    ``qk_norm_rope_reference`` (to the kernel under ``TRITON_INTERPRET=1``).
    """
    if (q_weight is None) != (k_weight is None):
        raise ValueError("give both q_weight and k_weight, or neither")
    if reference_path(qkv, "qk_norm_rope"):
        return qk_norm_rope_reference(
            qkv, q_weight, k_weight, eps, positions, cos_sin_cache,
            num_q_heads, num_kv_heads, head_dim, q_out, k_out, v_out,
        )  # fmt: skip
    T, hq, hkv, d = qkv.shape[0], num_q_heads, num_kv_heads, head_dim
    if qkv.dim() != 2 or qkv.shape[1] != (hq + 2 * hkv) * d or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [T, {(hq + 2 * hkv) * d}] with contiguous columns, got {qkv.shape}")
    if d % 2 or hq % hkv:
        raise ValueError("head_dim must be even and num_q_heads a multiple of num_kv_heads")
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.stride(-1) != 1 or cos_sin_cache.shape[-1] != d:
        raise ValueError("cos_sin_cache must be fp32 [max_pos, head_dim] with contiguous rows")
    if positions.shape != (T,):
        raise ValueError(f"positions must be [{T}], got {tuple(positions.shape)}")
    q = q_out if q_out is not None else qkv.new_empty(T, hq, d)
    k = k_out if k_out is not None else qkv.new_empty(T, hkv, d)
    for name, o, h in (("q_out", q, hq), ("k_out", k, hkv), ("v_out", v_out, hkv)):
        if o is not None and (o.shape != (T, h, d) or o.stride(2) != 1 or o.dtype != qkv.dtype):
            raise ValueError(f"{name} must be [{T}, {h}, {d}] {qkv.dtype} with a contiguous last dim")
    copy_v = v_out is not None
    v = v_out if copy_v else qkv[:, (hq + hkv) * d :].view(T, hkv, d)
    if T == 0:
        return q, k, v
    in_place = q.data_ptr() == qkv.data_ptr() and q.stride(0) == qkv.stride(0)
    block_t, block_h, num_warps, heads_fastest = config or default_config(T, hq, hkv, d, in_place)
    n_head_blocks = triton.cdiv(hq + hkv, block_h) + (triton.cdiv(hkv, block_h) if copy_v else 0)
    has_norm = q_weight is not None
    grid = (triton.cdiv(T, block_t) * n_head_blocks,)
    _qk_norm_rope_kernel[grid](
        qkv, q_weight if has_norm else qkv, k_weight if has_norm else qkv,
        positions, cos_sin_cache, q, k, v,
        T, float(eps),
        qkv.stride(0), cos_sin_cache.stride(0),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        HQ=hq, HKV=hkv, HEAD_DIM=d, HALF_PAD=triton.next_power_of_2(d // 2),
        BLOCK_T=block_t, BLOCK_H=block_h, N_HEAD_BLOCKS=n_head_blocks, HEADS_FASTEST=heads_fastest,
        HAS_NORM=has_norm, COPY_V=copy_v, num_warps=num_warps,
    )  # fmt: skip
    return q, k, v


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None):
    """``x * rsqrt(mean(x^2) + eps) * weight`` over the last dim in fp32, rounded once (FlashInfer's
    ``rmsnorm``), into ``out`` when given."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return y.to(x.dtype) if out is None else out.copy_(y)


def rms_norm_config(width: int) -> tuple[int, int]:
    """(rows, num_warps) of one program: ~4k elements (8 KiB of bf16 in, as much out) in 4 warps,
    a wider row whole in 8 (so that no thread holds more than 64 of its values: 8 rows of 4,096 in
    2 warps spilled, 12x slower). Within 2-3% of the best of 11 shapes on 1,024- and 4,096-wide rows
    (bench/rms_norm.py; bench/RESULTS.md, The model's own kernels); wider rows are not measured."""
    width = triton.next_power_of_2(width)
    return max(1, 4096 // width), 4 if width <= 4096 else 8


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out: torch.Tensor | None = None,
    *,
    config: tuple[int, int] | None = None,
) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` (rows may be strided, the last dim contiguous), computed in
    fp32 and rounded once, into ``out`` when given (it may be ``x``); allocates nothing then, and
    never synchronises, so it can be captured in a CUDA graph. ``config`` = (rows a program,
    num_warps) overrides ``rms_norm_config``. CPU tensors go to ``rms_norm_reference``."""
    if reference_path(x, "rms_norm"):
        return rms_norm_reference(x, weight, eps, out)
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    y = x2.new_empty(x2.shape) if out is None else out.view(-1, n)
    if x2.stride(-1) != 1 or y.stride(-1) != 1 or weight.shape != (n,):
        raise ValueError(f"rms_norm needs contiguous rows of width {n} and a weight of [{n}]")
    rows = x2.shape[0]
    if rows:
        block_rows, num_warps = config or rms_norm_config(n)
        _rms_norm_kernel[(triton.cdiv(rows, block_rows),)](
            x2, weight, y, rows, x2.stride(0), y.stride(0), float(eps),
            N=n, BLOCK_N=triton.next_power_of_2(n), BLOCK_ROWS=block_rows, num_warps=num_warps,
        )  # fmt: skip
    return y.view(x.shape) if out is None else out


if triton is not None:

    @triton.jit(do_not_specialize=["n_rows"])
    def _rms_norm_kernel(
        x_ptr, w_ptr, y_ptr, n_rows, stride_x, stride_y, eps,
        N: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_ROWS: tl.constexpr,
    ):  # fmt: skip
        """One program per BLOCK_ROWS rows, each row whole in registers."""
        rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.arange(0, BLOCK_N)
        ok = (rows < n_rows)[:, None] & (cols < N)[None, :]
        r64 = rows.to(tl.int64)[:, None]
        x = tl.load(x_ptr + r64 * stride_x + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
        w = tl.load(w_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)
        y = x * rstd[:, None] * w[None, :]
        tl.store(y_ptr + r64 * stride_y + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)

    @triton.jit(do_not_specialize=["n_tokens"])
    def _qk_norm_rope_kernel(
        qkv_ptr, qw_ptr, kw_ptr, pos_ptr, cache_ptr, q_ptr, k_ptr, v_ptr,
        n_tokens, eps,
        stride_qkv, stride_cache, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
        HQ: tl.constexpr, HKV: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr,
        BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, N_HEAD_BLOCKS: tl.constexpr,
        HEADS_FASTEST: tl.constexpr, HAS_NORM: tl.constexpr, COPY_V: tl.constexpr,
    ):  # fmt: skip
        """One program per (token block, head block), on a 1-D grid (head blocks varying fastest,
        or token blocks): head blocks over the Hq + Hkv q and k heads first (q and k heads are
        adjacent columns of qkv), then, with COPY_V, over the Hkv v heads. Each half of a head
        row ([:D/2], [D/2:]) is one [BLOCK_T, BLOCK_H, D/2] tile."""
        HALF: tl.constexpr = HEAD_DIM // 2
        NQK: tl.constexpr = HQ + HKV
        N_QK_BLOCKS: tl.constexpr = (NQK + BLOCK_H - 1) // BLOCK_H
        pid = tl.program_id(0)
        if HEADS_FASTEST:
            pid_t = pid // N_HEAD_BLOCKS
            pid_h = pid % N_HEAD_BLOCKS
        else:
            n_token_blocks = tl.cdiv(n_tokens, BLOCK_T)
            pid_t = pid % n_token_blocks
            pid_h = pid // n_token_blocks
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = offs_t < n_tokens
        rows = offs_t.to(tl.int64)[:, None, None]  # [BT, 1, 1]
        offs_d = tl.arange(0, HALF_PAD)
        d_ok = offs_d < HALF
        cols = offs_d[None, None, :]  # [1, 1, HP]
        if pid_h < N_QK_BLOCKS:
            heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
            hh = heads[None, :, None]  # [1, BH, 1]
            ok = t_ok[:, None, None] & (heads < NQK)[None, :, None] & d_ok[None, None, :]
            src = qkv_ptr + rows * stride_qkv + hh * HEAD_DIM + cols
            x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
            x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
            is_q = hh < HQ
            if HAS_NORM:
                ss = tl.sum(x1 * x1, axis=2) + tl.sum(x2 * x2, axis=2)  # [BT, BH]
                rstd = tl.rsqrt(ss / HEAD_DIM + eps)[:, :, None]
                wq1 = tl.load(qw_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, None, :]
                wq2 = tl.load(qw_ptr + HALF + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, None, :]
                wk1 = tl.load(kw_ptr + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, None, :]
                wk2 = tl.load(kw_ptr + HALF + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, None, :]
                x1 = x1 * rstd * tl.where(is_q, wq1, wk1)
                x2 = x2 * rstd * tl.where(is_q, wq2, wk2)
            pos = tl.load(pos_ptr + offs_t, mask=t_ok, other=0).to(tl.int64)
            cs = cache_ptr + pos[:, None, None] * stride_cache + cols  # [BT, 1, HP]
            cs_ok = t_ok[:, None, None] & d_ok[None, None, :]
            cos = tl.load(cs, mask=cs_ok, other=0.0)
            sin = tl.load(cs + HALF, mask=cs_ok, other=0.0)
            o1 = x1 * cos - x2 * sin
            o2 = x2 * cos + x1 * sin
            q_ok = ok & is_q
            qdst = q_ptr + rows * stride_qt + hh * stride_qh + cols
            tl.store(qdst, o1.to(q_ptr.dtype.element_ty), mask=q_ok)
            tl.store(qdst + HALF, o2.to(q_ptr.dtype.element_ty), mask=q_ok)
            k_ok = ok & (hh >= HQ)
            kdst = k_ptr + rows * stride_kt + (hh - HQ) * stride_kh + cols
            tl.store(kdst, o1.to(k_ptr.dtype.element_ty), mask=k_ok)
            tl.store(kdst + HALF, o2.to(k_ptr.dtype.element_ty), mask=k_ok)
        elif COPY_V:
            heads = (pid_h - N_QK_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
            hh = heads[None, :, None]
            ok = t_ok[:, None, None] & (heads < HKV)[None, :, None] & d_ok[None, None, :]
            src = qkv_ptr + rows * stride_qkv + (NQK + hh) * HEAD_DIM + cols
            dst = v_ptr + rows * stride_vt + hh * stride_vh + cols
            tl.store(dst, tl.load(src, mask=ok), mask=ok)
            tl.store(dst + HALF, tl.load(src + HALF, mask=ok), mask=ok)


def gate_up_silu_reference(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(x @ w[:N].T) * (x @ w[N:].T)`` for ``w`` [2N, H] (gate rows, then up rows), the
    products in fp32 and rounded once: the semantics of ``gate_up_silu``."""
    n = w.shape[0] // 2
    g = x.float() @ w[:n].float().t()
    u = x.float() @ w[n:].float().t()
    y = g / (1.0 + torch.exp(-g)) * u
    return y.to(x.dtype) if out is None else out.copy_(y)


GemmConfig = tuple[int, int, int, int, int, int, bool, str]
"""(BLOCK_M, BLOCK_N, BLOCK_K, num_stages, num_warps, GROUP_M, persistent, loop) of
``gate_up_silu``; ``loop`` (a persistent program's tile loop): ``""``, ``"flatten"`` (Triton
pipelines the tile and K loops as one: the next tile's loads under this one's epilogue) or ``"ws"``
(Triton's automatic warp specialisation: loads, MMAs and the epilogue in separate warps)."""

SWIGLU_MIN_ROWS = 1536
"""``MLP.act`` runs ``gate_up_silu`` on at least this many rows. On an H200 (bench/RESULTS.md section
25) it took 9% less time than cuBLAS's GEMM + FlashInfer's SiLU-and-mul on 1,600 rows of Qwen3-0.6B
and 18-21% less on 2,400-16,128 (5-8% less on Qwen3-8B's 2,400-16,128), and 11% more on 800."""


def gate_up_config(rows: int, hidden: int, inter: int, fp8: bool = False) -> GemmConfig:
    """The default program shape of ``gate_up_silu``: 128 rows by 128 gate and 128 up columns in two
    warp groups, K in steps of 64 over 3 stages of TMA loads (48 KiB a stage), one program per SM
    taking tiles in turn: the best of the shapes ``bench.triton_gemm`` swept on an H200 at
    2,400-16,128 rows of both models (bench/RESULTS.md, The model's own kernels). Row blocks are grouped by 16
    where the output has more than 32 column tiles (Qwen3-8B's 96: 0.5-3% faster than by 4 or 8
    in two sweeps), else by 4 (Qwen3-0.6B's 24: by 4, 8 and 16 within 2%, in either order). FP8
    takes K in steps of 128: the same bytes a stage (not swept)."""
    return 128, 128, 128 if fp8 else 64, 3, 8, 4 if inter // 128 <= 32 else 16, True, ""


def gate_up_silu_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Can ``gate_up_silu`` run ``x`` [T, H] by ``w`` [2N, H] on this device (Hopper's TMA, bf16,
    fp16 or FP8 e4m3 with scales, 16-byte aligned rows, N a multiple of 128)?"""
    return (
        triton is not None
        and x.is_cuda
        and _capability(x.device) >= 9
        and x.dtype in (torch.bfloat16, torch.float16, torch.float8_e4m3fn)
        and w.dtype == x.dtype
        and x.dim() == 2
        and x.stride(1) == 1
        and w.is_contiguous()
        and _tma_rows(x)
        and (x.shape[1] * x.element_size()) % 16 == 0
        and w.shape[0] % 256 == 0
    )


def gate_up_silu(
    x: torch.Tensor,
    w: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    config: GemmConfig | None = None,
    x_scale: torch.Tensor | None = None,
    w_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MLP's down-projection input ``silu(x @ gate.T) * (x @ up.T)`` as one GEMM kernel: ``w``
    [2N, H] holds the gate rows, then the up rows (``MLP.merge_gate_up``); each program computes a
    tile of both products in fp32 and writes only ``silu(g) * u``, rounded once, to ``out`` [T, N]
    (new when None). Against cuBLAS's GEMM into [T, 2N] and FlashInfer's ``silu_and_mul`` it writes
    and reads the [T, 2N] intermediate not at all and launches one kernel instead of two (and no
    workspace memset); FlashInfer's pair rounds g and u to bf16 before the product (a ulp apart).
    Allocates nothing with ``out`` given, so it can be captured in a CUDA graph. CPU tensors go to
    ``gate_up_silu_reference``.

    FP8 operands (``--quantization fp8``) come with their scales, ``x_scale`` [T, 1] per row and
    ``w_scale`` [1, 2N] per weight row; the products are scaled in fp32 before the SiLU, and ``out``
    is bf16 (the down projection's input, quantized next)."""
    scaled = x.dtype == torch.float8_e4m3fn
    if scaled != (x_scale is not None) or scaled != (w_scale is not None):
        raise ValueError("FP8 operands take x_scale and w_scale; others take neither")
    if reference_path(x, "gate_up_silu"):
        if scaled:
            y = gate_up_silu_reference(x.float() * x_scale, w.float() * w_scale.reshape(-1, 1))
            return y.to(torch.bfloat16) if out is None else out.copy_(y)
        return gate_up_silu_reference(x, w, out)
    from triton.tools.tensor_descriptor import TensorDescriptor

    T, H = x.shape
    n = w.shape[0] // 2
    if w.shape != (2 * n, H):
        raise ValueError(f"w must be [2N, {H}], got {tuple(w.shape)}")
    if out is None:
        out = torch.empty(T, n, dtype=torch.bfloat16 if scaled else x.dtype, device=x.device)
    if out.shape != (T, n) or out.stride(1) != 1 or not _tma_rows(out):
        raise ValueError(f"out must be [{T}, {n}] with contiguous, 16-byte aligned rows")
    if T == 0:
        return out
    bm, bn, bk, stages, warps, group, persistent, loop = config or gate_up_config(T, H, n, scaled)
    if n % bn:
        raise ValueError(f"N = {n} must be a multiple of BLOCK_N = {bn}")
    tiles = triton.cdiv(T, bm) * (n // bn)
    programs = min(tiles, _num_sms(x.device)) if persistent else tiles
    _gate_up_silu_kernel[(programs,)](
        TensorDescriptor.from_tensor(x, [bm, bk]),
        TensorDescriptor.from_tensor(w, [bn, bk]),
        TensorDescriptor.from_tensor(out, [bm, bn]),
        x_scale if scaled else x, w_scale if scaled else x, T, n, H,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group, PROGRAMS=programs, SCALED=scaled,
        FLATTEN=loop == "flatten", WARP_SPECIALIZE=loop == "ws",
        num_stages=stages, num_warps=warps,
    )  # fmt: skip
    return out


def _tma_rows(t: torch.Tensor) -> bool:
    """Can a TMA descriptor address ``t``'s rows (16-byte aligned start and row stride)?"""
    return t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0


_SMS: dict = {}
_CAPABILITY: dict = {}


def _capability(device: torch.device) -> int:
    if device not in _CAPABILITY:
        _CAPABILITY[device] = torch.cuda.get_device_capability(device)[0]
    return _CAPABILITY[device]


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":  # the interpreter
        return 4
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


if triton is not None:

    @triton.jit(do_not_specialize=["M", "PROGRAMS"])
    def _gate_up_silu_kernel(
        x_desc, w_desc, y_desc, xs_ptr, ws_ptr, M, N, K,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
        PROGRAMS, FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, SCALED: tl.constexpr,
    ):  # fmt: skip
        """Tiles of [BLOCK_M rows, BLOCK_N columns] of the output in grouped order (GROUP_M row
        blocks share their columns' weights in L2), PROGRAMS programs taking every PROGRAMS-th
        tile; per tile two accumulators over K, g (weight rows n..) and u (rows N + n..)."""
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = N // BLOCK_N
        per_group = GROUP_M * num_n
        for tile in tl.range(
            tl.program_id(0), num_m * num_n, PROGRAMS, flatten=FLATTEN, warp_specialize=WARP_SPECIALIZE
        ):
            first_m = (tile // per_group) * GROUP_M
            size_m = min(num_m - first_m, GROUP_M)
            pid_m = first_m + (tile % per_group) % size_m
            pid_n = (tile % per_group) // size_m
            om = pid_m * BLOCK_M
            on = pid_n * BLOCK_N
            g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for kk in range(0, tl.cdiv(K, BLOCK_K)):
                ok = kk * BLOCK_K
                a = x_desc.load([om, ok])
                g = tl.dot(a, w_desc.load([on, ok]).T, g)
                u = tl.dot(a, w_desc.load([N + on, ok]).T, u)
            if SCALED:  # FP8: the row's and the weight rows' scales
                rows = om + tl.arange(0, BLOCK_M)
                cols = on + tl.arange(0, BLOCK_N)
                sx = tl.load(xs_ptr + rows, mask=rows < M, other=0.0)[:, None]
                g = g * sx * tl.load(ws_ptr + cols)[None, :]
                u = u * sx * tl.load(ws_ptr + N + cols)[None, :]
            # silu with the approximate division (2 ulp of fp32, nothing after the bf16 rounding): the
            # IEEE one is ~15 instructions an element of an epilogue no other work hides
            y = tl.fdiv(g, 1.0 + tl.exp(-g), ieee_rounding=False) * u
            y_desc.store([om, on], y.to(y_desc.dtype))
