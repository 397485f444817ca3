# Sourced by the scripts here, on the GPU machine, from the project root: the kit, the tree on
# the path, and $OUT (the device tool's output folder; ./out elsewhere).
set -o pipefail
source .gpu/device_env.sh || { echo "stage the GPU kit first: ../shared/gpu/stage.sh" >&2; exit 1; }
export PYTHONPATH=".:${PYTHONPATH}"
export OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used --format=csv,noheader

source scripts/gpu/checkpoint.sh  # random_checkpoint

# the load tool's workloads of issue 11's benchmarks: A and E as token ids with template plain, A-text
# as text calls with the reranker template
declare -A GEN=([A]="--docs 10 --prompt-tokens 300 --doc-tokens fixed:50 --token-ids --template plain"
  [E]="--docs 20 --prompt-tokens 200 --doc-tokens fixed:60 --token-ids --template plain"
  [A-text]="--docs 10 --prompt-tokens 300 --doc-tokens fixed:50")

use_wheels() {  # the wheels of .wheels/ (scripts/gpu/wheels.sh; carry .wheels) installed under /tmp, first on the path
  ls .wheels/*.whl >/dev/null || { echo "no .wheels/: run bash scripts/gpu/wheels.sh and carry .wheels" >&2; exit 1; }
  rm -rf /tmp/wheels && python3 -m pip install -q --no-index --no-deps --target /tmp/wheels .wheels/*.whl
  export PYTHONPATH="/tmp/wheels:$PYTHONPATH" PATH="/tmp/wheels/bin:$PATH"
}

pyspy_top() {  # PID SECONDS [ROWS]: py-spy on PID's own threads -> $OUT/pyspy-top.txt (not --subprocesses:
  # with it sessions 10 and 17 got 6 samples; served.sh passes the engine process); --idle: waits count
  # (self and total time by function, scripts/gpu/pyspy_top.py, from raw collapsed stacks)
  py-spy record --pid "$1" --threads --idle --nonblocking --duration "$2" --rate 200 --format raw \
    --output /tmp/pyspy.txt >/dev/null 2>/tmp/pyspy.err || { echo "py-spy failed:" >&2; cat /tmp/pyspy.err >&2; }
  grep -h "Samples:" /tmp/pyspy.err >&2 || true  # py-spy's own count (and errors): an idle target shows here
  cp /tmp/pyspy.err "$OUT/pyspy.err" || true
  python3 scripts/gpu/pyspy_top.py /tmp/pyspy.txt "${3:-40}" >"$OUT/pyspy-top.txt" || true
}
