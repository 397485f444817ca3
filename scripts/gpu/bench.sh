#!/usr/bin/env bash
# Kernel benchmark (article grid with CUDA graphs, then the wide grid) and the model-level
# benchmark, each under a time budget so that the whole run fits one 10-minute device call.
# bash scripts/gpu/bench.sh [kernel_budget_s] [e2e_budget_s]
source scripts/gpu/env.sh
python3 -m bench.kernels --grid article --graphs --out "$OUT" 2>&1 | tee "$OUT/kernels.log" | tail -8
python3 -m bench.kernels --grid wide --kernels fa3 --cap 0.1 --budget "${1:-240}" --out "$OUT" 2>&1 | tee -a "$OUT/kernels.log" | tail -3
python3 -m bench.e2e --budget "${2:-200}" --out "$OUT" 2>&1 | tee "$OUT/e2e.log" | tail -25
