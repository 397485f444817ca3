#!/usr/bin/env bash
# Ray Serve against `scorer serve` on one GPU. Ray from the installed packages (pip install -e
# '.[gpu,ray]'), or from the offline kit's archive unpacked into $RAY_SITE (default /tmp/ray-site)
# by scripts/gpu/ray_unpack.sh less than 30 s before, where that folder exists.
# One Ray Serve replica (num_gpus 1, FlashInfer, CUDA graphs, fused kernels) behind each of Ray's
# ingresses of CONFIGS against `scorer serve` on the same checkpoint and the same calls, in this one run:
#   1. capacity sweeps (open loop, rates x1.08 apart or RATE_STEP, STEP s each) and p50/p99 at 10% of
#      `scorer serve`'s capacity, workloads A (300-token prompt + 10 x 50-token docs, token ids)
#      and E (200 + 20 x 60), first `scorer serve`, then Ray in each configuration:
#        proxy    Serve's Python gRPC proxy, calling the replica over gRPC (Serve's own
#                 default)
#        haproxy  scorer.ray_serve.RAY_ENV: Ray's HAProxy ingress in front of the replica's own
#                 gRPC server (direct ingress), RAY_SERVE_THROUGHPUT_OPTIMIZED's switches
#        haproxy-xN  the same with N replicas sharing the GPU (num_gpus 1/N each, an engine process
#                 each): more host processes for the calls, the GPU time-sliced between them
#        shared-xN  the same ingress, engine_process=shared: N Scorer replicas (front ends, no GPU)
#                 joining one Engine replica (num_gpus 1) whose engine process batches all their calls
#   2. the fault run, on the last configuration: Ray at 50% of its capacity on E, the replica's
#      process SIGKILLed after KILL_AT s (with shared-xN, the Engine replica's: FAULT_DEPLOYMENT=Scorer
#      kills a front end instead); the load tool's per-second timeline shows the dip and
#      the recovery;
#   3. the HTTP rerank routes (Cohere, Jina, TEI shapes) through that configuration's HTTP
#      ingress, once each.
# Writes $OUT/ray_bench.md (the tables), reports.tgz (every load-tool report), serve.log.gz,
# ray-CONFIG.log.gz (scorer.ray_local's output) and ray-logs-CONFIG.tgz (the replicas' logs).
#   bash scripts/gpu/ray_bench.sh            (about 8 minutes; fails at the first error)
#   FAULT_ONLY=150 bash scripts/gpu/ray_bench.sh   (Ray alone: the fault run at 150 calls/s, then HTTP)
#   SKIP_FAULT=1 (no fault run)
# Ray's own knobs pass through the environment to every Ray process, e.g. the proxy's:
#   RAY_SERVE_PROXY_USE_GRPC=0 CONFIGS=proxy bash scripts/gpu/ray_bench.sh   (Ray's actor calls instead of scorer.ray_serve.RAY_ENV)
source scripts/gpu/env.sh
set -euo pipefail
SITE="${RAY_SITE:-/tmp/ray-site}"
if [ -d "$SITE/ray" ]; then
  # Ray's workers inherit it from the driver that starts Ray; absolute: they need not start in $PWD
  export PYTHONPATH="$PWD:$PYTHONPATH:$SITE"
else
  python3 -c "import ray.serve" 2>/dev/null || { echo "no Ray: pip install -e '.[gpu,ray]'" >&2; exit 1; }
  export PYTHONPATH="$PWD:$PYTHONPATH"
