#!/usr/bin/env bash
# Model-level benchmark alone (round-robin repeats), after the packing tests.
# bash scripts/gpu/e2e.sh [e2e_budget_s] [repeats]
source scripts/gpu/env.sh
python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider -k "packing or packbits" 2>&1 | tail -2
python3 -m bench.e2e --budget "${1:-270}" --repeats "${2:-5}" --out "$OUT" 2>&1 | tee "$OUT/e2e.log" | tail -12
