#!/usr/bin/env bash
# After a change to cascade's host path: the attention GPU tests, cascade's model-level forwards
# again (bench.e2e --schemes cascade), the cost model refitted with them on this machine (the fit is
# deterministic: the same as offline), then auto beside the schemes on B and D (0.6B) and B (8B).
# bash scripts/gpu/cascade_refit.sh [e2e_budget_s]   (carry .gpu) -> $OUT
source scripts/gpu/env.sh
python3 -m pytest -m gpu tests/gpu/test_flashinfer_attention.py -q -p no:cacheprovider 2>&1 | tail -2
python3 -m bench.e2e --budget "${1:-110}" --repeats 5 --model-kernels fused --compare "" --schemes cascade \
  --out "$OUT/e2e_cascade" 2>&1 | grep -v Warning | tail -3
python3 -m bench.cost_fit fit bench/data/session15/refit/e2e.json bench/data/session15/refit/kernels_wide.json \
  --e2e-more "$OUT/e2e_cascade/e2e.json" --out scorer/planning/cost_model.json | head -2
cp scorer/planning/cost_model.json "$OUT/" && mv "$OUT/e2e_cascade/e2e.json" "$OUT/e2e_cascade.json"
python3 -m bench.throughput --models qwen3-0.6b --workloads D,B --systems auto,cascade,multi_item,ragged \
  --seconds 3 --budget-s 75 --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/throughput.log"
python3 -m bench.throughput --models qwen3-8b --workloads B --systems auto,cascade --seconds 3 \
  --budget-s 40 --out "$OUT/8b" 2>&1 | grep -v Warning | tee -a "$OUT/throughput.log"
cp "$OUT/8b/throughput.json" "$OUT/throughput_8b.json" && rm -r "$OUT/8b" "$OUT/e2e_cascade"
