#!/usr/bin/env bash
# GPU tests; the layer's GEMMs (eager) over every row count from 3,072 to 16,384 (step 64; 0.6B,
# and 8B with MODEL_8B=1 at step 256): does padding a pass to a larger size ever take less time?
# Then `auto` beside `auto@nomat` (long docs' attention paged, not FA3 over a gathered copy) on
# WORKLOADS (C,A). Session 18 ran it at 5b4b1bf with `auto@greedy` too (a split's greedy passes).
#   bash scripts/gpu/gemm_sweep.sh   -> $OUT/gemm_shapes_sweep*.json, gemm_sweep.log, throughput.json
source scripts/gpu/env.sh
[ "${GPU_TESTS:-1}" = 0 ] || bash scripts/gpu/test.sh | tail -2
timeout 120 python3 -m bench.gemm_shapes --out "$OUT" --rows "" --sweep 3072:16384:64 --label sweep 2>&1 \
  | grep -v Warn >"$OUT/gemm_sweep.log"
[ "${MODEL_8B:-0}" = 0 ] || timeout 200 python3 -m bench.gemm_shapes --out "$OUT" --models 8b --rows "" \
  --sweep 3072:16384:256 --label sweep8b 2>&1 | grep -v Warn >>"$OUT/gemm_sweep.log"
head -3 "$OUT/gemm_sweep.log"
[ -z "${WORKLOADS-C,A}" ] || python3 -m bench.throughput --models qwen3-0.6b --workloads "${WORKLOADS:-C,A}" \
  --systems auto,auto@nomat --seconds 3 --out "$OUT" 2>&1 | grep "^|"
