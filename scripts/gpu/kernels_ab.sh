#!/usr/bin/env bash
# The model's kernels side by side in one device call: GPU tests, then the pipelined serving batch
# (bench.batch_breakdown) alternating --model-kernels flashinfer / fused (one QKV GEMM + Triton's
# q/k norm + RoPE), twice each, and the held-out model-level cells on fused with flashinfer beside.
# bash scripts/gpu/kernels_ab.sh [e2e_budget_s]   -> $OUT/kernels_ab.tgz (and the test log)
source scripts/gpu/env.sh
bash scripts/gpu/test.sh | tail -3
python3 -m loadtest.gen --out /tmp/reqs.jsonl --requests 400 --docs 20 --prompt-tokens 200 \
  --doc-tokens lognormal:60:0.5:256 --token-ids --seed 1 >/dev/null
mkdir -p "$OUT/ab"
for r in 1 2; do
  for k in flashinfer fused; do
    python3 -m bench.batch_breakdown --requests /tmp/reqs.jsonl --model-kernels $k --out "$OUT/ab/bb-$k-$r" \
      2>&1 | grep -E "pipelined|\"plan\"|\"issue\"|\"device\"" | tr -d '\n'; echo " <- $k run $r"
  done
done
python3 -m bench.e2e --split heldout --model-kernels fused --compare flashinfer --budget "${1:-150}" --repeats 5 \
  --out "$OUT/ab/e2e" >"$OUT/ab/e2e.log" 2>&1
tail -3 "$OUT/ab/e2e.log"
python3 -m bench.speedcheck --within "$OUT/ab/e2e/e2e.json" results_flashinfer results | tail -2
tar -C "$OUT" -czf "$OUT/kernels_ab.tgz" ab gpu-tests.xml && rm -rf "$OUT/ab"
