#!/usr/bin/env bash
# The transformers baselines that issue 10's table lacks (session 8's time budget did not reach
# them): 0.6B B and C, 8B A and B, hf_naive and hf_prefix (bench.throughput, best of HF_BATCHES).
# bash scripts/gpu/baselines.sh [0.6b_budget_s] [8b_budget_s]   -> $OUT/throughput*.json
source scripts/gpu/env.sh
python3 -m bench.throughput --models qwen3-0.6b --workloads B,C --systems hf_naive,hf_prefix --seconds 2 \
  --budget-s "${1:-100}" --out "$OUT" 2>&1 | grep -v "Warn\|USDT" | tee "$OUT/throughput.log"
python3 -m bench.throughput --models qwen3-8b --workloads A,B --systems hf_prefix,hf_naive --seconds 2 \
  --budget-s "${2:-60}" --out "$OUT/8b" 2>&1 | grep -v "Warn\|USDT" | tee -a "$OUT/throughput.log"
cp "$OUT/8b/throughput.json" "$OUT/throughput_8b.json" && rm -r "$OUT/8b"
