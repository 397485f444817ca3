#!/usr/bin/env bash
# What the article did not try, in one device call: GPU tests, the article grid on page sizes
# 1/16/64 (FA2 and FA3), and the held-out model-level cells on FA3 and FA2 side by side.
# bash scripts/gpu/variants.sh [e2e_budget_s]   -> $OUT/variants.tgz (and the logs)
source scripts/gpu/env.sh
bash scripts/gpu/test.sh | tail -3
python3 -m bench.kernels --grid article --page-sizes 1,16,64 --tag pages --out "$OUT/v" 2>&1 \
  | tee "$OUT/kernels-pages.log" | tail -3
python3 -m bench.e2e --split heldout --compare fa2 --budget "${1:-240}" --repeats 5 --out "$OUT/v" 2>&1 \
  | tee "$OUT/e2e-fa2.log" | tail -5
tar -C "$OUT" -czf "$OUT/variants.tgz" v gpu-tests.xml && rm -rf "$OUT/v"
