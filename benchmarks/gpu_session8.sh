#!/usr/bin/env bash
# Device check after the review of 2026-11-30 (shared kernel helpers, fixed target-pass launch shapes, the layout
# kernel also for topk=None, one padding sync per forward): the GPU tests of the changed code, then the acceptance
# rows once more. Usage on nvidia-h200:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/gpu_session8.sh (~4 min)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
echo "commit=${KVLEARN_COMMIT:-?} $(python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)')"
timeout 200 python3 -m pytest -v -m gpu tests/ops/test_future_target_triton.py tests/kvpop/test_gathered_triton.py \
  tests/kvpop/test_attention.py tests/ops/test_gathered_layout_triton.py -p no:cacheprovider -rf > "$OUT/gpu_tests.log" 2>&1
echo "tests rc=$?"
timeout 150 python3 benchmarks/kvpop_ops.py --quick --out "$OUT/kvpop_ops_h200_check.json" > "$OUT/quick.log" 2>&1
echo "quick rc=$?"
grep -cE "PASSED" "$OUT/gpu_tests.log"; grep -E "FAILED|ERROR|passed|failed" "$OUT/gpu_tests.log" | tail -n 15
grep -v Warn "$OUT/quick.log" | tail -n 45
