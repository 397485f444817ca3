#!/usr/bin/env bash
source scripts/gpu/env.sh
python3 -m pytest -m gpu tests/gpu/test_triton_ops.py -q -p no:cacheprovider 2>&1 | tail -5
python3 -m bench.qk_norm_rope --out "$OUT" 2>&1 | tail -30
