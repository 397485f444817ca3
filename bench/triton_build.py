"""How long Triton takes to build ``triton_ops.gate_up_silu`` for Hopper (sm_90), on any machine
with triton installed (no GPU needed: the same compile the first capture runs, ahead of time).

The model builds it once per process for each weight dtype (the row count is not specialised; the
widths only by their divisibility), then reads it from Triton's disk cache. Prints seconds, the
cubin's size and its shared memory.

    python -m bench.triton_build [--inter 3072]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from scorer.models import triton_ops


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inter", type=int, default=3072, help="the MLP width (picks GROUP_M)")
    a = ap.parse_args(argv)
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()  # a cold build, not Triton's disk cache
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    bm, bn, bk, stages, warps, group, _, loop = triton_ops.gate_up_config(16384, 1024, a.inter)
    desc = "tensordesc<bf16[{}, {}]>"
    signature = {
        "x_desc": desc.format(bm, bk),
        "w_desc": desc.format(bn, bk),
        "y_desc": desc.format(bm, bn),
        **dict.fromkeys(("M", "N", "K", "PROGRAMS"), "i32"),
    }
    constants = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group}
    constants |= {"FLATTEN": loop == "flatten", "WARP_SPECIALIZE": loop == "ws"}
    signature |= dict.fromkeys(constants, "constexpr")
    t0 = time.perf_counter()
    kernel = triton.compile(
        ASTSource(triton_ops._gate_up_silu_kernel, signature, constants),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps, "num_stages": stages},
    )
    took = time.perf_counter() - t0
    print(
        f"gate_up_silu {(bm, bn, bk, stages, warps, group)}: built for sm_90 in {took:.2f} s, "
        f"cubin {len(kernel.asm['cubin']):,} bytes, shared memory {kernel.metadata.shared:,} bytes"
    )


if __name__ == "__main__":
    main()
