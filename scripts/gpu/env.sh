# Sourced by the scripts here, from the project root, on any CUDA machine with the project installed
# (`pip install -e '.[gpu]'`). An offline kit staged into the ignored .gpu/ folder (its
# device_env.sh: wheels and prebuilt kernels on the path) is used when present, else the installed
# packages. Puts the tree on the path and sets $OUT (the results folder; ./out unless set).
set -o pipefail
if [ -f .gpu/device_env.sh ]; then
  source .gpu/device_env.sh
fi
export PYTHONPATH=".:${PYTHONPATH:-}"
export OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
python3 -c "import torch, flashinfer; assert torch.cuda.is_available(), 'torch sees no CUDA device'" \
  || { echo "needs CUDA torch and flashinfer: pip install -e '.[gpu]' (or stage the kit in .gpu/)" >&2; exit 1; }
# the machine and versions beside every result
{
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,memory.total --format=csv,noheader
  python3 -c "import sys, torch, flashinfer; print('python', sys.version.split()[0], 'torch', torch.__version__,
'cuda', torch.version.cuda, 'flashinfer', flashinfer.__version__)"
} | tee "$OUT/machine.txt"

source scripts/gpu/checkpoint.sh  # random_checkpoint

# the load tool's workloads of the served benchmarks: A and E as token ids with template plain,
# A-text as text calls with the reranker template
declare -A GEN=([A]="--docs 10 --prompt-tokens 300 --doc-tokens fixed:50 --token-ids --template plain"
  [E]="--docs 20 --prompt-tokens 200 --doc-tokens fixed:60 --token-ids --template plain"
  [A-text]="--docs 10 --prompt-tokens 300 --doc-tokens fixed:50")

use_wheels() {  # the offline kit's extra wheels (.wheels/, from scripts/gpu/wheels.sh), first on the path,
  # where present; else the installed packages (pip install -e '.[gpu,dev]' brings the HTTP client)
  ls .wheels/*.whl >/dev/null 2>&1 || return 0
  rm -rf /tmp/wheels && python3 -m pip install -q --no-index --no-deps --target /tmp/wheels .wheels/*.whl
  export PYTHONPATH="/tmp/wheels:$PYTHONPATH" PATH="/tmp/wheels/bin:$PATH"
}
