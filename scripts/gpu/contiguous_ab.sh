#!/usr/bin/env bash
# Contiguous K/V for calls that read one run of slots (cascade's levels, naive), against the same
# calls through the paged pool, side by side: GPU tests first, then bench.throughput on the
# workloads with long prompts (0.6B B, C, D; 8B B).
# bash scripts/gpu/contiguous_ab.sh [0.6b_budget_s] [8b_budget_s]   (carry .gpu) -> $OUT
source scripts/gpu/env.sh
[ "${GPU_TESTS:-1}" = 1 ] && bash scripts/gpu/test.sh | tail -3
python3 -m bench.throughput --models qwen3-0.6b --workloads "${WORKLOADS:-B,D,C}" \
  --systems "${SYSTEMS:-auto,ragged,cascade,cascade@paged,multi_item}" --seconds 3 --budget-s "${1:-200}" \
  --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/throughput.log"
python3 -m bench.throughput --models qwen3-8b --workloads B --systems "${SYSTEMS_8B:-auto,cascade,cascade@paged}" \
  --seconds 3 --budget-s "${2:-120}" --out "$OUT/8b" 2>&1 | grep -v Warning | tee -a "$OUT/throughput.log"
cp "$OUT/8b/throughput.json" "$OUT/throughput_8b.json" && rm -r "$OUT/8b"
