#!/usr/bin/env bash
# The `smaller_model` rows of the KV-Kaizen table (issue #11 item 8): a smaller uncompressed testbed model trained with
# the shipped teacher's recipe, then evaluated dense on both splits at the factor of its smaller cache.
#   1. `kvlearn pretrain --num-layers LAYERS` (default 2: a 4x smaller cache than the teacher's 8 layers) on the
#      teacher's data budget: its 9,162 optimizer steps of 131,072 tokens, with its realised stage shares
#      (checkpoints/testbed-teacher/pretrain_log.json: the stages ended at steps 628, 1469, 2694, 4982, 9162), the
#      other settings the defaults the teacher was trained with. A step budget, not the teacher's 18 minutes: a
#      smaller model runs more steps a minute, and the comparison is one of size at equal data (docs/DESIGN.md
#      section 8, "The smaller model");
#   2. `benchmarks/kaizen_table.py --smaller-model` on it alone (no control, baselines or compositions) ->
#      $OUT/kaizen_table_smaller_model.json; the model (bf16, ~3 MB) as $OUT/smaller_model.tar, the pretraining log
#      and its stage checks inside it.
# Device time: about 7 minutes plus the machine's start-up. STEPS, STAGE_FRACTIONS, LAYERS, N_PER_TASK (default 100),
# DEVICE (default cuda), WORK_DIR (default /tmp), PRETRAIN_ARGS and TABLE_ARGS (more options) let the same script run
# as a CPU smoke test (tests/eval/test_kaizen_smaller_model_script.py).
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/device/kaizen_smaller_model.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}; mkdir -p "$OUT"
WORK=${WORK_DIR:-/tmp}
LAYERS=${LAYERS:-2}
name=smaller-${LAYERS}l
echo "commit=${KVLEARN_COMMIT:-?} $(python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
echo "pretrain $(date -u +%H:%M:%S)"
# shellcheck disable=SC2086
python3 -m kvlearn.cli pretrain --out "$WORK/$name" --overwrite --device "${DEVICE:-cuda}" --num-layers "$LAYERS" \
    --steps "${STEPS:-9162}" --stage-fractions "${STAGE_FRACTIONS:-0.068544,0.091792,0.133704,0.249727,0.456233}" \
    ${PRETRAIN_ARGS:-} > "$OUT/pretrain_$name.log" 2>&1
echo "pretrain rc=$? $(date -u +%H:%M:%S)"; grep -E '^\{"stage"' "$OUT/pretrain_$name.log" | cut -c1-300
# shellcheck disable=SC2086
python3 benchmarks/kaizen_table.py --smaller-model "$WORK/$name" --no-control --baselines none --compose-factors none \
    --n-per-task "${N_PER_TASK:-100}" --device "${DEVICE:-cuda}" --out "$OUT/kaizen_table_smaller_model.json" \
    --plot "$OUT/kaizen_table_smaller_model.png" ${TABLE_ARGS:-} > "$OUT/kaizen_table_smaller_model.log" 2>&1
echo "table rc=$? $(date -u +%H:%M:%S)"; tail -n 12 "$OUT/kaizen_table_smaller_model.log"
cp "$WORK/$name/pretrain_log.json" "$OUT/pretrain_log_$name.json" 2>/dev/null
tar -C "$WORK" -cf "$OUT/smaller_model.tar" "$name"
ls -la "$OUT"
