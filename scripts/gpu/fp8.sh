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
#   bash scripts/gpu/fp8.sh rowmax    (~5 min) the down GEMM quantizing its own input (fp8_kernels.rowmax_mm):
#       its kernels against the quantizing pass + cuBLAS by program shape (down_quant_probe.py), the FP8
#       GPU tests, then the 0.6B's A and E as bf16, FP8 and FP8 with it (auto@fp8rowmax), its program
#       shape the probe's fastest on the 0.6B's 16,128 rows -> $OUT/down_quant_probe.json, throughput.json
# (device: carry [".gpu"]; GPU_TESTS=0 (speed, rowmax: no tests), MODELS= (ranking), CALLS=, CALLS_8B=, SYSTEMS_06B=, SYSTEMS_8B=, BUDGET_06B=, BUDGET_8B= to change)
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
rowmax)
  timeout 200 python3 scripts/gpu/down_quant_probe.py "$OUT/down_quant_probe.json" 2>&1 | grep -v Warning | tail -20
  [ "${GPU_TESTS:-1}" = 0 ] || timeout 200 python3 -m pytest -m gpu tests/gpu/test_quant_gpu.py -q -p no:cacheprovider \
    2>&1 | tail -15 | tee "$OUT/fp8-gpu-tests.log"
  timeout 200 python3 - <<'EOF' 2>&1 | grep -v Warning | tee "$OUT/throughput.log"
import json, os
from bench.throughput import main
from scorer.models import fp8_kernels
runs = [r for r in json.load(open(os.environ["OUT"] + "/down_quant_probe.json"))["records"]
        if r.get("rowmax_mm_us") and (r["m"], r["hidden"]) == (16128, 1024)]
if runs:
    fp8_kernels.ROWMAX_MM_CONFIG = tuple(min(runs, key=lambda r: r["rowmax_mm_us"])["config"])
print("rowmax_mm program shape:", fp8_kernels.ROWMAX_MM_CONFIG, flush=True)
main(["--models", "qwen3-0.6b", "--workloads", "A,E", "--systems", "auto,auto@fp8,auto@fp8rowmax",
      "--seconds", "3", "--out", os.environ["OUT"]])
EOF
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
