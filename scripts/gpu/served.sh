#!/usr/bin/env bash
# One `scorer serve` replica against its engine on the same calls, side by side in one run, on a
# random Qwen3-0.6B-shaped checkpoint:
#   1. the engine alone: bench.throughput, system auto, on the same workloads (docs/s at
#      saturation, one idle call's p50);
#   2. for each entry of FRONTENDS (default "0 4": one process; four front-end processes; an entry
#      N:LABEL also passes the flags of $ARGS_LABEL, e.g. FRONTENDS="4 4:nocache"
#      ARGS_nocache="--prefix-cache-mib 0", its results named feN-LABEL): the server on cores 4-15,
#      the load tool on 0-3, an open-loop sweep per workload (A and E as token ids with template
#      plain, A-text as the load tool's text calls with the reranker template), then 10% and 80% of
#      each sweep's saturation for p50 and p99, and bench.light_load (one A call at a time, by stage).
#   bash scripts/gpu/served.sh            (~2 min per configuration and workload)
#   env: GPU_TESTS=1 (scripts/gpu/test.sh first), FRONTENDS, WORKLOADS (default "A E A-text"),
#   REQUESTS (calls in each workload's file, default 4000: the load tool cycles through it, so
#   prompts repeat), STEP (seconds per rate, default 5), HTTP=1 (the server also on --http-port 8080,
#   and A-text's calls sent to it as Cohere /v2/rerank too: workload "A-text-cohere"), SWEEP (the
#   rates of every workload's sweep; RATES_A, RATES_E, RATES_A_text: one workload's), ENGINE=0 (no
#   engine run), ENGINE_SYSTEM (the engine's bench.throughput system, default auto; auto@fp8 beside
#   SERVE_ARGS="--quantization fp8"), SERVE_ARGS (more flags for every server), CHANNELS (the load tool's connections,
#   default 4: SO_REUSEPORT puts them on 2-3 of 4 front ends), LIGHT=RATE (light load only: no
#   sweeps, the "10%" runs at RATE calls/s)
#   -> $OUT/served.json, served.md, engine.json, light_load.json, reports.tgz, server-*.log
set -euo pipefail
source scripts/gpu/env.sh
# the load tool's HTTP client (aiohttp) and the server's HTTP stack: only for HTTP=1
if [ "${HTTP:-}" = 1 ]; then use_wheels; fi
[ "${GPU_TESTS:-}" = 1 ] && { SMOKE=0 bash scripts/gpu/test.sh >/dev/null || echo "GPU tests failed" >&2; tail -1 "$OUT/gpu-tests.log"; }
FRONTENDS="${FRONTENDS:-0 4}"
WORKLOADS="${WORKLOADS:-A E A-text}"
STEP="${STEP:-5}"  # 3 s steps stop on the warm server's queue settling: A "saturated" at 500/s, held 582/s in 5 s steps
CKPT=/tmp/ckpt/qwen3-0.6b-random
random_checkpoint "$CKPT"
# steps ~3% apart from 0.87 of the engine's rate on an H200 (A ~612 calls/s, E ~349, A-text ~499;
# with 5% steps E's capacity lay between 0.86 and 0.90 of its engine's)
declare -A RATES=([A]="530,550,570,590,610,630" [E]="315,325,335,345,355,365,375"
  [A-text]="430,450,470,490,510,530" [A-text-cohere]="430,450,470,490,510,530")
for w in $WORKLOADS; do
  # shellcheck disable=SC2086
  python3 -m loadtest.gen --out "/tmp/$w.jsonl" --requests "${REQUESTS:-4000}" --seed 1 ${GEN[$w]} >/dev/null
done
# the warm-up's calls of the first workload, other prompts (seed 2): with the sweep's own, every call
# of the sweep's first seconds would be a second sighting, written to the prefix cache
# shellcheck disable=SC2086
python3 -m loadtest.gen --out /tmp/warm-up.jsonl --requests 2000 --seed 2 ${GEN[${WORKLOADS%% *}]} >/dev/null
cache_w=$(echo "$WORKLOADS" | tr ' ' '\n' | grep -x A-text || true)
plain_w=$(echo "$WORKLOADS" | tr ' ' '\n' | grep -vx A-text | paste -sd, || true)
if [ "${ENGINE:-1}" = 1 ]; then
echo "== engine alone: ${plain_w} ${cache_w}"
python3 -m bench.throughput --out /tmp/engine --models qwen3-0.6b --workloads "$(echo $WORKLOADS | tr ' ' ,)" \
  --systems "${ENGINE_SYSTEM:-auto}" --cache-systems auto --seconds 3 2>&1 | grep -E '^\|' || true
