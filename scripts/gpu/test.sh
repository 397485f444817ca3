#!/usr/bin/env bash
# The GPU tests, then each GPU benchmark on a tiny grid (a broken benchmark fails here, not in a long
# run), in one call of a few minutes: bash scripts/gpu/test.sh [pytest args]
#   needs the test tools too: pip install -e '.[gpu,dev]'
#   SMOKE=0: the tests alone
#   -> $OUT/gpu-tests.log, gpu-tests.xml (junit), machine.txt, smoke/ (the benchmarks' JSON), smoke.log
# Exit status: the tests' (a smoke run that fails is reported in smoke.log and on stderr).
source scripts/gpu/env.sh
python3 -c "import pytest, hypothesis" || { echo "the tests need pytest and hypothesis: pip install -e '.[gpu,dev]'" >&2; exit 1; }
python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" "$@" 2>&1 \
  | tee "$OUT/gpu-tests.log"
rc=${PIPESTATUS[0]}
[ "${SMOKE:-1}" = 1 ] || exit "$rc"
S="$OUT/smoke"
mkdir -p "$S"
{
  set -x
  python3 -m bench.kernels --grid smoke --graphs --out "$S"
  python3 -m bench.e2e --smoke --out "$S"
  python3 -m bench.attention_layouts --shapes A --models 0.6b --iters 5 --out "$S"
  python3 -m bench.triton_gemm --models 0.6b --rows 1600 --configs default --reps 3 --iters 5 --out "$S"
  python3 -m bench.throughput --models qwen3-0.6b --workloads A --systems auto --seconds 0.5 --out "$S"
  python3 -m bench.kernel_profile --model qwen3-0.6b --workloads A --batches 1 --out "$S"
} >"$OUT/smoke.log" 2>&1 || echo "a benchmark's smoke run failed: see $OUT/smoke.log" >&2
tail -3 "$OUT/smoke.log"
exit "$rc"
