#!/usr/bin/env bash
# GPU tests, then bench.throughput with FlashInfer's prefill kernel chosen per call (auto) beside
# FA3 forced (auto@fa3, what ran before), the CUDA-graph buckets of before (auto@coarse) and the
# forced schemes, in one run (full batches only): 0.6B on A, A', E, B,
# C, D; 8B on A and B (~9 minutes: run it alone, under timeout 590).
#   bash scripts/gpu/attention_ab.sh [0.6b_budget_s] [8b_budget_s]
source scripts/gpu/env.sh
[ "${GPU_TESTS:-1}" = 0 ] || bash scripts/gpu/test.sh | tail -3
python3 -m bench.throughput --models qwen3-0.6b --workloads "A,A',E,B,C,D" \
  --systems auto,auto@fa3,auto@coarse,ragged,multi_item --seconds 2 --budget-s "${1:-240}" \
  --out "$OUT" 2>&1 | grep -v "Warning\|warn_once" | tee "$OUT/throughput.log"
python3 -m bench.throughput --models qwen3-8b --workloads A,B --systems auto,auto@fa3,auto@coarse --seconds 2 \
  --budget-s "${2:-90}" --out "$OUT/8b" 2>&1 | grep -v "Warning\|warn_once" | tee -a "$OUT/throughput.log"
cp "$OUT/8b/throughput.json" "$OUT/throughput_8b.json" && rm -r "$OUT/8b"