cp /tmp/engine/throughput.json "$OUT/engine.json"
else
  echo '{"records": []}' >"$OUT/engine.json"
fi
if [ -n "${SWEEP:-}" ]; then for w in "${!RATES[@]}"; do RATES[$w]=$SWEEP; done; fi
for w in "${!RATES[@]}"; do  # RATES_A, RATES_E, RATES_A_text: one workload's sweep
  v=RATES_${w//-/_}
  [ -z "${!v:-}" ] || RATES[$w]=${!v}
done

pack() {  # the device returns a handful of files: the load tool's reports travel as one archive
  (cd "$OUT" && shopt -s nullglob && dirs=(fe*/) && [ ${#dirs[@]} -gt 0 ] \
    && tar czf reports.tgz.part "${dirs[@]}" && mv reports.tgz.part reports.tgz) || true  # a run cut short keeps the last whole one
}
finish() {
  [ -n "${pid:-}" ] && kill "$pid" 2>/dev/null || true
  pack
  cd "$OUT" && rm -rf fe*/
}
trap finish EXIT
series=$WORKLOADS
[ "${HTTP:-}" = 1 ] && series="$series A-text-cohere"
COMMON=(--schemes auto --warmup 1 --pause 1 --deadline-ms 2000 --channels "${CHANNELS:-4}" --quiet --no-samples
  --metrics-url http://127.0.0.1:9464/metrics)
names=()
for cfg in $FRONTENDS; do
  fe=${cfg%%:*} label=${cfg#*:}
  [ "$label" = "$cfg" ] && label=
  name=fe$fe${label:+-$label}
  names+=("$name")
  extra=ARGS_$label
  extra=${label:+${!extra}}
  http=()
  [ "${HTTP:-}" = 1 ] && http=(--http-port 8080)
  # shellcheck disable=SC2086
  taskset -c 4-15 python3 -m scorer serve --model "$CKPT" --port 50051 --metrics-port 9464 --frontends "$fe" \
    "${http[@]}" ${SERVE_ARGS:-} $extra >"$OUT/server-$name.log" 2>&1 &
  pid=$!
  python3 scripts/gpu/wait_serving.py $pid || { tail -20 "$OUT/server-$name.log"; exit 1; }
  # a first minute of load runs slower (batch shapes and plans seen for the first time): not measured
  taskset -c 0-3 python3 -m loadtest.run --target 127.0.0.1:50051 --requests /tmp/warm-up.jsonl --rate 300 \
    --duration 6 "${COMMON[@]}" --out /tmp/warm-up >/dev/null 2>&1 || true
  for w in $series; do
    d="$OUT/$name/$w"
    reqs="/tmp/${w%-cohere}.jsonl"
    target=(--target 127.0.0.1:50051)
    [ "$w" = A-text-cohere ] && target=(--api cohere --target 127.0.0.1:8080)
    shares="0.1 0.8"
    if [ -n "${LIGHT:-}" ]; then
      echo "== $name (${SERVE_ARGS:-} $extra), $w: $LIGHT calls/s only"
      shares=0.1
    else
      echo "== $name (${SERVE_ARGS:-} $extra), $w: sweep ${RATES[$w]}"
      taskset -c 0-3 python3 -m loadtest.run "${target[@]}" --requests "$reqs" \
        --sweep "${RATES[$w]}" --duration "$STEP" --stop-when-saturated "${COMMON[@]}" --out "$d/sweep" 2>&1 \
        | grep -v '^report:' || true
    fi
    for share in $shares; do
      rate=${LIGHT:-$(python3 scripts/gpu/served.py share "$d/sweep" $share)}
      taskset -c 0-3 python3 -m loadtest.run "${target[@]}" --requests "$reqs" \
        --rate "$rate" --duration 5 "${COMMON[@]}" --out "$d/at-$share" 2>&1 | grep -v '^report:' || true
      python3 scripts/gpu/served.py p50 "$d/at-$share" || true
    done
    python3 -c 'import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1]).read().decode())' \
      http://127.0.0.1:9464/metrics >"$d/metrics.txt" 2>/dev/null || true  # the server's own counts: batch sizes, stages
    pack
  done
  # a call's time by stage at light load, one at a time (bench.light_load): where p50 at 10% goes
  [ -f /tmp/A.jsonl ] && taskset -c 0-3 timeout 60 python3 -m bench.light_load --requests /tmp/A.jsonl \
    --gap-ms 0,20 --calls 80 --label "$name" --out "$OUT" || true
  kill -TERM $pid && wait $pid || echo "server exit code $?" >&2
  pid=
done
python3 scripts/gpu/served.py summary "$OUT" "${names[@]}" | tee "$OUT/served.md" || true
