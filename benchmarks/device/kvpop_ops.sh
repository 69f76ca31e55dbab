#!/usr/bin/env bash
# The KVpop ops benchmark of record (results/kvpop_ops_h200.json): the acceptance rows (`kvpop_ops.py --quick`:
# running cutoff, future-attention target, sparse attention forward and training step, scorers at the paper's
# sizes) into $OUT/kvpop_ops_h200.json, stdout in $OUT/kvpop_ops.log. FULL=1 adds the full row set
# ($OUT/kvpop_ops_h200_full.json; it writes rows as it goes, so a time-out keeps what it measured).
# Expected device time: about 3 minutes on one H200 (compiles included); FULL=1 adds up to 3 minutes.
# The mLSTM matmul_dtype rows (issue #10 item 8: scorer_mlstm_fwd_bwd_{float32,tf32,bfloat16}, each with its fwd+bwd
# and KVpop-additions ratios to dense fwd+bwd and its max abs errors vs float32; summary "mlstm_matmul_dtype") are
# part of --quick; they add about 1 minute (two more compiles of ~15 s, then timing). To see just them:
#   grep -E 'matmul_dtype|scorer_mlstm_fwd_bwd_' $OUT/kvpop_ops.log   (or the rows of $OUT/kvpop_ops_h200.json)
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/device/kvpop_ops.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
echo "commit=${KVLEARN_COMMIT:-?} $(python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)') triton $(python3 -c 'import triton; print(triton.__version__)' 2>/dev/null || echo none)"
timeout 280 python3 benchmarks/kvpop_ops.py --quick --out "$OUT/kvpop_ops_h200.json" > "$OUT/kvpop_ops.log" 2>&1
echo "quick rc=$?"
grep -v Warn "$OUT/kvpop_ops.log" | tail -n 70
if [ "${FULL:-0}" = 1 ]; then
  timeout 180 python3 benchmarks/kvpop_ops.py --out "$OUT/kvpop_ops_h200_full.json" > "$OUT/kvpop_ops_full.log" 2>&1
  echo "full rc=$?"
fi
