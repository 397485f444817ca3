#!/usr/bin/env bash
# The graphs' GEMMs as captured from cuBLAS with torch's defaults, from cuBLASLt, and with cuBLAS's
# reduced-precision bf16 split-K reductions off (bench.throughput.BLAS), side by side in one run:
# docs/s (bench.throughput, 0.6B A, E, B; 8B A with MODEL_8B=1) and the device time by kernel family with the
# memsets before the GEMMs counted (bench.kernel_profile, 0.6B A).  ~3 minutes.
#   bash scripts/gpu/blas_ab.sh   -> $OUT/throughput.json, throughput_8b.json, kernel_profile.json, blas_ab.log
source scripts/gpu/env.sh
[ "${GPU_TESTS:-0}" = 0 ] || bash scripts/gpu/test.sh | tail -3
python3 -m bench.throughput --models qwen3-0.6b --workloads "${WORKLOADS:-A,E,B}" \
  --systems auto,auto@lt,auto@exact --seconds 2 --out "$OUT" 2>&1 | grep -v "Warning\|warn_once" | tee "$OUT/blas_ab.log"
[ "${MODEL_8B:-0}" = 0 ] || { python3 -m bench.throughput --models qwen3-8b --workloads A --systems auto,auto@lt,auto@exact \
  --seconds 2 --out "$OUT/8b" 2>&1 | grep -v "Warning\|warn_once" | tee -a "$OUT/blas_ab.log"
  cp "$OUT/8b/throughput.json" "$OUT/throughput_8b.json" && rm -r "$OUT/8b"; }
python3 -m bench.kernel_profile --model qwen3-0.6b --workloads A --blas default,lt,exact --out "$OUT/kp" 2>&1 \
  | grep -v "Warning\|USDT" | grep -A12 "^| workload\|idle between (kernels)" | tee -a "$OUT/blas_ab.log"
cp "$OUT/kp/kernel_profile.json" "$OUT/kernel_profile.json" && rm -r "$OUT/kp"
