#!/usr/bin/env bash
# Evaluates the eviction baselines on the testbed (benchmarks/eviction_baselines.py) into $OUT/baselines_table.json,
# stdout in $OUT/eviction_baselines.log.
# Device time: at most MINUTES (default 9, one 10-minute device call) plus start-up; rows not reached are listed
# in the file's `not_run` (run the script again with --methods/--budgets for them).
# MODEL (default: the shipped checkpoints/testbed-teacher) evaluates another checkpoint folder.
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/device/eviction_baselines.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
echo "commit=${KVLEARN_COMMIT:-?} $(python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)') triton $(python3 -c 'import triton; print(triton.__version__)' 2>/dev/null || echo none)"
python3 benchmarks/eviction_baselines.py --model "${MODEL:-checkpoints/testbed-teacher}" --minutes "${MINUTES:-9}" --out "$OUT/baselines_table.json" \
    --plot "$OUT/baselines_pareto.png" > "$OUT/eviction_baselines.log" 2>&1
echo "baselines rc=$?"
tail -n 30 "$OUT/eviction_baselines.log"
