#!/usr/bin/env bash
# GPU tests, then the model-level benchmark with the piecewise CUDA graphs (held-out shapes also
# eager, side by side), in one device call.
# bash scripts/gpu/graphs.sh [e2e_budget_s] [repeats]
source scripts/gpu/env.sh
python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | tail -6
python3 -m bench.e2e --smoke --out "$OUT/smoke" 2>&1 | tail -3
python3 -m bench.e2e --budget "${1:-300}" --repeats "${2:-5}" --out "$OUT" 2>&1 | tee "$OUT/e2e.log" | tail -30