fi
STEP="${STEP:-3}"
KILL_AT="${KILL_AT:-15}"
FAULT_S="${FAULT_S:-75}"  # a new replica (process, engine process, model, graphs) took 41 s on an H200
SERVER_CORES="${SERVER_CORES:-4-15}"
LOAD_CORES="${LOAD_CORES:-0-3}"
CKPT="${CKPT:-/tmp/ckpt/qwen3-0.6b-random}"
RATES_A="${RATES_A:-400:640}"  # first:last calls/s of the sweep (scorer serve on an H200: ~590 and ~330)
RATES_E="${RATES_E:-200:380}"
CONFIGS="${CONFIGS:-proxy haproxy}"
config_env() {  # CONFIG: its Ray switches, VAR=VALUE ... (over scorer.ray_serve.RAY_ENV, which ray_local sets)
  case "$1" in
    proxy) echo RAY_SERVE_ENABLE_HA_PROXY=0 RAY_SERVE_THROUGHPUT_OPTIMIZED=0 ;;
    haproxy | haproxy-x[0-9]* | shared-x[0-9]*) ;;
    *) echo "unknown Ray configuration $1" >&2; exit 1 ;;
  esac
}
config_replicas() {  # CONFIG: ray_local's replica flags and application arguments
  case "$1" in
    haproxy-x[0-9]*) local n=${1#haproxy-x}; echo "--replicas $n --num-gpus $(python3 -c "print(1 / $n)")" ;;
    shared-x[0-9]*) echo "--replicas ${1#shared-x} --num-gpus 1 engine_process=shared" ;;
    *) echo "--num-gpus 1" ;;
  esac
}
fault_deployment() {  # CONFIG: whose process the fault run kills (the replica that holds the GPU)
  case "$1" in
    shared-x[0-9]*) echo "${FAULT_DEPLOYMENT:-Engine}" ;;
    *) echo Scorer ;;
  esac
}
R=/tmp/ray-bench/reports  # archived into $OUT/reports.tgz after each report (the tool returns 8 files)
rm -rf "$R" && mkdir -p "$R"
METRICS=http://127.0.0.1:9464/metrics  # scorer serve's, then the replica's (both --metrics-port 9464)
CKPT="$CKPT" bash scripts/gpu/ray_inputs.sh >/dev/null  # unless run 1 wrote them

