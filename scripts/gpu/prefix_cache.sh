#!/usr/bin/env bash
# The prefix cache:
#   bash scripts/gpu/prefix_cache.sh engine [seconds]   GPU tests, then bench.throughput: cache on
#       against off on D-repeat, B-repeat and A-text, and A (no cache)                   (~3 min)
#   bash scripts/gpu/prefix_cache.sh served [seconds]   D-repeat through the load tool (--prompt-reuse
#       50) against scorer serve with the cache (auto) and without (--prefix-cache-mib 0)  (~3 min)
#   bash scripts/gpu/prefix_cache.sh states   the serving engine's docs/s on batches of 3 and 11 E
#       calls by what the cache does with their prompts (off, new, insert, hit; cache_probe.py) (~2 min)
#   bash scripts/gpu/prefix_cache.sh hits     small A and A-text batches: a hit read against its prompt
#       computed, and the serving default's rule (hit_probe.py)                            (~4 min)
source scripts/gpu/env.sh
SECS="${2:-4}"
case "$1" in
engine)
  python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider -x 2>&1 | tail -25 | tee "$OUT/gpu-tests.log"
  python3 -m bench.throughput --models qwen3-0.6b --workloads "${WORKLOADS:-A,D-repeat,B-repeat,A-text}" --systems auto \
    --seconds "$SECS" --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/throughput.md"
  ;;
served)
  CKPT=/tmp/ckpt/qwen3-0.6b-random
  random_checkpoint "$CKPT"
  python3 -m loadtest.gen --out /tmp/drep.jsonl --requests 1000 --docs 32 --prompt-tokens 8000 \
    --doc-tokens fixed:4 --token-ids --prompt-reuse 50 --template plain --seed 3
  for cfg in cache nocache; do
    extra=()
    rates=100,200,300,400,600,800
    [ "$cfg" = nocache ] && extra=(--prefix-cache-mib 0) && rates=10,20,30,40,60
    taskset -c 4-15 python3 -m scorer serve --model "$CKPT" --port 50051 --metrics-port 9464 "${extra[@]}" \
      >"$OUT/server-$cfg.log" 2>&1 &
    pid=$!
    python3 scripts/gpu/wait_serving.py $pid || { tail -20 "$OUT/server-$cfg.log"; kill $pid; exit 1; }
    taskset -c 0-3 python3 -m loadtest.run --target 127.0.0.1:50051 --requests /tmp/drep.jsonl \
      --sweep "$rates" --schemes auto --duration "$SECS" --warmup 1 --pause 1 --deadline-ms 2000 \
      --stop-when-saturated --quiet --no-samples --metrics-url http://127.0.0.1:9464/metrics \
      --out "$OUT/drepeat-$cfg" 2>&1 | tail -12
    curl -s http://127.0.0.1:9464/metrics | grep -E "^scorer_prefix_cache" > "$OUT/drepeat-$cfg/prefix_cache_metrics.txt"
    kill -TERM $pid
    wait $pid
  done
  (cd "$OUT" && tar czf drepeat.tgz drepeat-* && rm -r drepeat-*/)
  ;;
states)
  random_checkpoint /tmp/ckpt/qwen3-0.6b-random
  CALLS="${CALLS:-3,11}" STATES="${STATES:-off,new,insert,hit}" \
    python3 scripts/gpu/cache_probe.py /tmp/ckpt/qwen3-0.6b-random "$OUT/cache_probe.json" 40 2 2>&1 | tail -20
  ;;
hits)
  random_checkpoint /tmp/ckpt/qwen3-0.6b-random && mkdir -p /tmp/hits
  for w in A A-text; do
    # shellcheck disable=SC2086
    python3 -m loadtest.gen --out "/tmp/hits/$w.jsonl" --requests 800 --seed 3 ${GEN[$w]} >/dev/null
  done
  timeout 300 python3 scripts/gpu/hit_probe.py /tmp/ckpt/qwen3-0.6b-random "$OUT/hit_probe.json" \
    /tmp/hits/A.jsonl /tmp/hits/A-text.jsonl 2>&1 | tail -20
  ;;
*) echo "usage: $0 engine|served|states|hits [seconds]" >&2; exit 2 ;;
esac
