#!/usr/bin/env bash
# Does the per-head cap cost the DMS student trained for budget 1024 its accuracy? (issue #10: the 1,300-step
# reproduction's DMS at 1024 kept 0.422 / 0.343 of the record's 0.920 / 0.917, whose row is the budget-512 student
# served at 1024; docs/FINDINGS.md, "KVpop".) One call, three steps:
#   1. two DMS students retrofitted side by side from the teacher, 1,300 steps each (STEPS), one for budget 1024
#      (target CR 4, the reproduction's) and one for budget 512 (target CR 8, the record's), as
#      benchmarks/device/kvpop_table.sh trains them (`kvlearn retrofit --method dms --budget B`);
#   2. benchmarks/dms_head_load.py on each at budgets 1024 and 2048 (N_LOAD prompts per family, eval split): how many
#      tokens each head's gates keep against its long-range slots, and the needed tokens the cap would drop;
#   3. `kvlearn eval --method dms` of the 1024 student at budgets 1024 and 2048 (N prompts per family, eval split):
#      if the cap is what costs it, the wider budget gives the accuracy back.
# Writes $OUT/dms_load_b{1024,512}.json (+ .png heatmaps), $OUT/dms1024_eval_b{1024,2048}.json and the logs.
# Device time (estimated from session 44's runs on one H100: DMS's 1,300 steps alone 150 s, side by side about
# twice that; each table row set of 100 prompts per family about 30 s): about 7 minutes.
# MODEL, DEVICE, CONTEXT, STEPS, N, N_LOAD, BUDGETS, LOAD_BUDGETS, EVAL_BUDGETS, RETROFIT_ARGS and EVAL_ARGS let it run as a CPU smoke test
# (tests/eval/test_dms_budget_check_script.py).
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=$OUT bash benchmarks/device/dms_budget_check.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}; mkdir -p "$OUT"
WORK_DIR=${WORK_DIR:-/tmp}
MODEL=${MODEL:-checkpoints/testbed-teacher}
DEVICE=${DEVICE:-cuda}
CONTEXT=${CONTEXT:-4096}
echo "commit=${KVLEARN_COMMIT:-?} $(date -u +%H:%M:%S)"
BUDGETS=${BUDGETS:-1024 512}  # the students' budgets; the first is the one served at EVAL_BUDGETS
FIRST=${BUDGETS%% *}
for b in $BUDGETS; do
    # shellcheck disable=SC2086
    python3 -m kvlearn.cli retrofit --model "$MODEL" --out "$WORK_DIR/dms_check_$b" --overwrite --method dms \
        --budget "$b" --steps "${STEPS:-1300}" --device "$DEVICE" --num-workers 3 ${RETROFIT_ARGS:-} \
        > "$OUT/retrofit_dms_$b.log" 2>&1 &
done
wait
for b in $BUDGETS; do
    [ -f "$WORK_DIR/dms_check_$b/final/config.json" ] || { echo "retrofit at budget $b failed:"; tail -n 3 "$OUT/retrofit_dms_$b.log"; exit 1; }
    cp "$WORK_DIR/dms_check_$b/train_log.jsonl" "$OUT/dms_train_log_$b.jsonl" 2>/dev/null
done
echo "students trained $(date -u +%H:%M:%S)"
for b in $BUDGETS; do
    python3 benchmarks/dms_head_load.py --model "$WORK_DIR/dms_check_$b/final" --budget "${LOAD_BUDGETS:-1024,2048}" \
        --n "${N_LOAD:-8}" --length "$CONTEXT" --device "$DEVICE" --out "$OUT/dms_load_b$b.json" \
        --heatmap "$OUT/dms_load_b$b.png" > "$OUT/dms_load_b$b.log" 2>&1
    echo "head load of the budget-$b student rc=$?"; grep "^budget" "$OUT/dms_load_b$b.log"
done
for eb in ${EVAL_BUDGETS:-1024 2048}; do
    # shellcheck disable=SC2086
    python3 -m kvlearn.cli eval --model "$WORK_DIR/dms_check_$FIRST/final" --method dms --budget "$eb" --split eval \
        --n-per-task "${N:-100}" --device "$DEVICE" --context "$CONTEXT" ${EVAL_ARGS:-} \
        --out "$OUT/dms${FIRST}_eval_b$eb.json" > "$OUT/dms${FIRST}_eval_b$eb.log" 2>&1
    echo "the budget-$FIRST student served at $eb rc=$?"; tail -n 5 "$OUT/dms${FIRST}_eval_b$eb.log"
done
echo "done $(date -u +%H:%M:%S)"
