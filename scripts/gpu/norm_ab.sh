#!/usr/bin/env bash
# Session 17: Triton's hidden-state RMSNorm against FlashInfer's (@finorm), and the FA3 rule for
# calls of long requests against FA2 everywhere (@fa2), side by side in one run, after the GPU tests.
# bash scripts/gpu/norm_ab.sh [seconds a system]   (device: carry [".gpu"])
source scripts/gpu/env.sh
bash scripts/gpu/test.sh | tail -3
python3 -m bench.rms_norm --out "$OUT" 2>&1 | grep -v Warn | tee "$OUT/rms_norm.log"
python3 -m bench.throughput --models qwen3-0.6b --workloads A,E,B,C,D --systems auto,auto@finorm,auto@fa2 \
  --seconds "${1:-3}" --out "$OUT" 2>&1 | grep -v "Warn\|USDT" | tee "$OUT/throughput.log"
