#!/usr/bin/env bash
# The kernel tuning sweep behind the launch defaults (results/raw/kvpop_attention_sweep_h200_728ccb0.json): FlexAttention
# tiles x query block size, the fused Triton forward's tunables, the target pass's options, into
# $OUT/kvpop_attention_sweep_h200.json, stdout in $OUT/kvpop_attention_sweep.log.
# Expected device time: about 5 minutes on one H200 (the sweep stops itself after BUDGET_S, default 270 s).
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/device/kvpop_attention_sweep.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
echo "commit=${KVLEARN_COMMIT:-?} $(python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)') triton $(python3 -c 'import triton; print(triton.__version__)' 2>/dev/null || echo none)"
timeout 330 python3 benchmarks/kvpop_attention_sweep.py --budget-s "${BUDGET_S:-270}" \
  --out "$OUT/kvpop_attention_sweep_h200.json" > "$OUT/kvpop_attention_sweep.log" 2>&1
echo "sweep rc=$?"
grep -v Warn "$OUT/kvpop_attention_sweep.log" | tail -n 40
