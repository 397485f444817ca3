#!/usr/bin/env bash
# Session 16's two changes side by side: q/k/v left in the QKV GEMM's output (auto) against the
# heads copied to buffers of their own (auto@copyv), and a split call's short prompt computed again
# in each pass (auto) against its K/V pool (auto@pool; only C splits); auto@addmm: the residual adds
# in the GEMMs (DecoderLM.residual_in_gemm). GPU tests first.
# bash scripts/gpu/inplace_ab.sh [0.6b_budget_s] [8b_budget_s]   (carry .gpu) -> $OUT
source scripts/gpu/env.sh
[ "${GPU_TESTS:-1}" = 1 ] && bash scripts/gpu/test.sh | tail -3
python3 -m bench.throughput --models qwen3-0.6b --workloads "${WORKLOADS:-C,E,A,B,D}" \
  --systems "${SYSTEMS:-auto,auto@copyv,auto@addmm,auto@pool}" --seconds 3 --budget-s "${1:-200}" \
  --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/throughput.log"
python3 -m bench.throughput --models qwen3-8b --workloads A,B --systems "${SYSTEMS_8B:-auto,auto@copyv,auto@addmm}" \
  --seconds 3 --budget-s "${2:-100}" --out "$OUT/8b" 2>&1 | grep -v Warning | tee -a "$OUT/throughput.log"
cp "$OUT/8b/throughput.json" "$OUT/throughput_8b.json" && rm -r "$OUT/8b"
