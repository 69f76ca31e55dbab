#!/usr/bin/env bash
# Device call for the KVpop primitives (#3), run 2026-11-30 at commit 728ccb0 (results/raw/kvpop_attention_sweep_h200.json,
# results/raw/kvpop_ops_h200_run3_before.json): the GPU tests of the fused Triton forward and the gathered path, the
# tuning sweep (flex tiles, query block size, Triton tunables, target pass), then the acceptance rows. Its winner
# (Triton forward, 128 x 128 tiles) became the default; benchmarks/gpu_session6.sh measured the result.
# Usage on nvidia-h200:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/gpu_session5.sh   (about 9 minutes)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
echo "commit=${KVLEARN_COMMIT:-?} $(python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)')"
timeout 120 python3 -m pytest -v -m gpu tests/kvpop/test_gathered_triton.py tests/kvpop/test_attention.py -p no:cacheprovider -rf \
  > "$OUT/gpu_tests.log" 2>&1; echo "tests rc=$?"
timeout 330 python3 benchmarks/kvpop_attention_sweep.py --budget-s 270 --out "$OUT/kvpop_attention_sweep_h200.json" \
  > "$OUT/sweep.log" 2>&1; echo "sweep rc=$?"
timeout 100 python3 benchmarks/kvpop_ops.py --quick --out "$OUT/kvpop_ops_h200_quick.json" > "$OUT/quick.log" 2>&1
echo "quick rc=$?"
grep -E "passed|failed|PASSED|FAILED" "$OUT/gpu_tests.log" | tail -n 25; grep -v Warn "$OUT/sweep.log" | tail -n 40
grep -v Warn "$OUT/quick.log" | tail -n 40
