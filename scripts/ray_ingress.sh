#!/usr/bin/env bash
# Ray's per-call cost by ingress, in one run: `scorer serve`, then one Ray Serve replica through
# the deployed ingress (scorer.ray_serve.RAY_ENV: HAProxy in front of the replica's own server),
# then with each of INGRESS's Ray switches (space-separated configurations, each VAR=VALUE[,VAR=VALUE];
# default: Serve's Python gRPC proxy, Serve's own default). The load tool, closed loop: one call at a time (p50) and CONCURRENCY at a time (calls/s).
#   bash scripts/ray_ingress.sh               (this machine: the toy model on the CPU, ~3 min)
#   REQUESTS=/tmp/A.jsonl SERVE_ARGS="--model DIR" RAY_ARGS="--num-gpus 1 model=DIR" bash scripts/ray_ingress.sh
#   -> OUT (default out/ray_ingress)/ray_ingress.md and each load-tool report
set -euo pipefail
PY="${PY:-.venv/bin/python}"
OUT="${OUT:-out}/ray_ingress"
INGRESS="${INGRESS:-RAY_SERVE_ENABLE_HA_PROXY=0,RAY_SERVE_THROUGHPUT_OPTIMIZED=0}"
CONCURRENCY="${CONCURRENCY:-16}"
DURATION="${DURATION:-8}"
REQUESTS="${REQUESTS:-$OUT/requests.jsonl}"
mkdir -p "$OUT"
[ -f "$REQUESTS" ] || "$PY" -m loadtest.gen --out "$REQUESTS" --requests 500 --docs 2 --prompt-tokens 20 \
  --doc-tokens 10 --token-ids --seed 1 >/dev/null
pid=
trap '[ -z "$pid" ] || kill -INT "$pid" 2>/dev/null || true' EXIT

load() {  # NAME TARGET
  for c in 1 "$CONCURRENCY"; do
    "$PY" -m loadtest.run --target "$2" --requests "$REQUESTS" --concurrency "$c" --duration "$DURATION" \
      --warmup 1 --schemes auto --quiet --no-samples --out "$OUT/$1-c$c" >/dev/null 2>&1 \
      || echo "$1 at concurrency $c failed" >&2
  done
}

wait_for() {  # PATTERN LOG: until a line of LOG matches (the process must stay alive)
  for _ in $(seq 300); do
    grep -q "$1" "$2" && return 0
    kill -0 "$pid" 2>/dev/null || { tail -30 "$2"; exit 1; }
    sleep 1
  done
  tail -30 "$2"
  exit 1
}

# shellcheck disable=SC2086
"$PY" -m scorer serve --port 50051 --metrics-port 0 ${SERVE_ARGS:-} >"$OUT/serve.log" 2>&1 &
pid=$!
wait_for "SERVING" "$OUT/serve.log"
load serve 127.0.0.1:50051
kill -TERM "$pid" && wait "$pid" || true
pid=
configs=("default" $INGRESS)
for cfg in "${configs[@]}"; do
  env=()
  [ "$cfg" = default ] || IFS=, read -r -a env <<<"$cfg"
  # shellcheck disable=SC2086
  env "${env[@]}" "$PY" -m scorer.ray_local --quiet ${RAY_ARGS:-} >"$OUT/ray-$cfg.log" 2>&1 &
  pid=$!
  wait_for "^READY" "$OUT/ray-$cfg.log"
  load "ray-$cfg" 127.0.0.1:9000
  kill -INT "$pid" && timeout 120 tail --pid="$pid" -f /dev/null || true
  pid=
done

"$PY" - "$OUT" "$CONCURRENCY" "serve" "${configs[@]/#/ray-}" <<'PY' | tee "$OUT/ray_ingress.md"
import json, sys
from pathlib import Path

out, conc, names = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
print(f"| server | one at a time: p50 ms | {conc} at a time: calls/s | p50 ms | failed |")
print("|---|---:|---:|---:|---:|")
for name in names:
    try:
        one = json.loads((out / f"{name}-c1" / "report.json").read_text())["runs"][0]
        many = json.loads((out / f"{name}-c{conc}" / "report.json").read_text())["runs"][0]
    except (OSError, KeyError, IndexError):
        print(f"| {name} | - | - | - | no report |")
        continue
    print(f"| {name} | {one['latency_seconds']['p50'] * 1e3:.1f} | {many['achieved_rps']:.0f} |"
          f" {many['latency_seconds']['p50'] * 1e3:.1f} | {one['failed'] + many['failed']} |")
PY
