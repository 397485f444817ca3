#!/usr/bin/env bash
# Issue 11 in one call: served.sh (the replica against its engine, the light-load probe and the bare
# gRPC floor at 10%), then scripts/gpu/idle_probe.py on the same checkpoint (one A call on the
# serving engine: host launch against the whole call, by gap), the rest archived so that
# served.md, served.json, light_load.json and engine.json come back as files.
#   FRONTENDS=4 bash scripts/gpu/served_check.sh     device: carry [".gpu"] (".wheels" too: as served.sh)
#   env: as served.sh (GPU_TESTS defaults to 0 here; PMQOS=1), PROBE=0 (no idle_probe.py), HITS=1
#   (scripts/gpu/hit_probe.py first: small A batches by what the prefix cache does with their prompts)
set -uo pipefail
source scripts/gpu/env.sh
if [ "${HITS:-}" = 1 ]; then  # first: a call cut at its limit still brings it back
  random_checkpoint /tmp/ckpt/qwen3-0.6b-random && mkdir -p /tmp/hits
  for w in A A-text; do
    # shellcheck disable=SC2086
    python3 -m loadtest.gen --out "/tmp/hits/$w.jsonl" --requests 800 --seed 3 ${GEN[$w]} >/dev/null
  done
  timeout 240 python3 scripts/gpu/hit_probe.py /tmp/ckpt/qwen3-0.6b-random "$OUT/hit_probe.json" /tmp/hits/A.jsonl \
    /tmp/hits/A-text.jsonl >"$OUT/hit_probe.log" 2>&1 || tail -5 "$OUT/hit_probe.log"
  tail -17 "$OUT/hit_probe.log"
fi
GPU_TESTS="${GPU_TESTS:-0}" bash scripts/gpu/served.sh 2>&1 | tee "$OUT/served.log" | grep -E '^\||^==|saturated|GPU tests|: p50 '
if [ "${PROBE:-1}" = 1 ]; then
  python3 scripts/gpu/idle_probe.py /tmp/ckpt/qwen3-0.6b-random /tmp/A.jsonl "$OUT/idle_probe.json" >"$OUT/idle_probe.log" 2>&1 \
    || tail -5 "$OUT/idle_probe.log"
  tail -25 "$OUT/idle_probe.log"
fi
cd "$OUT" && shopt -s nullglob && tar czf logs.tgz served.log idle_probe.* server-*.log pyspy* profile-load*.log gpu-tests.xml \
  && rm -f served.log idle_probe.* server-*.log pyspy* profile-load*.log gpu-tests.xml
ls "$OUT"
