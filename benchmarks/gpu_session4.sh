#!/usr/bin/env bash
# Device call for the KVpop primitives (#3): the ops benchmark at the paper's sizes, then the GPU-marked tests.
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/gpu_session4.sh
# Timing on nvidia-h200 (2026-11-30, first version): benchmark ~4.5 min (compiles included), GPU tests ~1.5 min.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}; mkdir -p "$OUT"
echo "commit=${KVLEARN_COMMIT:-?} $(python3 -c 'import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)')"
timeout ${BENCH_S:-360} python3 benchmarks/kvpop_ops.py --out "$OUT/kvpop_ops_h200.json" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"
timeout ${TESTS_S:-170} python3 -m pytest -q -m gpu tests -p no:cacheprovider -rf > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$?"
grep -v Warn "$OUT/bench.log" | tail -n 60; tail -n 25 "$OUT/gpu_tests.log"
