#!/usr/bin/env bash
# FP8 linears (--quantization fp8) on the GPU in one device call (~6-7 minutes on an H100): their
# GPU tests (tests/gpu/test_quant_gpu.py), then bench.fp8 on the random 0.6B and 8B models (engine
# docs/s of fp8 against bf16, the ranking of both against an fp32 forward) -> $OUT/fp8.json, fp8.md
# bash scripts/gpu/fp8.sh   (device: carry [".gpu"]; CALLS=1000 CALLS_8B=100 SECONDS_PER=3
#                            MODELS=qwen3-0.6b,qwen3-8b GPU_TESTS=1 to change what runs)
source scripts/gpu/env.sh
if [ "${GPU_TESTS:-1}" = 1 ]; then
  timeout 120 python3 -m pytest -m gpu tests/gpu/test_quant_gpu.py -q -p no:cacheprovider \
    --junitxml="$OUT/fp8-gpu-tests.xml" 2>&1 | tail -25 | tee "$OUT/fp8-gpu-tests.log"
fi
# the JSON is written after each system, so a run cut by the timeout keeps what it measured
timeout "${BENCH_TIMEOUT_S:-360}" python3 -m bench.fp8 --out "$OUT" --models "${MODELS:-qwen3-0.6b,qwen3-8b}" \
  --calls "${CALLS:-1000}" --calls-8b "${CALLS_8B:-100}" --seconds "${SECONDS_PER:-3}" 2>&1 \
  | grep -v Warning | tee "$OUT/fp8.log"
