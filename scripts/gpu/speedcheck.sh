#!/usr/bin/env bash
# The restructure's speed check, one device call: GPU tests, then three runs each of the pipelined
# batch rate (bench.batch_breakdown) and the held-out model-level cells (bench.e2e --split heldout),
# for a before/after comparison by median (python -m bench.speedcheck BEFORE.tgz AFTER.tgz).
# bash scripts/gpu/speedcheck.sh [e2e_budget_s]   -> $OUT/speedcheck.tgz (and the test log)
source scripts/gpu/env.sh
bash scripts/gpu/test.sh | tail -3
python3 -m loadtest.gen --out /tmp/reqs.jsonl --requests 400 --docs 20 --prompt-tokens 200 \
  --doc-tokens lognormal:60:0.5:256 --token-ids --seed 1 >/dev/null
mkdir -p "$OUT/s"
for r in 1 2 3; do
  python3 -m bench.batch_breakdown --requests /tmp/reqs.jsonl --out "$OUT/s/bb$r" 2>&1 | grep pipelined
done
for r in 1 2 3; do
  t0=$(date +%s)
  python3 -m bench.e2e --split heldout --compare "" --budget "${1:-120}" --repeats 5 --out "$OUT/s/e2e$r" \
    >"$OUT/s/e2e$r.log" 2>&1
  echo "e2e run $r: $(( $(date +%s) - t0 )) s, $(grep -c heldout "$OUT/s/e2e$r.log") cells"
done
tar -C "$OUT" -czf "$OUT/speedcheck.tgz" s gpu-tests.xml && rm -rf "$OUT/s"
