# Sourced by the scripts here, on the GPU machine, from the project root: the kit, the tree on
# the path, and $OUT (the device tool's output folder; ./out elsewhere).
set -o pipefail
source .gpu/device_env.sh || { echo "stage the GPU kit first: ../shared/gpu/stage.sh" >&2; exit 1; }
export PYTHONPATH=".:${PYTHONPATH}"
export OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,memory.used --format=csv,noheader
