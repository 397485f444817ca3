#!/usr/bin/env bash
# GPU tests (unless GPU_TESTS=0), then bench.kernel_profile: the serving forward's device time by
# kernel family, 0.6B on A and E and 8B on A, for each of KERNELS (default "fused") and ATTENTION
# (default "auto"; e.g. auto,fa3); the 8B on WORKLOADS_8B (A) for each of KERNELS_8B (KERNELS).
# KERNELS=fused,fused/fp8: bf16 and FP8 side by side. TEST_ARGS: pytest's, for the GPU tests.
# bash scripts/gpu/kernel_profile.sh   -> $OUT/kernel_profile*.json, $OUT/kernel_profile.log
source scripts/gpu/env.sh
# shellcheck disable=SC2086
[ "${GPU_TESTS:-1}" = 0 ] || SMOKE=0 bash scripts/gpu/test.sh ${TEST_ARGS:-} | tail -3
python3 -m bench.kernel_profile --model qwen3-0.6b --workloads "${WORKLOADS:-A,E}" --kernels "${KERNELS:-fused}" \
  --attention "${ATTENTION:-auto}" --out "$OUT" 2>&1 | grep -v "Warning\|USDT" | tee "$OUT/kernel_profile.log"
[ "${MODEL_8B:-1}" = 0 ] || { python3 -m bench.kernel_profile --model qwen3-8b --workloads "${WORKLOADS_8B:-A}" \
  --kernels "${KERNELS_8B:-${KERNELS:-fused}}" \
  --out "$OUT/8b" 2>&1 | grep -v "Warning\|USDT" | tee -a "$OUT/kernel_profile.log"
  cp "$OUT/8b/kernel_profile.json" "$OUT/kernel_profile_8b.json" && rm -r "$OUT/8b"; }
