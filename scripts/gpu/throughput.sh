#!/usr/bin/env bash
# Docs/s and MFU per workload and model: the GPU tests (GPU_TESTS=0 skips them), a batch's host
# planning of A' on this host (bench.plan_on_cache), then bench.throughput on a time budget (0.6B:
# every workload x auto and the schemes auto chooses among; 8B: A, B x auto, cascade).
#   SYSTEMS / SYSTEMS_8B: other systems, e.g. auto,hf_naive,hf_prefix for the transformers baselines;
#   WORKLOADS (default A,A',E,B,C,D); ROUNDS=3: each 0.6B engine system three times, interleaved,
#   docs/s the median; MODEL_8B=0: no 8B.
# bash scripts/gpu/throughput.sh [0.6b_budget_s] [8b_budget_s]   (~6 min)  -> $OUT/throughput*.json, logs
source scripts/gpu/env.sh
[ "${GPU_TESTS:-1}" = 1 ] && SMOKE=0 bash scripts/gpu/test.sh | tail -3
timeout 120 python3 -m bench.plan_on_cache --workload "A'" --out "$OUT" 2>&1 | grep -v Warning | tail -8
WL="${WORKLOADS:-}" && [ -n "$WL" ] || WL="A,A',E,B,C,D"
python3 -m bench.throughput --models qwen3-0.6b --workloads "$WL" \
  --systems "${SYSTEMS:-auto,ragged,cascade,multi_item}" --seconds 3 --rounds "${ROUNDS:-1}" --budget-s "${1:-200}" \
  --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/throughput.log"
[ "${MODEL_8B:-1}" = 1 ] || exit 0
python3 -m bench.throughput --models qwen3-8b --workloads A,B --systems "${SYSTEMS_8B:-auto,cascade}" --seconds 3 \
  --budget-s "${2:-90}" --out "$OUT/8b" 2>&1 | grep -v Warning | tee -a "$OUT/throughput.log"
cp "$OUT/8b/throughput.json" "$OUT/throughput_8b.json" && rm -r "$OUT/8b"
