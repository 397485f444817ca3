# Sourced by env.sh and by ray_inputs.sh (which runs without the kit): random_checkpoint.
random_checkpoint() {  # DIR (a scratch path: it may be removed): the random Qwen3-0.6B-shaped bf16
  # checkpoint of the benchmarks, kept from an earlier run on a warm machine unless its tokenizer is
  # not the shipped one
  cmp -s "$1/tokenizer.json" scorer/models/tokenizer.json || rm -rf "$1"
  [ -f "$1/model.safetensors" ] || python3 -c "
from pathlib import Path
from bench.e2e import QWEN3_06B
from scorer.models.tiny import write_random_checkpoint
write_random_checkpoint(Path('$1'), QWEN3_06B, std=0.02)"
}
