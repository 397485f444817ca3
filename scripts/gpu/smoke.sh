#!/usr/bin/env bash
# GPU tests, then both benchmarks on tiny grids (catches a broken script before a long run).
source scripts/gpu/env.sh
python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu-tests.log"
rc=$?
python3 -m bench.kernels --grid smoke --graphs --out "$OUT" 2>&1 | tail -5
python3 -m bench.e2e --smoke --out "$OUT" 2>&1 | tail -5
exit $rc