rates() { python3 -c "
lo, hi = map(float, '$1'.split(':'))
out = []
while lo <= hi * 1.0001:
    out.append(f'{lo:.0f}'); lo *= ${RATE_STEP:-1.08}
print(','.join(out))"; }
share() {  # NAME FRACTION: that fraction of the sweep NAME's capacity, in calls/s
  python3 -c "
import json, sys
cap = json.load(open('$R/$1/report.json'))['capacity']['auto']['achieved_rps']
sys.exit('$1: every rate of the sweep saturated: start its RATES_ lower') if cap is None else None
print(round($2 * cap, 1))"
}

wait_serving() {  # TARGET PID LOG: until grpc.health.v1 says SERVING (the process must stay alive)
  python3 scripts/gpu/wait_serving.py "$2" --target "$1" --service scorer.v1.Scorer --seconds 300 \
    || { tail -40 "$3"; exit 1; }
}

load() {  # NAME TARGET REQUESTS ARGS...: one load-tool report in $R/NAME
  local name=$1 target=$2 reqs=$3
  shift 3
  taskset -c "$LOAD_CORES" python3 -m loadtest.run --target "$target" --requests "$reqs" --schemes auto \
    --deadline-ms 2000 --quiet --out "$R/$name" "$@" 2>&1 | grep -v "^report:" | tail -25
  [ -f "$R/$name/report.json" ] || { echo "no report for $name" >&2; exit 1; }
  tar czf "$OUT/reports.tgz" --exclude='*.png' -C "$(dirname "$R")" reports  # kept if a timeout kills the run
}

measure() {  # SYSTEM TARGET: a warm-up, both sweeps, then 10% of scorer serve's capacity
  # a first minute of load runs slower (batch shapes and plans seen for the first time; a sweep
  # once stopped at its second rate on it): not measured
  taskset -c "$LOAD_CORES" python3 -m loadtest.run --target "$2" --requests /tmp/A.jsonl --rate "${WARM_RATE:-250}" \
    --duration 6 --schemes auto --deadline-ms 2000 --quiet --no-samples --out /tmp/warm-up >/dev/null 2>&1 || true
  for w in A E; do
    local span=RATES_$w
    load "$1-$w" "$2" "/tmp/$w.jsonl" --metrics-url "$METRICS" --sweep "$(rates "${!span}")" \
      --duration "$STEP" --warmup 0.5 --pause 0.5 --stop-when-saturated --no-samples
  done
  for w in A E; do
    local low
    local given=LOW_$w
    low=${!given:-$(share "serve-$w" 0.1)}  # LOW_A / LOW_E: 10% of a scorer serve measured earlier
    load "$1-$w-low" "$2" "/tmp/$w.jsonl" --metrics-url "$METRICS" --rate "$low" --duration 5 \
      --warmup 1 --no-samples
  done
}

serve_pid= ray_pid=
stop_ray() {  # Ctrl-C to scorer.ray_local, then the replicas' logs (.err) into ray-logs.tgz
  [ -n "$ray_pid" ] || return 0
  kill -INT "$ray_pid" 2>/dev/null && timeout 90 tail --pid="$ray_pid" -f /dev/null || true
  ray_pid=
  local logs=/tmp/ray/session_latest/logs
  tar czf "$OUT/ray-logs-$ray_cfg.tgz" -C $logs $(cd $logs && ls worker-*.err) || true
}
finish() {  # also on failure: no server left running, at most a handful of files in $OUT
  [ -z "$serve_pid" ] || kill "$serve_pid" 2>/dev/null || true
  (cd "$OUT" && gzip -f serve.log ray-*.log 2>/dev/null) || true  # first: stopping Ray can outlast a timeout
  stop_ray
}
trap finish EXIT
trap 'exit 143' TERM  # a timeout still leaves the reports in $OUT

# 1a. scorer serve  (SKIP_SERVE=1 with LOW_A and LOW_E: Ray alone, against a serve run of an earlier call)
if [ -z "${SKIP_SERVE:-}" ] && [ -z "${FAULT_ONLY:-}" ]; then
taskset -c "$SERVER_CORES" python3 -m scorer serve --model "$CKPT" --port 50051 --metrics-port 9464 \
  >"$OUT/serve.log" 2>&1 &
serve_pid=$!
wait_serving 127.0.0.1:50051 $serve_pid "$OUT/serve.log"
measure serve 127.0.0.1:50051
kill -TERM $serve_pid
wait $serve_pid || true
serve_pid=
fi

# 1b. Ray Serve in each configuration: a local Ray, one replica with the GPU, the ingress on the same cores
start_ray() {  # CONFIG
  ray_cfg=$1
  # shellcheck disable=SC2046
  env $(config_env "$1") taskset -c "$SERVER_CORES" python3 -m scorer.ray_local $(config_replicas "$1") --num-cpus 12 \
    --quiet --grpc-port 9000 --http-port 8000 --metrics-port 9464 --ray-metrics-port 9470 model="$CKPT" \
    >"$OUT/ray-$1.log" 2>&1 &
  ray_pid=$!
  for _ in $(seq 300); do  # READY: Serve runs, the replica is up (its metrics port is known)
    grep -q "^READY" "$OUT/ray-$1.log" && break
    kill -0 $ray_pid 2>/dev/null || { tail -40 "$OUT/ray-$1.log"; exit 1; }
    sleep 1
  done
  grep "^READY" "$OUT/ray-$1.log" || { tail -40 "$OUT/ray-$1.log"; exit 1; }
  wait_serving 127.0.0.1:9000 $ray_pid "$OUT/ray-$1.log"
}
ray_cfg=
last=${CONFIGS##* }
for cfg in $CONFIGS; do
  start_ray "$cfg"
  [ -n "${FAULT_ONLY:-}" ] || measure "ray-$cfg" 127.0.0.1:9000
  [ "$cfg" = "$last" ] || stop_ray
done
half=${FAULT_ONLY:-$(share "ray-$last-E" 0.5)}

if [ -z "${SKIP_FAULT:-}" ]; then
# 2. the fault run
victim=$(fault_deployment "$last")
replica=$(pgrep -f "^ray::ServeReplica:scorer:$victim" | head -1)
[ -n "$replica" ] || { echo "no $victim replica process found" >&2; exit 1; }
# calls answered by the replica of port 9464, or computed by it (a shared engine's replica)
calls() { python3 -c "
import urllib.request
text = urllib.request.urlopen('$METRICS', timeout=5).read().decode()
count = lambda name: sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(name))
print(int(max(count('scorer_requests_total{'), count('scorer_batch_requests_sum'))))"; }
before=$(calls)
(
  for _ in $(seq 300); do  # until the load tool's first call is in (60 s at most)
    [ "$(calls || echo 0)" -gt "$before" ] && break
    sleep 0.2
  done
  sleep "$KILL_AT" && kill -9 "$replica" && echo "killed $victim replica pid $replica ${KILL_AT} s after the first call"
) &
killer=$!
# no --metrics-url: the replica's counts die with it
load "ray-$last-E-fault" 127.0.0.1:9000 /tmp/E.jsonl --rate "$half" --duration "$FAULT_S"
wait $killer
new=$(pgrep -f "^ray::ServeReplica:scorer:$victim" | head -1)
[ -n "$new" ] && [ "$new" != "$replica" ] || { echo "Serve started no new $victim replica" >&2; exit 1; }
wait_serving 127.0.0.1:9000 $ray_pid "$OUT/ray-$last.log"  # the new replica serves (if the run ended first)
fi

# 3. the HTTP routes through Serve's HTTP proxy (SKIP_HTTP=1: not)
[ -n "${SKIP_HTTP:-}" ] || for api in cohere jina tei; do
  load "ray-$last-http-$api" http://127.0.0.1:8000/scorer /tmp/A-text.jsonl --metrics-url "$METRICS" \
    --api "$api" --rate 10 --duration 3 --no-samples
done
stop_ray

# the tables: side by side, the fault run's timeline
python3 - "$R" "$KILL_AT" "$last" "$(fault_deployment "$last")" $CONFIGS >"$OUT/ray_bench.md" <<'PY'
import json, os, sys
from pathlib import Path

r, kill_at, last, victim, configs = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]
rep = lambda name: json.loads((r / name / "report.json").read_text())
ms = lambda v: "-" if v is None else f"{v * 1e3:.1f}"
for cfg in configs:
    log = Path(os.environ["OUT"]) / f"ray-{cfg}.log"
    ready = [x for x in log.read_text().splitlines() if x.startswith("READY")] if log.exists() else []
    print(f"Ray, {cfg}: `{ready[0] if ready else 'never READY'}`\n")
print("| workload | system | capacity calls/s | p50 / p99 ms at capacity | p50 / p99 ms at 10% of serve's |")
print("|---|---|---:|---:|---:|")
for w in "AE":
    caps = {}
    for system in ("serve", *(f"ray-{c}" for c in configs)):
        if not (r / f"{system}-{w}").exists():  # SKIP_SERVE=1
            caps[system] = None
            continue
        sweep, low = rep(f"{system}-{w}"), rep(f"{system}-{w}-low")
        cap = sweep["capacity"]["auto"]["achieved_rps"]
        caps[system] = cap
        best = max((x for x in sweep["runs"] if not x["saturation"]["saturated"]),
                   key=lambda x: x["achieved_rps"], default=None)
        at = best["latency_seconds"] if best else {"p50": None, "p99": None}
        lo = low["latency_seconds"]
        print(f"| {w} | {system} | {cap or 0:.1f} | {ms(at['p50'])} / {ms(at['p99'])} | "
              f"{ms(lo['p50'])} / {ms(lo['p99'])} |")
    for c in configs:
        if caps["serve"] and caps[f"ray-{c}"]:
            print(f"| {w} | ray-{c} / serve | {caps[f'ray-{c}'] / caps['serve']:.2f} | | |")
if (r / f"ray-{last}-E-fault").exists():  # not with SKIP_FAULT=1
    fault = rep(f"ray-{last}-E-fault")
    print(f"\nFault run, ray-{last}: {fault['offered_rps']:.0f} calls/s offered on E (50% of Ray's capacity), "
          f"the {victim} replica SIGKILLed {kill_at} s after its first call; calls {fault['requests']}, by code "
          f"{fault['by_code']}\n")
    for code, msg in fault.get("error_examples", {}).items():
        print(f"- `{code}`: {msg[:160]}")
    print("\n| t s | sent | ok | failed | p50 ms | p99 ms |\n|---:|---:|---:|---:|---:|---:|")
    for t in fault["runs"][0]["timeline"]:
        print(f"| {t['t']:.0f} | {t['sent']} | {t['ok']} | {t['failed']} | {ms(t['p50'])} | {ms(t['p99'])} |")
if (r / f"ray-{last}-http-cohere").exists():  # not with SKIP_HTTP=1
    print(f"\n| HTTP through ray-{last} | calls | by code | p50 / p99 ms |\n|---|---:|---|---:|")
    for api in ("cohere", "jina", "tei"):
        h = rep(f"ray-{last}-http-{api}")
        print(f"| {api} | {h['requests']} | {h['by_code']} | {ms(h['latency_seconds']['p50'])} / "
              f"{ms(h['latency_seconds']['p99'])} |")
PY
cat "$OUT/ray_bench.md"

