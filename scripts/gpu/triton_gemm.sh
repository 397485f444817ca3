#!/usr/bin/env bash
# Session 19: Triton GEMMs: the gate/up GEMM writing silu(g) * u (DecoderLM.swiglu_gemm) against cuBLAS's
# GEMM and FlashInfer's SiLU-and-mul: the GPU tests, the kernel by program shape and row count
# and the other GEMMs on Triton (bench.triton_gemm), then the model side by side (auto against auto@noswiglu, ROUNDS rounds).
# bash scripts/gpu/triton_gemm.sh [throughput_budget_s]   (device: carry [".gpu"])
source scripts/gpu/env.sh
[ "${GPU_TESTS:-1}" = 1 ] && bash scripts/gpu/test.sh | tail -3
timeout 240 python3 -m bench.triton_gemm --out "$OUT" --models "${MODELS:-0.6b,8b}" \
  --rows "${ROWS:-800,4100,16128}" --configs "${CONFIGS:-all}" 2>&1 | grep -v Warning | tee "$OUT/triton_gemm.log"
python3 -m bench.throughput --models qwen3-0.6b --workloads "${WORKLOADS:-C,A,E}" \
  --systems "${SYSTEMS:-auto,auto@noswiglu,auto@tg=qkv+o+down}" --seconds 3 --rounds "${ROUNDS:-2}" --budget-s "${1:-200}" \
  --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/throughput.log"
