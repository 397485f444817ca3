#!/usr/bin/env bash
# Everything in one device call: GPU tests, kernel benchmark (article grid with CUDA graphs, the
# wide grid under a time budget), model-level benchmark under a time budget.
# bash scripts/gpu/all.sh [wide_budget_s] [e2e_budget_s]
source scripts/gpu/env.sh
python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log" | tail -4
bash scripts/gpu/bench.sh "${1:-190}" "${2:-230}"
