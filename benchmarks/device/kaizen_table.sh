#!/usr/bin/env bash
# The KV-Kaizen comparison table on the testbed (benchmarks/kaizen_table.py, issue #11 item 9): trains two selectors
# with `kvlearn kaizen-train` (targets 4 and 8, precision + depth, TRAIN_MINUTES each, the two processes concurrently
# on the one GPU: the testbed teacher is small), then evaluates the control, both selectors, their untrained-backbone
# rows, the baselines at factors 2,4,8,16 and kaizen+snapkv/kaizen+kvpop at 16 and 32 with the minutes left, into
# $OUT/kaizen_table.json and $OUT/kaizen_table.png; the selectors under $OUT/kaizen-t4, $OUT/kaizen-t8, logs in
# $OUT/*.log.
# Device time: one call of about TOTAL_MINUTES (default 9.5: training TRAIN_MINUTES default 4 with ~1 minute of
# start-up and saving, then the table with what is left, at least 1 minute) plus the machine's start-up. Not yet run:
# the table's full plan (n 100 per family, both splits) will not fit the time left; `not_run` in the file lists the
# runs cut (run kaizen_table.py again with --selector $OUT/kaizen-t4/final ... and --baselines/--factors for them).
# MODEL (default: the shipped checkpoints/testbed-teacher); N_PER_TASK (default 100); SEQ_LEN and BATCH (training,
# defaults 4096 and 8); CONTROL: a same-recipe uncompressed fine-tune for the control row (default: the teacher).
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/device/kaizen_table.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
MODEL=${MODEL:-checkpoints/testbed-teacher}
TRAIN_MINUTES=${TRAIN_MINUTES:-4}
TOTAL_MINUTES=${TOTAL_MINUTES:-9.5}
mkdir -p "$OUT"
echo "commit=${KVLEARN_COMMIT:-?} $(python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
start=$(date +%s)
for t in 4 8; do
    python3 -m kvlearn.cli kaizen-train --model "$MODEL" --out "$OUT/kaizen-t$t" --overwrite --target "$t" \
        --minutes "$TRAIN_MINUTES" --seq-len "${SEQ_LEN:-4096}" --batch-size "${BATCH:-8}" --device cuda \
        --save-interval 100000 > "$OUT/kaizen_train_t$t.log" 2>&1 &
done
wait
tail -n 3 "$OUT"/kaizen_train_t*.log
selectors=()
for t in 4 8; do
    if [ -f "$OUT/kaizen-t$t/final/config.json" ]; then
        selectors+=(--selector "kaizen$t=$OUT/kaizen-t$t/final")
    else
        echo "kaizen-train target $t left no final/ folder: its rows are missing (see $OUT/kaizen_train_t$t.log)"
    fi
done
left=$(python3 -c "print(max(1.0, round($TOTAL_MINUTES - ($(date +%s) - $start) / 60 - 0.5, 2)))")
echo "table: $left minutes"
python3 benchmarks/kaizen_table.py --model "$MODEL" ${CONTROL:+--control "$CONTROL"} "${selectors[@]}" \
    --n-per-task "${N_PER_TASK:-100}" --minutes "$left" --out "$OUT/kaizen_table.json" > "$OUT/kaizen_table.log" 2>&1
tail -n 40 "$OUT/kaizen_table.log"
