#!/usr/bin/env bash
# Where a served call's host time goes: one `scorer serve` replica (random Qwen3-0.6B-shaped
# checkpoint, as sweep.sh) under py-spy while the load tool holds workload A (token ids, 300-token
# prompt + 10 x 50-token docs, template plain) at RATE calls/s, open loop; py-spy samples every
# thread of the server (and its front-end processes, --subprocesses) for SECONDS.
#   bash scripts/gpu/profile_serve.sh [rate] [seconds] [extra scorer serve flags...]
#   device: carry [".gpu", ".wheels"] -> $OUT/pyspy-top.txt (self time by function), load.txt
# GPU_TESTS=1 runs the GPU tests first (scripts/gpu/test.sh).
set -euo pipefail
source scripts/gpu/env.sh
use_wheels
RATE="${1:-400}"
SECONDS_="${2:-10}"
shift 2 || true
[ "${GPU_TESTS:-}" = 1 ] && { bash scripts/gpu/test.sh || echo "GPU tests failed" >&2; }
CKPT=/tmp/ckpt/qwen3-0.6b-random
random_checkpoint "$CKPT"
python3 -m loadtest.gen --out /tmp/a-ids.jsonl --requests 4000 --docs 10 --prompt-tokens 300 \
  --doc-tokens fixed:50 --seed 1 --token-ids --template plain >/dev/null
taskset -c 4-15 python3 -m scorer serve --model "$CKPT" --port 50051 --metrics-port 9464 "$@" \
  >"$OUT/server.log" 2>&1 &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
python3 scripts/gpu/wait_serving.py $pid || { tail -20 "$OUT/server.log"; exit 1; }
taskset -c 0-3 python3 -m loadtest.run --target 127.0.0.1:50051 --requests /tmp/a-ids.jsonl --schemes auto \
  --rate "$RATE" --duration $((SECONDS_ + 4)) --warmup 1 --deadline-ms 2000 --channels 4 --quiet --no-samples \
  --out /tmp/load >"$OUT/load.txt" 2>&1 &
load=$!
sleep 3
pyspy_top $pid "$SECONDS_"
wait $load || true
cat "$OUT/pyspy-top.txt"
kill -TERM $pid && wait $pid || true
