#!/usr/bin/env bash
# GPU tests, the host planning of A' (issue 10's 0.5 ms: bench.plan_on_cache), then bench.throughput
# on a time budget (0.6B: A, A', E, D x auto on the fused and on the flashinfer kernels, ragged,
# multi_item, both transformers baselines; 8B: A x auto, hf_prefix).
# bash scripts/gpu/final.sh [0.6b_budget_s] [8b_budget_s]   -> $OUT/throughput*.json (and logs)
source scripts/gpu/env.sh
bash scripts/gpu/test.sh | tail -3
timeout 120 python3 -m bench.plan_on_cache --workload "A'" --out "$OUT" 2>&1 | grep -v Warning | tail -8
python3 -m bench.throughput --models qwen3-0.6b --workloads "A,A',E,D" \
  --systems auto,auto@flashinfer,ragged,multi_item,hf_naive,hf_prefix --seconds 3 --budget-s "${1:-150}" \
  --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/throughput.log"
python3 -m bench.throughput --models qwen3-8b --workloads A --systems auto,hf_prefix --seconds 3 \
  --budget-s "${2:-60}" --out "$OUT/8b" 2>&1 | grep -v Warning | tee -a "$OUT/throughput.log"
cp "$OUT/8b/throughput.json" "$OUT/throughput_8b.json" && rm -r "$OUT/8b"
