#!/usr/bin/env bash
# Session 19: Triton's gate/up GEMM writing silu(g) * u (DecoderLM.swiglu_gemm): the GPU tests, the
# kernel by program shape and row count against cuBLAS's GEMM + FlashInfer's SiLU-and-mul
# (bench.triton_gemm), then issue 10's 0.6B workloads with auto@noswiglu beside auto and the schemes
# (final.sh; MODEL_8B=1 adds the 8B).
# bash scripts/gpu/triton_gemm.sh [0.6b_budget_s] [8b_budget_s]   (device: carry [".gpu"])
source scripts/gpu/env.sh
[ "${GPU_TESTS:-1}" = 1 ] && bash scripts/gpu/test.sh | tail -3
{
  timeout 120 python3 -m bench.triton_gemm --out "$OUT/g06" --models 0.6b --rows "${ROWS:-800,1600,2400,4100,16128}"
  timeout 90 python3 -m bench.triton_gemm --out "$OUT/g8" --models 8b --rows "${ROWS_8B:-2400,16128}"
} 2>&1 | grep -v Warning | tee "$OUT/triton_gemm.log"
tar czf "$OUT/triton_gemm.tgz" -C "$OUT" g06 g8 && rm -r "$OUT/g06" "$OUT/g8"
GPU_TESTS=0 MODEL_8B="${MODEL_8B:-0}" SYSTEMS="${SYSTEMS:-auto,auto@noswiglu,ragged,cascade,multi_item}" \
  SYSTEMS_8B="${SYSTEMS_8B:-auto,auto@noswiglu,cascade}" bash scripts/gpu/final.sh "${1:-230}" "${2:-90}"
