#!/usr/bin/env bash
# The KV-Kaizen comparison table on the testbed (benchmarks/kaizen_table.py, issue #11 item 9), in two processes
# that share the GPU from the start (the testbed teacher is small):
#   - the training-free rows on the teacher: the control, the baselines at factors 2,4,8,16 and
#     kaizen+snapkv/kaizen+kvpop at 16 and 32 (`--minutes TOTAL_MINUTES - 0.5`) -> $OUT/kaizen_table_baselines.json;
#   - two selectors trained with `kvlearn kaizen-train` (targets 4 and 8, precision + depth, TRAIN_MINUTES each,
#     concurrently), then their rows and their untrained-backbone rows with the minutes left
#     -> $OUT/kaizen_table_selectors.json;
# merged (`python -m kvlearn.results merge`) into $OUT/kaizen_table.json with its plot $OUT/kaizen_table.png; the
# selectors under $OUT/kaizen-t4, $OUT/kaizen-t8, logs in $OUT/*.log. (Before, the baselines ran after the selectors
# and two runs in a row, 3859a14 and b6634e3, were cut by the time guard before any baseline row.)
# Device time: one call of about TOTAL_MINUTES (default 9.5: training TRAIN_MINUTES default 4 with ~1 minute of
# start-up and saving, then the selectors' rows with what is left, at least 1 minute) plus the machine's start-up;
# `not_run` in the merged file lists the runs a guard cut (run kaizen_table.py again with --selector
# $OUT/kaizen-t4/final ... and --baselines/--factors for them, then merge).
# MODEL (default: the shipped checkpoints/testbed-teacher); N_PER_TASK (default 100); SEQ_LEN and BATCH (training,
# defaults 4096 and 8); TRAIN_ARGS: more kaizen-train options (e.g. '--dense-fraction 0.25': more rows in the
# evaluation format, docs/DESIGN.md section 8, "Which layers the selector may share"); CONTROL: a same-recipe
# uncompressed fine-tune for the control row (default: the teacher).
# DRY_RUN=1 checks the plumbing on the CPU: the processes print their command lines, and two fake parts are merged.
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
run() {  # the command, or with DRY_RUN=1 its line
    if [ "${DRY_RUN:-0}" = 1 ]; then echo "dry run: $*"; else "$@"; fi
}
run python3 benchmarks/kaizen_table.py --model "$MODEL" ${CONTROL:+--control "$CONTROL"} --n-per-task "${N_PER_TASK:-100}" \
    --first-factors 4,8 --minutes "$(python3 -c "print(max(1.0, $TOTAL_MINUTES - 0.5))")" --out "$OUT/kaizen_table_baselines.json" \
    > "$OUT/kaizen_table_baselines.log" 2>&1 &
baselines=$!
trainers=()
for t in 4 8; do
    run python3 -m kvlearn.cli kaizen-train --model "$MODEL" --out "$OUT/kaizen-t$t" --overwrite --target "$t" \
        --minutes "$TRAIN_MINUTES" --seq-len "${SEQ_LEN:-4096}" --batch-size "${BATCH:-8}" --device cuda \
        --save-interval 100000 ${TRAIN_ARGS:-} > "$OUT/kaizen_train_t$t.log" 2>&1 &
    trainers+=($!)
done
wait "${trainers[@]}"
tail -n 3 "$OUT"/kaizen_train_t*.log
selectors=()
for t in 4 8; do
    if [ -f "$OUT/kaizen-t$t/final/config.json" ] || [ "${DRY_RUN:-0}" = 1 ]; then
        selectors+=(--selector "kaizen$t=$OUT/kaizen-t$t/final")
    else
        echo "kaizen-train target $t left no final/ folder: its rows are missing (see $OUT/kaizen_train_t$t.log)"
    fi
done
left=$(python3 -c "print(max(1.0, round($TOTAL_MINUTES - ($(date +%s) - $start) / 60 - 0.5, 2)))")
echo "selectors' rows: $left minutes"
run python3 benchmarks/kaizen_table.py --model "$MODEL" ${CONTROL:+--control "$CONTROL"} "${selectors[@]}" \
    --baselines none --compose-factors none --n-per-task "${N_PER_TASK:-100}" --minutes "$left" \
    --out "$OUT/kaizen_table_selectors.json" > "$OUT/kaizen_table_selectors.log" 2>&1
wait "$baselines"
tail -n 20 "$OUT/kaizen_table_selectors.log" "$OUT/kaizen_table_baselines.log"
if [ "${DRY_RUN:-0}" = 1 ]; then  # two fake parts, so that the merge and the plot below run
    python3 - "$OUT" <<'PY'
import sys
from kvlearn.results import make_results, write_results
row = lambda m, f, **kw: {"method": m, "protocol": "bounded", "split": "eval", "budget": 4096, "context": 4096,
                          "task": "niah", "accuracy": 0.5, "n": 2, "factor": f, "compression": 1 - 1 / f, "model": "teacher", **kw}
write_results(f"{sys.argv[1]}/kaizen_table_selectors.json", make_results(
    "accuracy", [row("control", 1.0), row("kaizen", 4.0, selector="kaizen4")], device="cpu", command="s", commit="x"))
write_results(f"{sys.argv[1]}/kaizen_table_baselines.json", make_results(
    "accuracy", [row("control", 1.0), row("static", 4.0)], device="cpu", command="b", commit="x"))
PY
fi
python3 -m kvlearn.results merge "$OUT/kaizen_table.json" "$OUT/kaizen_table_selectors.json" \
    "$OUT/kaizen_table_baselines.json"
python3 -c "
import sys
from kvlearn.eval.plots import plot_pareto
from kvlearn.results import read_results
rows = read_results(sys.argv[1])['rows']
print('wrote', plot_pareto(rows, sys.argv[2], title='KV-Kaizen comparison, context 4096', x='factor', reference='control'))
" "$OUT/kaizen_table.json" "$OUT/kaizen_table.png"
