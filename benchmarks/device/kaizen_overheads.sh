#!/usr/bin/env bash
# Issue #11 item 9, "the selector's latency against pre-fill and the training cost against plain fine-tuning" (the
# paper: about 3 ms, and 1.0 to 1.4x with one action per layer; benchmarks/kaizen_overheads.py). One process per run
# measures both: the selector (kvlearn.kaizen.apply.prompt_choices, what `kvlearn eval --method kaizen` runs once per
# prompt before prefill) against the dense bf16 model's prefill forward of the same 4096-token prompt at batch 1, and
# one kaizen-train step (kaizen_train_step) against one plain distillation step of the dense model (dense_distill_step)
# on the same testbed batch, interleaved in rounds, medians of CUDA-event times. Two runs:
#   1. the committed testbed teacher, training seq 4096, batch 8 (kaizen-train's defaults)
#      -> $OUT/kaizen_overheads_h200.json
#   2. a random Qwen3-0.6B-shaped model (testbed vocabulary), training seq 4096, batch 4 (SHAPE_BATCH=8 for
#      kaizen-train's batch: estimated at 100-120 GiB, see the script's docstring) -> $OUT/kaizen_overheads_0p6b_h200.json
# stdout in $OUT/kaizen_overheads.log and $OUT/kaizen_overheads_0p6b.log; each run under `timeout 200` (the file is
# rewritten after every timed round, so a time-out keeps what it measured, marked "partial"). AXES (e.g.
# precision) is passed to both runs as --axes (default: precision,depth, kaizen-train's on a GQA backbone).
# Expected device time: about 3 minutes on one H200 (an estimate, not measured yet: start-up and model builds
# ~1 minute, the testbed run well under a minute, the 0.6B run about a minute at ~1-2 s per training step).
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... [AXES=...] [SHAPE_BATCH=...] \
#                       bash benchmarks/device/kaizen_overheads.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
echo "commit=${KVLEARN_COMMIT:-?} $(python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)') triton $(python3 -c 'import triton; print(triton.__version__)' 2>/dev/null || echo none)"
timeout 200 python3 benchmarks/kaizen_overheads.py ${AXES:+--axes "$AXES"} \
    --out "$OUT/kaizen_overheads_h200.json" > "$OUT/kaizen_overheads.log" 2>&1
echo "teacher rc=$?"
grep -vE "Warn|Loading weights|Writing model" "$OUT/kaizen_overheads.log" | tail -n 12
timeout 200 python3 benchmarks/kaizen_overheads.py --shape qwen3-0.6b ${AXES:+--axes "$AXES"} \
    ${SHAPE_BATCH:+--batch-size "$SHAPE_BATCH"} \
    --out "$OUT/kaizen_overheads_0p6b_h200.json" > "$OUT/kaizen_overheads_0p6b.log" 2>&1
echo "qwen3-0.6b shape rc=$?"
grep -vE "Warn|Loading weights|Writing model" "$OUT/kaizen_overheads_0p6b.log" | tail -n 12
