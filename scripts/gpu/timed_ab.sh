#!/usr/bin/env bash
# GPU tests; C by kernel with long docs' attention on FA3 over gathered keys and paged; then `auto`
# (buckets timed after capture) beside `auto@untimed` (the smallest bucket that holds a pass) on
# every 0.6B workload.   bash scripts/gpu/timed_ab.sh   -> $OUT/gpu-tests.log, kernel_profile.*, throughput.*
source scripts/gpu/env.sh
[ "${GPU_TESTS:-1}" = 0 ] || bash scripts/gpu/test.sh | tail -2
[ "${PROFILE:-1}" = 0 ] || bash scripts/gpu/c_profile.sh
python3 -m bench.throughput --models qwen3-0.6b --workloads "${WORKLOADS:-E,A,B,C,D}" --systems auto,auto@untimed \
  --seconds 3 --out "$OUT" 2>&1 | grep -v Warning | tee "$OUT/throughput.log" | grep "^|"
