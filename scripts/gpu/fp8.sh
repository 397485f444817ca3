#!/usr/bin/env bash
# FP8 linears (--quantization fp8) on the GPU, in two device calls:
#   bash scripts/gpu/fp8.sh speed     (~8 min on an H100) their GPU tests (tests/gpu/test_quant_gpu.py),
#       then bench.throughput: bf16 (auto) against FP8 (auto@fp8, the serving path; auto@fp8lin, each
#       linear quantizing its own input; auto@fp8noswiglu, cuBLAS's gate/up GEMM, not Triton's) on the
#       0.6B (A, E) and the 8B (A, B), the same run -> $OUT/throughput.json, throughput_8b.json
#   bash scripts/gpu/fp8.sh ranking   (~4 min) bench.fp8: bf16's and FP8's label log-probs and rankings
#       against an fp32 forward, 1,000 calls of A and E on the 0.6B, 100 on the 8B -> $OUT/fp8.json, fp8.md
#   bash scripts/gpu/fp8.sh kernels   (~6 min) the GPU tests but the families', then where FP8's device
#       time goes (bench.kernel_profile: bf16, FP8, FP8 with the MLP's residual add on its own; 0.6B A
#       and E, 8B A and B) and the FP8 gate/up GEMM's program shapes (bench.triton_gemm --fp8)
#       -> $OUT/kernel_profile.json, kernel_profile_8b.json, triton_gemm.json, kernels.log
# (device: carry [".gpu"]; GPU_TESTS=0 (speed: no tests), MODELS= (ranking), CALLS=, CALLS_8B=, SYSTEMS_06B=, SYSTEMS_8B=, BUDGET_06B=, BUDGET_8B= to change)
source scripts/gpu/env.sh
case "${1:-speed}" in
speed)
  [ "${GPU_TESTS:-1}" = 0 ] || timeout 240 python3 -m pytest -m gpu tests/gpu/test_quant_gpu.py -q -p no:cacheprovider \
    --junitxml="$OUT/fp8-gpu-tests.xml" 2>&1 | tail -25 | tee "$OUT/fp8-gpu-tests.log"
  python3 -m bench.throughput --models qwen3-0.6b --workloads A,E \
    --systems "${SYSTEMS_06B:-auto,auto@fp8,auto@fp8lin,auto@fp8noswiglu}" --seconds 3 \
    --budget-s "${BUDGET_06B:-150}" --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/throughput.log"
  python3 -m bench.throughput --models qwen3-8b --workloads A,B \
    --systems "${SYSTEMS_8B:-auto,auto@fp8,auto@fp8noswiglu}" --seconds 3 \
    --budget-s "${BUDGET_8B:-120}" --out "$OUT/8b" 2>&1 | grep -v Warning | tee -a "$OUT/throughput.log"
  cp "$OUT/8b/throughput.json" "$OUT/throughput_8b.json" && rm -r "$OUT/8b"
  ;;
ranking)
  # the JSON is written after each system, so a run cut by the timeout keeps what it measured
  timeout "${BENCH_TIMEOUT_S:-420}" python3 -m bench.fp8 --out "$OUT" --models "${MODELS:-qwen3-0.6b,qwen3-8b}" \
    --calls "${CALLS:-1000}" --calls-8b "${CALLS_8B:-100}" --seconds 0 2>&1 | grep -v Warning | tee "$OUT/fp8.log"
  ;;
kernels)
  KERNELS="${KERNELS:-fused,fused/fp8,fused/fp8sepadd}" KERNELS_8B="${KERNELS_8B:-fused,fused/fp8}" WORKLOADS_8B=A,B \
    TEST_ARGS=--ignore=tests/gpu/test_families_gpu.py bash scripts/gpu/kernel_profile.sh 2>&1 \
    | grep -E "^[0-9]+ (passed|failed)|passed|failed|^\| (A|B|E) |^qwen|^\| (gemm|attention|fp8_quant|gate_up|qk_norm|rmsnorm|residual|copy)" \
    | tee "$OUT/kernels.log"
  python3 -m bench.triton_gemm --fp8 --models 0.6b,8b --rows 4100,16128 --out "$OUT" 2>&1 | grep -v Warning \
    | tee -a "$OUT/kernels.log"
  ;;
esac
