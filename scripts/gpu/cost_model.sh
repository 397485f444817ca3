#!/usr/bin/env bash
# The cost model's measurements on the current engine: the wide kernel grid on FA3 (every scheme),
# then every scheme's model-level forward on the 48 train and 21 held-out shapes in the serving
# configuration (fused kernels, CUDA graphs). Fit and evaluate anywhere, no GPU:
#   python -m bench.cost_fit fit OUT/e2e.json OUT/kernels_wide.json   (writes scorer/planning/cost_model.json)
#   python -m bench.cost_fit evaluate OUT/e2e.json --objective forward|latency
# bash scripts/gpu/cost_model.sh [kernels_budget_s] [e2e_budget_s]   (~8 min)  -> $OUT
source scripts/gpu/env.sh
python3 -m bench.kernels --grid wide --kernels fa3 --cap 0.05 --budget "${1:-200}" --out "$OUT" 2>&1 \
  | grep -v Warning | tail -4
python3 -m bench.e2e --budget "${2:-260}" --repeats 5 --model-kernels fused --compare "" --out "$OUT" 2>&1 \
  | grep -v Warning | tee "$OUT/e2e.log" | tail -6
