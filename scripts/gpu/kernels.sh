#!/usr/bin/env bash
# One attention layer per scheme (16/8 heads, head_dim 128, fp16): the article's grid (each scheme
# also replayed from a CUDA graph), then the wide grid on FA3 under a time budget; render the tables
# with python -m bench.report --data DIR (the JSON under DIR/kernels).
# bash scripts/gpu/kernels.sh [wide_budget_s]   (~7 min)  -> $OUT/kernels_article.json, kernels_wide.json
source scripts/gpu/env.sh
python3 -m bench.kernels --grid article --graphs --out "$OUT" 2>&1 | tee "$OUT/kernels.log" | tail -12
python3 -m bench.kernels --grid wide --kernels fa3 --cap 0.1 --budget "${1:-300}" --out "$OUT" 2>&1 \
  | tee -a "$OUT/kernels.log" | tail -3
