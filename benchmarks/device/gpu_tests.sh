#!/usr/bin/env bash
# Runs every GPU-marked test (`python -m pytest -m gpu`) and writes the log to $OUT/gpu_tests.log.
# Expected device time: about 7 minutes on one H200 (Triton compiles included); GPU_TESTS_S caps it (default 540 s).
# TESTS (default: tests) narrows it, e.g. TESTS=tests/cache/test_compile_gpu.py for the compiled decode alone.
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/device/gpu_tests.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
echo "commit=${KVLEARN_COMMIT:-?} $(python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)') triton $(python3 -c 'import triton; print(triton.__version__)' 2>/dev/null || echo none)"
timeout "${GPU_TESTS_S:-540}" python3 -m pytest -v -m gpu ${TESTS:-tests} -p no:cacheprovider -rf > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$?"
grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_tests.log" | tail -n 20
