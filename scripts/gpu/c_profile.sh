#!/usr/bin/env bash
# C by kernel with long docs' attention on FA3 over gathered keys (auto) and paged (auto/nomat).
#   bash scripts/gpu/c_profile.sh   -> $OUT/kernel_profile.json, kernel_profile.log
source scripts/gpu/env.sh
python3 -m bench.kernel_profile --model qwen3-0.6b --workloads "${WORKLOADS:-C}" --attention auto,auto/nomat \
  --batches 8 --out "$OUT" 2>&1 | grep -v "Warning\|USDT" | tee "$OUT/kernel_profile.log" | grep -A14 "^qwen3\|kernel | ms" | head -90
