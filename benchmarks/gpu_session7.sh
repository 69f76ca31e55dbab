#!/usr/bin/env bash
# Second device call of 2026-11-30 for #3: the GPU tests the first call's 210 s limit did not reach (the default
# target backend, the gathered-layout kernel, the mLSTM), a repeat of the acceptance rows (a second run of the
# same code, to see the spread), and a profile of the mLSTM scorer (the largest KVpop addition).
# Usage on nvidia-h200:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/gpu_session7.sh   (about 4 minutes)
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
echo "commit=${KVLEARN_COMMIT:-?} $(python3 -c 'import torch, triton; print(torch.__version__, triton.__version__)')"
timeout 200 python3 -m pytest -v -m gpu tests/ops/test_future_target_triton.py tests/ops/test_gathered_layout_triton.py \
  tests/ops/test_mlstm.py -p no:cacheprovider -rf -s > "$OUT/gpu_tests_rest.log" 2>&1; echo "tests rc=$?"
timeout 150 python3 benchmarks/kvpop_ops.py --quick --out "$OUT/kvpop_ops_h200_repeat.json" > "$OUT/quick_repeat.log" 2>&1
echo "quick rc=$?"
timeout 90 python3 benchmarks/profile_mlstm.py --out "$OUT/mlstm_profile.txt" > /dev/null 2>&1; echo "profile rc=$?"
grep -E "PASSED|FAILED|ERROR|passed|failed|ms" "$OUT/gpu_tests_rest.log" | tail -n 40
grep -v Warn "$OUT/quick_repeat.log" | tail -n 45
head -n 40 "$OUT/mlstm_profile.txt"
