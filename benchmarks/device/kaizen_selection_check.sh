#!/usr/bin/env bash
# Why checkpoint selection's validation reads an 8x KV-Kaizen student higher than the table does (issue #11;
# docs/DESIGN.md section 8, "Checkpoint selection"), in one call:
#   1. one 8x selector of the threshold-0.2 recipe with checkpoint selection (`kvlearn kaizen-train --target 8
#      --select-every 250 ...`, seed SEED, default 1) trained alone for TRAIN_MINUTES (default 5.5)
#   2. benchmarks/kaizen_selection_check.py on its final/: the validation's prompts and the table's, the training
#      copy under autocast and the bf16-served weights, batches of 16 and 64 (TASKS, default trace,niah)
#      -> $OUT/kaizen_selection_check.json
#   3. what the CPU needs to study the student further: its final/ without the optimizer state (float32 weights,
#      about 25 MB) as a tar split into parts under 16 MiB ($OUT/final.tar.part-aa, -ab), its selection.jsonl, its
#      gzipped train log and its sensitivity report. On this machine: cat final.tar.part-* > final.tar, then unpack
#      into carry_eval/ (ignored by git; too large to commit).
# Device time: about TRAIN_MINUTES + 0.7 (start-up, saves, validations) + 1.5 (the check) minutes.
# MODEL (default checkpoints/testbed-teacher), DEVICE (default cuda), STEPS (instead of TRAIN_MINUTES), TRAIN_ARGS
# (replaces the recipe's options),
# TASKS, N_EVAL (default 100) and CHECK_ARGS (more options of the check) let the plumbing run on the CPU
# (tests/eval/test_kaizen_selection_check.py).
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/device/kaizen_selection_check.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}; mkdir -p "$OUT"
MODEL=${MODEL:-checkpoints/testbed-teacher}; DEVICE=${DEVICE:-cuda}; SEED=${SEED:-1}
WORK=${WORK_DIR:-/tmp}/kaizen_selection_check
RECIPE='--dense-fraction 0.25 --underuse-weight 1 --share-layers auto --share-threshold 0.2 --lr 1e-4 --select-every 250'
echo "commit=${KVLEARN_COMMIT:-?} $(python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
length=(--minutes "${TRAIN_MINUTES:-5.5}"); [ -n "${STEPS:-}" ] && length=(--steps "$STEPS")
# shellcheck disable=SC2086
python3 -m kvlearn.cli kaizen-train --model "$MODEL" --out "$WORK" --overwrite --target 8 --seed "$SEED" \
    "${length[@]}" --device "$DEVICE" --save-interval 100000 ${TRAIN_ARGS:-$RECIPE} \
    > "$OUT/kaizen_train.log" 2>&1
echo "kaizen-train rc=$? $(date -u +%H:%M:%S)"; tr '\r' '\n' < "$OUT/kaizen_train.log" | grep -E "sharing allowed|validation|^wrote" | cut -c1-200
# shellcheck disable=SC2086
python3 benchmarks/kaizen_selection_check.py --model "$WORK/final" --tasks "${TASKS:-trace,niah}" \
    --n-eval "${N_EVAL:-100}" --device "$DEVICE" ${CHECK_ARGS:-} --out "$OUT/kaizen_selection_check.json" \
    > "$OUT/kaizen_selection_check.log" 2>&1
echo "check rc=$?"; grep -vE "Warn|Loading weights" "$OUT/kaizen_selection_check.log" | tail -n 10
cp "$WORK/selection.jsonl" "$OUT/selection.jsonl" 2>/dev/null
cp "$WORK/share_sensitivity.json" "$OUT/share_sensitivity.json" 2>/dev/null
gzip -c "$WORK/train_log.jsonl" > "$OUT/train_log.jsonl.gz"
tar -C "$WORK" --exclude=trainer_state.pt -cf - final | split -b 15m - "$OUT/final.tar.part-"
{ tr '\r' '\n' < "$OUT/kaizen_train.log"; cat "$OUT/kaizen_selection_check.log"; } | gzip -c > "$OUT/logs.txt.gz"
rm -f "$OUT/kaizen_train.log" "$OUT/kaizen_selection_check.log"
ls -la "$OUT"
