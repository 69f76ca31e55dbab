#!/usr/bin/env bash
# The KVpop ops benchmark of record (results/kvpop_ops_h200.json): the acceptance rows (`kvpop_ops.py --quick`:
# running cutoff, future-attention target, sparse attention forward and training step, scorers at the paper's
# sizes) into $OUT/kvpop_ops_h200.json, stdout in $OUT/kvpop_ops.log. FULL=1 adds the full row set
# ($OUT/kvpop_ops_h200_full.json; it writes rows as it goes, so a time-out keeps what it measured).
# Expected device time: about 2 minutes on one H200 (compiles included); FULL=1 adds up to 3 minutes.
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/device/kvpop_ops.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
echo "commit=${KVLEARN_COMMIT:-?} $(python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)') triton $(python3 -c 'import triton; print(triton.__version__)' 2>/dev/null || echo none)"
timeout 200 python3 benchmarks/kvpop_ops.py --quick --out "$OUT/kvpop_ops_h200.json" > "$OUT/kvpop_ops.log" 2>&1
echo "quick rc=$?"
grep -v Warn "$OUT/kvpop_ops.log" | tail -n 45
if [ "${FULL:-0}" = 1 ]; then
  timeout 180 python3 benchmarks/kvpop_ops.py --out "$OUT/kvpop_ops_h200_full.json" > "$OUT/kvpop_ops_full.log" 2>&1
  echo "full rc=$?"
fi
