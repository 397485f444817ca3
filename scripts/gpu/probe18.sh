#!/usr/bin/env bash
# Session 18's first call: GPU tests; the q/k kernel's program shapes in the serving layout; one
# attention layer of C and A with the ragged scheme's K/V made contiguous (the prompt duplicated
# before each doc) on FA2 and FA3; the layer's GEMMs by row count with cuBLAS's default workspace
# and with none; then the transformers baselines (scripts/gpu/baselines.sh).
#   bash scripts/gpu/probe18.sh   -> $OUT/gpu-tests.log, qk.log, attention_layouts.json, gemm_shapes_*.json, throughput*.json
source scripts/gpu/env.sh
[ "${GPU_TESTS:-1}" = 0 ] || bash scripts/gpu/test.sh | tail -3
timeout 150 python3 -m bench.qk_norm_rope --no-cold --out "$OUT/qk" 2>&1 | grep -v "Warn" | tail -40 | tee "$OUT/qk.log"
tar czf "$OUT/qk.tgz" -C "$OUT" qk && rm -r "$OUT/qk"
timeout 120 python3 -m bench.attention_layouts --shapes C,A --models 0.6b --out "$OUT" 2>&1 | grep -v Warn | tee "$OUT/probe.log"
timeout 60 python3 -m bench.gemm_shapes --out "$OUT" --label default 2>&1 | grep -v Warn | tee -a "$OUT/probe.log"
CUBLAS_WORKSPACE_CONFIG=:0:0 CUBLASLT_WORKSPACE_SIZE=0 timeout 60 python3 -m bench.gemm_shapes --out "$OUT" \
  --label no-workspace 2>&1 | grep -v Warn | tee -a "$OUT/probe.log"
# (the device tool returns 8 files: the baselines' JSON and log go back as one archive)
[ "${BASELINES:-1}" = 0 ] || { bash scripts/gpu/baselines.sh 100 60 | grep "^|" | tail -12
  tar czf "$OUT/baselines.tgz" -C "$OUT" throughput.json throughput_8b.json throughput.log && rm "$OUT"/throughput*; }
