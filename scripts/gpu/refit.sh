#!/usr/bin/env bash
# The cost model's measurements again, on the current engine: the wide kernel grid on FA3 (every
# scheme; cascade's and naive's calls now run on contiguous K/V), then the model-level forwards of
# every scheme (train and held-out shapes) on the serving configuration (fused kernels, graphs).
# Fit offline: python -m bench.cost_fit fit bench/data/e2e.json bench/data/kernels_wide.json
# bash scripts/gpu/refit.sh [kernels_budget_s] [e2e_budget_s]   (carry .gpu) -> $OUT
source scripts/gpu/env.sh
python3 -m bench.kernels --grid wide --kernels fa3 --cap 0.05 --budget "${1:-200}" --out "$OUT" 2>&1 \
  | grep -v Warning | tail -4
python3 -m bench.e2e --budget "${2:-260}" --repeats 5 --model-kernels fused --compare "" --out "$OUT" 2>&1 \
  | grep -v Warning | tee "$OUT/e2e.log" | tail -6
