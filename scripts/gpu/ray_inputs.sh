#!/usr/bin/env bash
# ray_bench.sh's inputs on the GPU machine's /tmp, each unless already there: the random
# Qwen3-0.6B-shaped checkpoint ($CKPT) and the load tool's calls of A, E (token ids) and A-text.
# Needs no kit: run it in run 1 after ray_unpack.sh, so that run 2's time goes to measuring.
#   bash scripts/gpu/ray_inputs.sh
set -euo pipefail
export PYTHONPATH=".:${PYTHONPATH:-}"
CKPT="${CKPT:-/tmp/ckpt/qwen3-0.6b-random}"
source scripts/gpu/checkpoint.sh
random_checkpoint "$CKPT"
gen() { [ -f "$1" ] || python3 -m loadtest.gen --requests 2000 --seed 1 --out "$@" >/dev/null; }
gen /tmp/A.jsonl --docs 10 --prompt-tokens 300 --doc-tokens 50 --token-ids
gen /tmp/E.jsonl --docs 20 --prompt-tokens 200 --doc-tokens 60 --token-ids
gen /tmp/A-text.jsonl --docs 10 --prompt-tokens 300 --doc-tokens 50
ls -la "$CKPT/model.safetensors" /tmp/A.jsonl /tmp/E.jsonl /tmp/A-text.jsonl
