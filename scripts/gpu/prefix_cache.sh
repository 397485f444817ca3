#!/usr/bin/env bash
# The prefix cache:
#   bash scripts/gpu/prefix_cache.sh engine [seconds]   GPU tests, then bench.throughput: cache on
#       against off on D-repeat, B-repeat and A-text, and A (no cache)                   (~3 min)
#   bash scripts/gpu/prefix_cache.sh served [seconds]   the long repeated prompt (8,000 prompt ids + 32
#       docs of 4 ids, each prompt reused by 10 calls in a row) through the load tool against scorer
#       serve (defaults) with the cache and without (--prefix-cache-mib 0), rates swept past
#       saturation; $OUT/drepeat_summary.json: docs/s at the best rate with p99 <= 100 ms, both
#       configurations, and their ratio; CACHE_ARGS: more flags for the cached server; CONFIGS="cache admit2
#       nocache" adds a cached server with --prefix-cache-admit 2 (drepeat_admit2_summary.json), "nocut"
#       one with FIFO cuts (--cut-before-heavy 0), "cut" one with --cut-before-heavy $CUT (~4 min)
#   bash scripts/gpu/prefix_cache.sh profile [seconds]   the cached server of `served` at RATES (default
#       140,180 calls/s): the load tool's stage means and batches, and the GPU's busy share (nvidia-smi,
#       every 50 ms): where the replica's time goes at its knee; STACKS=1 also samples the server's
#       threads' stacks (stacks_summary.txt)                                                 (~2 min)
#   bash scripts/gpu/prefix_cache.sh states   the serving engine's docs/s on batches of 3 and 11 E
#       calls by what the cache does with their prompts (off, new, insert, hit; cache_probe.py) (~2 min)
#   bash scripts/gpu/prefix_cache.sh hits     small A and A-text batches: a hit read against its prompt
#       computed, and the serving default's rule (hit_probe.py)                            (~4 min)
source scripts/gpu/env.sh
SECS="${2:-4}"

profile_drepeat() {  # CKPT SECS: the cached server at each of RATES, its GPU sampled while it runs
  read -ra extra <<< "${CACHE_ARGS:-}"
  # STACKS=1: the server's threads sampled every 2 ms (scorer/server/stacks.py), summarized at the end
  [ "${STACKS:-0}" = 1 ] && export SCORER_STACK_SAMPLES="$OUT/stacks.txt"
  taskset -c 4-15 python3 -m scorer serve --model "$1" --port 50051 --metrics-port 9464 "${extra[@]}" \
    >"$OUT/server-profile.log" 2>&1 &
  local pid=$! r smi
  python3 scripts/gpu/wait_serving.py $pid || { tail -20 "$OUT/server-profile.log"; kill $pid; return 1; }
  local rates="${RATES:-140,180}"
  for r in ${rates//,/ }; do
    nvidia-smi --query-gpu=utilization.gpu --format=csv,noheader,nounits -lms 50 >"$OUT/util-$r.txt" &
    smi=$!
    taskset -c 0-3 python3 -m loadtest.run --target 127.0.0.1:50051 --requests /tmp/drep.jsonl \
      --rate "$r" --schemes auto --duration "$2" --warmup 1 --deadline-ms 2000 --quiet --no-samples \
      --metrics-url http://127.0.0.1:9464/metrics --out "$OUT/profile-$r" 2>&1 | tail -3
    kill $smi
    grep -h "On the server" "$OUT/profile-$r/report.md"
    awk '{s+=$1; n++} END {printf "GPU busy (nvidia-smi, 50 ms samples): %.1f%% mean over %d samples\n", s/n, n}' \
      "$OUT/util-$r.txt"
  done
  kill -TERM $pid
  wait $pid
  [ -f "$OUT/stacks.txt" ] && python3 scripts/gpu/stacks_summary.py "$OUT/stacks.txt" 15 | tee "$OUT/stacks_summary.txt"
  (cd "$OUT" && tar czf profile.tgz profile-*/ util-*.txt && rm -r profile-*/ util-*.txt)
}
case "$1" in
engine)
  python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider -x 2>&1 | tail -25 | tee "$OUT/gpu-tests.log"
  python3 -m bench.throughput --models qwen3-0.6b --workloads "${WORKLOADS:-A,D-repeat,B-repeat,A-text}" --systems auto \
    --seconds "$SECS" --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/throughput.md"
  ;;
served | profile)
  CKPT=/tmp/ckpt/qwen3-0.6b-random
  random_checkpoint "$CKPT"
  # bench/host_path.py's LONG_GEN: the workload the CPU's host-path benchmarks run
  python3 -m loadtest.gen --out /tmp/drep.jsonl --requests 1000 --docs 32 --prompt-tokens 8000 \
    --doc-tokens fixed:4 --token-ids --prompt-reuse 10 --template plain --seed 3
  if [ "$1" = profile ]; then
    profile_drepeat "$CKPT" "$SECS"
    exit $?
  fi
  for cfg in ${CONFIGS:-cache nocache}; do
    read -ra extra <<< "${CACHE_ARGS:-}"  # e.g. CACHE_ARGS="--prefix-cache-admit 1"
    rates="${CACHE_RATES:-60,100,130,145,160,175,190,220,260}"  # fine near the ~145 calls/s knee
    [ "$cfg" = admit2 ] && extra=(--prefix-cache-admit 2)
    [ "$cfg" = cut ] && extra=(--cut-before-heavy "${CUT:-4}")
    [ "$cfg" = nocut ] && extra=(--cut-before-heavy 0)
    [ "$cfg" = nocache ] && extra=(--prefix-cache-mib 0) && rates="${NOCACHE_RATES:-16,18,20,22,24,26,28}"
    taskset -c 4-15 python3 -m scorer serve --model "$CKPT" --port 50051 --metrics-port 9464 "${extra[@]}" \
      >"$OUT/server-$cfg.log" 2>&1 &
    pid=$!
    python3 scripts/gpu/wait_serving.py $pid || { tail -20 "$OUT/server-$cfg.log"; kill $pid; exit 1; }
    taskset -c 0-3 python3 -m loadtest.run --target 127.0.0.1:50051 --requests /tmp/drep.jsonl \
      --sweep "$rates" --schemes auto --duration "$SECS" --warmup 1 --pause 1 --deadline-ms 2000 \
      --stop-when-saturated --slo-p99-ms 100 --quiet --no-samples --metrics-url http://127.0.0.1:9464/metrics \
      --out "$OUT/drepeat-$cfg" 2>&1 | tail -12
    curl -s http://127.0.0.1:9464/metrics | grep -E "^scorer_prefix_cache" > "$OUT/drepeat-$cfg/prefix_cache_metrics.txt"
    kill -TERM $pid
    wait $pid
  done
  python3 scripts/gpu/served_summary.py "$OUT/drepeat-cache" "$OUT/drepeat-nocache" "$OUT/drepeat_summary.json"
  for cfg in admit2 cut nocut; do
    [ -d "$OUT/drepeat-$cfg" ] && python3 scripts/gpu/served_summary.py "$OUT/drepeat-$cfg" "$OUT/drepeat-nocache" \
      "$OUT/drepeat_${cfg}_summary.json"
  done
  (cd "$OUT" && tar czf drepeat.tgz drepeat-*/ && rm -r drepeat-*/)
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
