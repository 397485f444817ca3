#!/usr/bin/env bash
# GPU tests: bash scripts/gpu/test.sh [pytest args]   (device: carry [".gpu"])
source scripts/gpu/env.sh
python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider --junitxml="$OUT/gpu-tests.xml" "$@" 2>&1 \
  | tee "$OUT/gpu-tests.log"
