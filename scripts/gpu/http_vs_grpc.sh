#!/usr/bin/env bash
# HTTP (the Cohere shape, FastAPI on uvicorn) against gRPC on one H200 replica serving a random
# Qwen3-0.6B-shaped checkpoint (as served.sh); the target: HTTP's docs/s at saturation at
# least 90% of gRPC's on workload A, and at most 1 ms more on the median at light load.
# One server (gRPC, HTTP and /metrics), three open-loop sweeps side by side, then a light-load
# point (10% of each sweep's saturation) for each; server on cores 4-15, load tool on 0-3:
#   grpc-ids     A as token ids, template plain (300-token prompt, 10 x 50-token docs): the issue's A
#   grpc-text    A as text (the load tool's word list, 300 / 50 tokens on the checkpoint's tokenizer,
#                the embedded BPE that write_random_checkpoint writes), the reranker template
#   cohere-text  the same calls as grpc-text over POST /v2/rerank: HTTP sends text and runs the
#                default template, so these are the calls it can make equal to gRPC's
# The target compares cohere-text with grpc-text; grpc-ids is the reference the other issues use.
#   bash scripts/gpu/http_vs_grpc.sh [rates] [seconds per step]
#   the HTTP client (aiohttp): pip install -e '.[gpu,dev]', or the offline kit's .wheels/ (scripts/gpu/wheels.sh)
#   -> $OUT/http_vs_grpc.json, server.log, reports.tgz (the load tool's reports)
# LOCAL_CPU=1 runs the same steps on a CPU machine (the embedded tiny model, low rates): a dry run.
set -euo pipefail
RATES="${1:-100,150,200,250,300,350,400,500}"
STEP="${2:-5}"
LIGHT_S=10
if [ "${LOCAL_CPU:-}" = 1 ]; then
  PY=.venv/bin/python
  export OUT="${OUT:-$PWD/out/http_vs_grpc}"
  mkdir -p "$OUT"
  SERVER=("$PY" -m scorer serve --device cpu)
  LOAD=("$PY")
else
  source scripts/gpu/env.sh
  PY=python3
  use_wheels
  CKPT=/tmp/ckpt/qwen3-0.6b-random
  random_checkpoint "$CKPT"
  SERVER=(taskset -c 4-15 "$PY" -m scorer serve --model "$CKPT")
  LOAD=(taskset -c 0-3 "$PY")
fi
"$PY" -c "import aiohttp, fastapi, httptools, uvicorn; print('fastapi', fastapi.__version__, 'uvicorn', \
uvicorn.__version__, 'aiohttp', aiohttp.__version__, 'from', fastapi.__file__.rsplit('/', 2)[0])"
A=(--requests 2000 --docs 10 --prompt-tokens 300 --doc-tokens fixed:50 --seed 1)
"$PY" -m loadtest.gen --out /tmp/a-ids.jsonl "${A[@]}" --token-ids --template plain
"$PY" -m loadtest.gen --out /tmp/a-text.jsonl "${A[@]}"

"${SERVER[@]}" --port 50051 --http-port 8080 --metrics-port 9464 >"$OUT/server.log" 2>&1 &
SERVER_PID=$!
finish() {  # also on failure: the device returns a handful of files, so the reports travel as one archive
  kill $SERVER_PID 2>/dev/null || true
  cd "$OUT" && shopt -s nullglob && local dirs=(grpc-*/ cohere-*/ light-*/)
  [ ${#dirs[@]} -eq 0 ] || { tar czf reports.tgz "${dirs[@]}" && rm -r "${dirs[@]}"; }
}
trap finish EXIT
"$PY" scripts/gpu/wait_serving.py "$SERVER_PID" --http http://127.0.0.1:8080/health || { tail -20 "$OUT/server.log"; exit 1; }

COMMON=(--duration "$STEP" --warmup 1 --pause 1 --deadline-ms 2000 --channels 4 --quiet --no-samples
  --metrics-url http://127.0.0.1:9464/metrics)
# name, api, target, requests
SERIES=("grpc-ids grpc 127.0.0.1:50051 /tmp/a-ids.jsonl" "grpc-text grpc 127.0.0.1:50051 /tmp/a-text.jsonl"
  "cohere-text cohere 127.0.0.1:8080 /tmp/a-text.jsonl")
for s in "${SERIES[@]}"; do
  read -r name api target reqs <<<"$s"
  echo "== $name: sweep $RATES"
  "${LOAD[@]}" -m loadtest.run --api "$api" --target "$target" --requests "$reqs" --sweep "$RATES" \
    --stop-when-saturated "${COMMON[@]}" --out "$OUT/$name" 2>&1 | sed '/^report:/d'
done
# light load: 10% of grpc-ids' saturation for it, 10% of grpc-text's for both text series (one rate)
ids_rate=$("$PY" scripts/gpu/http_vs_grpc.py light-rate "$OUT/grpc-ids")
text_rate=$("$PY" scripts/gpu/http_vs_grpc.py light-rate "$OUT/grpc-text")
for s in "${SERIES[@]}"; do
  read -r name api target reqs <<<"$s"
  rate=$([ "$name" = grpc-ids ] && echo "$ids_rate" || echo "$text_rate")
  echo "== $name: light load, $rate calls/s"
  "${LOAD[@]}" -m loadtest.run --api "$api" --target "$target" --requests "$reqs" --rate "$rate" \
    "${COMMON[@]}" --duration "$LIGHT_S" --out "$OUT/light-$name" 2>&1 | sed '/^report:/d'
done
kill -TERM $SERVER_PID && wait $SERVER_PID || echo "server exit code $?" >&2
# exit 2 when the run cannot answer the targets (a sweep that never saturated, ...): see its PROBLEM lines
"$PY" scripts/gpu/http_vs_grpc.py summary "$OUT" /tmp/a-ids.jsonl /tmp/a-text.jsonl "${CKPT:-}" \
  | tee "$OUT/http_vs_grpc.md"
