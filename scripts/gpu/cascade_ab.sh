#!/usr/bin/env bash
# Cascade (the shared level of each prompt's docs against its prompt, one dense call) beside
# ragged and auto on the long-prompt workloads, full batches, one run: 0.6B on B and C, 8B on B
# (~2 minutes).   bash scripts/gpu/cascade_ab.sh  -> $OUT/cascade.json, $OUT/cascade_8b.json
source scripts/gpu/env.sh
python3 -m bench.throughput --models qwen3-0.6b --workloads B,C --systems auto,ragged,cascade --seconds 2 \
  --out /tmp/cascade 2>&1 | grep -v "Warning\|warn_once" | grep '^|'
cp /tmp/cascade/throughput.json "$OUT/cascade.json"
python3 -m bench.throughput --models qwen3-8b --workloads B --systems auto,cascade --seconds 2 \
  --out /tmp/cascade8 2>&1 | grep -v "Warning\|warn_once" | grep '^|'
cp /tmp/cascade8/throughput.json "$OUT/cascade_8b.json"
