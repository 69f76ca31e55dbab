#!/usr/bin/env bash
# Device call for the KVpop primitives (#3) after the fused kernels became the defaults (2026-11-30): every GPU
# test, then the acceptance rows (--quick: the results file of record), then the full benchmark as far as the time
# allows (it writes its rows as it goes).
# Usage on nvidia-h200:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/gpu_session6.sh   (about 9 minutes)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
echo "commit=${KVLEARN_COMMIT:-?} $(python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)')"
timeout 210 python3 -m pytest -v -m gpu tests -p no:cacheprovider -rf > "$OUT/gpu_tests.log" 2>&1; echo "tests rc=$?"
timeout 150 python3 benchmarks/kvpop_ops.py --quick --out "$OUT/kvpop_ops_h200.json" > "$OUT/quick.log" 2>&1
echo "quick rc=$?"
timeout 170 python3 benchmarks/kvpop_ops.py --out "$OUT/kvpop_ops_h200_full.json" > "$OUT/full.log" 2>&1
echo "full rc=$?"
grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/gpu_tests.log" | tail -n 60
grep -v Warn "$OUT/quick.log" | tail -n 60
grep -v Warn "$OUT/full.log" | tail -n 25
