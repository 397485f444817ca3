#!/usr/bin/env bash
# Issue 11's light-load median, by stage: the idle engine (bench.throughput, workload A: back to
# back and 20 ms apart), then `scorer serve` in each of CONFIGS (name=flags), probed one call at a
# time (bench.light_load: the answer's own queue/tokenize/forward beside the client's latency) with
# 0 and 20 ms between calls, on cores 4-15 as served.sh; the SM clock sampled while it runs.
#   bash scripts/gpu/light_load.sh      device: carry [".gpu", ".wheels"]
#   env: GPU_TESTS=1 (scripts/gpu/test.sh first), ENGINE=0 (no engine run), CONFIGS ("" for none),
#   PROBE=0 (no idle_probe.py), PROFILE=1 (launch_profile.py: cProfile of one call's launch)
#   -> $OUT/light_load.json, light_load.md, engine.json, clocks.csv, server-*.log
set -euo pipefail
source scripts/gpu/env.sh
use_wheels
[ "${GPU_TESTS:-}" = 1 ] && { bash scripts/gpu/test.sh >/dev/null || echo "GPU tests failed" >&2; tail -1 "$OUT/gpu-tests.log"; }
CKPT=/tmp/ckpt/qwen3-0.6b-random
random_checkpoint "$CKPT"
python3 -m loadtest.gen --out /tmp/A.jsonl --requests 400 --seed 1 --docs 10 --prompt-tokens 300 \
  --doc-tokens fixed:50 --token-ids --template plain >/dev/null
CONFIGS=${CONFIGS-"fe0=--frontends 0;fe0-nocache=--frontends 0 --prefix-cache-mib 0;fe4=--frontends 4"}
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu --format=csv -lms 200 \
  >"$OUT/clocks.csv" &
smi=$!
trap 'kill $smi ${pid:-} 2>/dev/null || true' EXIT
if [ "${ENGINE:-1}" = 1 ]; then
  timeout 150 python3 -m bench.throughput --out /tmp/engine --models qwen3-0.6b --workloads A --systems auto \
    --seconds 2 2>&1 | grep -E '^\|' || true
  cp /tmp/engine/throughput.json "$OUT/engine.json" || true
fi
IFS=';' read -ra configs <<<"$CONFIGS"
for c in "${configs[@]}"; do
  name=${c%%=*}
  # shellcheck disable=SC2086
  taskset -c 4-15 python3 -m scorer serve --model "$CKPT" --port 50051 --metrics-port 9464 ${c#*=} \
    >"$OUT/server-$name.log" 2>&1 &
  pid=$!
  python3 scripts/gpu/wait_serving.py $pid --seconds 120 || { tail -20 "$OUT/server-$name.log"; continue; }
  echo "== $name $(date +%T)"
  taskset -c 0-3 timeout 60 python3 -m bench.light_load --requests /tmp/A.jsonl --gap-ms 0,20 --calls 80 \
    --label "$name" --out "$OUT" | tee -a "$OUT/light_load.md"
  kill -TERM $pid && wait $pid || true
  pid=
done
if [ "${PROFILE:-}" = 1 ]; then
  taskset -c 4-15 timeout 120 python3 scripts/gpu/launch_profile.py "$CKPT" /tmp/A.jsonl "$OUT" 2>&1 | grep -v Warn | tail -2
fi
if [ "${PROBE:-1}" = 1 ]; then
  cat /sys/devices/system/cpu/cpu0/cpufreq/scaling_governor 2>/dev/null || echo "no cpufreq governor"
  { ls /sys/devices/system/cpu/cpu0/cpuidle; grep MHz /proc/cpuinfo | head -4; } 2>&1 || true
  taskset -c 4-15 timeout 200 python3 scripts/gpu/idle_probe.py "$CKPT" /tmp/A.jsonl "$OUT/idle_probe.json" \
    2>&1 | grep -v Warn | tail -80 | python3 -c "
import json, sys
for line in sys.stdin:
    try: r = json.loads(line)
    except ValueError: print(line, end=''); continue
    print(f\"{r['variant']:18} cache={r['cache']!s:5} gap={r['gap_ms']:4.0f} spin={r['spin']!s:5} hops={r['hops']!s:5} launch {r['launch_ms']:5.2f} total {r['total_ms']:5.2f}\")"
fi
