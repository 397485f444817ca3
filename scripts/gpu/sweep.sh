#!/usr/bin/env bash
# Capacity of one H200 replica serving a Qwen3-0.6B-shaped random checkpoint (28 layers, bf16):
# the serving configuration (piecewise CUDA graphs, fused kernels) against session 1's (eager,
# HF op order), both with scheme=auto, one open-loop sweep each. Server on cores 4-15, load
# generator on cores 0-3.   bash scripts/gpu/sweep.sh [rates] [seconds per step] [configs]
source scripts/gpu/env.sh
RATES="${1:-50,100,200,300,400,600}"
STEP="${2:-5}"
CKPT=/tmp/ckpt/qwen3-0.6b-random
random_checkpoint "$CKPT"
python3 -m loadtest.gen --out /tmp/reqs.jsonl --requests 2000 --docs 20 --prompt-tokens 200 \
  --doc-tokens lognormal:60:0.5:256 --token-ids --seed 1
for cfg in ${3:-serving eager}; do
  extra=()
  [ "$cfg" = eager ] && extra=(--cuda-graph-max-tokens 0 --model-kernels torch)
  taskset -c 4-15 python3 -m scorer serve --model "$CKPT" --port 50051 --metrics-port 9464 "${extra[@]}" \
    >"$OUT/server-$cfg.log" 2>&1 &
  pid=$!
  python3 scripts/gpu/wait_serving.py $pid || { tail -20 "$OUT/server-$cfg.log"; kill $pid; exit 1; }
  taskset -c 0-3 python3 -m loadtest.run --target 127.0.0.1:50051 --requests /tmp/reqs.jsonl \
    --sweep "$RATES" --schemes auto --duration "$STEP" --warmup 1 --pause 1 --deadline-ms 2000 \
    --stop-when-saturated --quiet --no-samples --metrics-url http://127.0.0.1:9464/metrics --out "$OUT/sweep-$cfg" \
    2>&1 | tail -15
  kill -TERM $pid
  wait $pid
done
# the device returns a handful of files: the reports and plots travel as one archive
(cd "$OUT" && tar czf sweeps.tgz sweep-* && rm -r sweep-*/)
