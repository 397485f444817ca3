#!/usr/bin/env bash
# GPU tests, then the benchmarks on tiny grids (catches a broken script before a long run); the
# smaller ones' JSON under $OUT/smoke.
source scripts/gpu/env.sh
python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log"
rc=$?
python3 -m bench.kernels --grid smoke --graphs --out "$OUT" 2>&1 | tail -5
python3 -m bench.e2e --smoke --out "$OUT" 2>&1 | tail -5
python3 -m bench.triton_gemm --models 0.6b --rows 1600 --configs default --reps 3 --iters 5 --out "$OUT/smoke" 2>&1 | tail -4
python3 -m bench.attention_layouts --shapes A --models 0.6b --iters 5 --out "$OUT/smoke" 2>&1 | tail -4
python3 -m bench.gemm_shapes --rows 4100 --iters 5 --out "$OUT/smoke" 2>&1 | tail -4
exit $rc
