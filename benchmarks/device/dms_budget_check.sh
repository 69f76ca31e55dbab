#!/usr/bin/env bash
# Does the per-head cap cost the DMS student trained for budget 1024 its accuracy? (issue #10: the 1,300-step
# reproduction's DMS at 1024 kept 0.422 / 0.343 of the record's 0.920 / 0.917, whose row is the budget-512 student
# served at 1024; docs/FINDINGS.md, "KVpop".) One call, three steps:
#   1. DMS students retrofitted one after another from the teacher, 1,300 steps each (STEPS), one per STUDENTS
#      entry (default '1024': budget 1024, target CR 4, the reproduction's student; '512' is the record's, target
#      CR 8), as benchmarks/device/kvpop_table.sh trains them (`kvlearn retrofit --method dms --budget B`); an entry
#      'B:head' trains with `--compression-scope head` (each KV head held to its own long-range slots, target CR
#      context / (B - sinks - window) by default: docs/DESIGN.md section 9, "Does the cap bind?");
#   2. benchmarks/dms_head_load.py on each at budgets LOAD_BUDGETS (default its own budget and twice it, e.g.
#      1024,2048; N_LOAD prompts per family, default 8, eval split): how many tokens each head's gates keep against
#      its long-range slots, and the needed tokens the cap would drop;
#   3. `kvlearn eval --method dms` of each student at its own budget and at CONTEXT - 1 (or, with EVAL_BUDGETS set,
#      of each student trained for the first entry's budget at those; N prompts per family, default 100, eval
#      split). 4095 is the largest budget a 4,096-token context takes, and its 3,835 long-range slots hold every key
#      of any prompt, so there the gates alone decide (at 2048 the heads that keep the whole context still
#      overflow: session 45's head load); if the cap is what costs the accuracy, 4095 gives it back.
# Writes $OUT/dms_load_<label>.json, $OUT/<label>_eval_b<B>.json and $OUT/dms_check_logs.tar.gz (the heatmaps
# dms_load_<label>.png, the train logs train_log_<label>.jsonl and every log), with label dms_<B> or dms_<B>_head;
# when that is more than the 8 files a device call returns, the JSON files are packed in dms_check_results.tar.gz.
# Two calls on one H100 compare the scopes at every Table 1 budget: STUDENTS='1024:head 512:head', then
# STUDENTS='256:head' (220-270 s a student: training, head load and two served budgets; 270 s on one H100 in
# session 47, results/raw/device_stdout_session47_h100_cf9750c.log).
# Device time on one H100: a DMS retrofit alone runs 8.5 steps/s (1,300 steps in about 150 s), but two side by side ran
# 2.2 steps/s each (session 45: neither finished inside a 9-minute call), so the students train one after another.
# Measured on one H200 (session 46, results/raw/dms_budget_check_stdout_h200_86b159d.log): 220 s for STUDENTS='1024'
# and 234 s for STUDENTS='1024:head' (the retrofit command 147-163 s, of which training 134-152 s by the train logs;
# each served budget 17-21 s at batch 64, the table's).
# HELDOUT=1 also serves each student at its own budget on the held-out split -> $OUT/<label>_heldout_b<B>.json (session 48
# ran that by hand on the warm machine: results/raw/device_stdout_session48_h100_e132782.log, call 4; 17-18 s a
# student on one H100).
# Every student trains with the retrofit's default window (config.retrofit_window: 256 from budget 512 up, half the
# budget below, so 128 at 256), Table 1's window at every budget; RETROFIT_ARGS='--window N' sets another for all.
# FULL_CONTEXT=0 leaves out the serving at CONTEXT - 1: with HELDOUT=1, each student gives exactly a Table 1 row's two
# halves (about 20 s a student less). Table 1's DMS rows in the head scope on one H200, two calls:
#   STUDENTS='512:head 256:head' HELDOUT=1 FULL_CONTEXT=0, then STUDENTS='1024:head' (the same).
# OVERFLOW (a space list of DMSConfig.overflow_evicts orders, e.g. 'oldest newest') also serves each student at its
# own budget on the eval split with each of those orders of the full budget -> $OUT/<label>_eval_b<B>_overflow_<order>.json
# (about 20 s an order on one H100).
# KEEP_STUDENTS=1 also writes each student's final/ folder without the optimizer state, gzipped in parts of at most
# 15 MiB, $OUT/student_<label>.tar.gz.part_aa, _ab, ... (`cat` them, then `tar xz`; a float32 testbed student is
# 25 MB, two parts), which `kvlearn eval --model final` serves on another device or on the CPU: a student trained on
# one GPU and served on another, or on both,
# tells a training draw from a serving difference (session 47: the H100's student keeps 0.42 at 1024 on the H100 and
# on the CPU alike, and benchmarks/dms_cap_lift.py finds the cap on its layer 5 costs it: docs/FINDINGS.md, "On an H100").
# MODEL, DEVICE, CONTEXT, STEPS, N, N_LOAD, STUDENTS, LOAD_BUDGETS, EVAL_BUDGETS, RETROFIT_ARGS and EVAL_ARGS let it
# run as a CPU smoke test (tests/eval/test_dms_budget_check_script.py).
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=$OUT bash benchmarks/device/dms_budget_check.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}; mkdir -p "$OUT"
WORK_DIR=${WORK_DIR:-/tmp}
MODEL=${MODEL:-checkpoints/testbed-teacher}
DEVICE=${DEVICE:-cuda}
CONTEXT=${CONTEXT:-4096}
STUDENTS=${STUDENTS:-1024}
FIRST=${STUDENTS%% *}; FIRST=${FIRST%%:*}
# an entry is B[:head|:model]: the budget and the scope (default model); its label dms_B or dms_B_head
scope_of() { case $1 in *:head) echo head ;; *) echo model ;; esac; }
label_of() { echo "dms_${1%%:*}$([ "$(scope_of "$1")" = head ] && echo _head)"; }
echo "commit=${KVLEARN_COMMIT:-?} students: $STUDENTS $(date -u +%H:%M:%S)"
for s in $STUDENTS; do  # one after another: two DMS retrofits side by side ran at 2.2 steps/s each, one alone at 8.5
    b=${s%%:*}; label=$(label_of "$s"); scope=$(scope_of "$s")
    case $b in ""|*[!0-9]*) ok=0 ;; *) case ${s#"$b"} in ""|:head|:model) ok=1 ;; *) ok=0 ;; esac ;; esac
    [ "$ok" = 1 ] || { echo "STUDENTS entry '$s' is invalid: expected B[:head|:model], e.g. 256:head"; exit 2; }
    # shellcheck disable=SC2086
    python3 -m kvlearn.cli retrofit --model "$MODEL" --out "$WORK_DIR/check_$label" --overwrite --method dms \
        --budget "$b" --compression-scope "$scope" --steps "${STEPS:-1300}" --device "$DEVICE" --num-workers 3 \
        ${RETROFIT_ARGS:-} > "$OUT/retrofit_$label.log" 2>&1
    [ -f "$WORK_DIR/check_$label/final/config.json" ] || { echo "retrofit $label failed:"; tail -n 3 "$OUT/retrofit_$label.log"; exit 1; }
    cp "$WORK_DIR/check_$label/train_log.jsonl" "$OUT/train_log_$label.jsonl" 2>/dev/null
    echo "student $label trained $(date -u +%H:%M:%S)"
done
for s in $STUDENTS; do
    label=$(label_of "$s")
    b=${s%%:*}
    python3 benchmarks/dms_head_load.py --model "$WORK_DIR/check_$label/final" --budget "${LOAD_BUDGETS:-$b,$(( 2 * b ))}" \
        --n "${N_LOAD:-8}" --length "$CONTEXT" --device "$DEVICE" --out "$OUT/dms_load_$label.json" \
        --heatmap "$OUT/dms_load_$label.png" > "$OUT/dms_load_$label.log" 2>&1
    echo "head load of $label rc=$?"; grep "^budget" "$OUT/dms_load_$label.log"
done
for s in $STUDENTS; do
    # EVAL_BUDGETS given: the first entry's budget's students at those budgets; unset: every student at its own
    # budget and, unless FULL_CONTEXT=0, at CONTEXT - 1 (every key fits)
    if [ -n "${EVAL_BUDGETS:-}" ]; then [ "${s%%:*}" = "$FIRST" ] || continue; budgets=$EVAL_BUDGETS
    elif [ "${FULL_CONTEXT:-1}" = 0 ]; then budgets=${s%%:*}  # a table's rows only: its own budget
    else budgets="${s%%:*} $(( CONTEXT - 1 ))"; fi
    label=$(label_of "$s")
    runs=""; for eb in $budgets; do runs="$runs eval:$eb"; done
    # HELDOUT=1: also the held-out split at the student's own budget (a Table 1 row's other half)
    [ "${HELDOUT:-0}" = 1 ] && runs="$runs heldout:${s%%:*}"
    # OVERFLOW='oldest newest': also each of those orders of the full budget (--dms-overflow) at its own budget, eval
    for order in ${OVERFLOW:-}; do runs="$runs eval:${s%%:*}:$order"; done
    for run in $runs; do
        split=${run%%:*}; rest=${run#*:}; eb=${rest%%:*}; order=${rest#"$eb"}; order=${order#:}
        name="${label}_${split}_b$eb${order:+_overflow_$order}"
        # shellcheck disable=SC2086
        python3 -m kvlearn.cli eval --model "$WORK_DIR/check_$label/final" --method dms --budget "$eb" --split "$split" \
            --n-per-task "${N:-100}" --device "$DEVICE" --context "$CONTEXT" --batch-size 64 ${EVAL_ARGS:-} \
            ${order:+--dms-overflow "$order"} --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
        echo "$label served at $eb on $split${order:+ (overflow evicts $order)} rc=$?"; tail -n 5 "$OUT/$name.log"
    done
done
# the device returns at most 8 files: everything but the JSON results goes into one archive (the retrofit logs
# without their progress bars)
for f in "$OUT"/retrofit_*.log; do [ -f "$f" ] && tr '\r' '\n' < "$f" | grep -v "^retrofit:" > "$f.tmp" && mv "$f.tmp" "$f"; done
(cd "$OUT" && tar czf dms_check_logs.tar.gz --remove-files ./*.log ./*.png ./train_log_*.jsonl 2>/dev/null)
if [ "${KEEP_STUDENTS:-0}" = 1 ]; then  # each student's final/ weights and config, to serve it again elsewhere
    for s in $STUDENTS; do  # float32 weights (25 MB for the testbed's) in parts under a device file's 16 MiB
        label=$(label_of "$s")
        tar -C "$WORK_DIR/check_$label" --exclude=trainer_state.pt -cf - final | gzip -1 \
            | split -b 15m - "$OUT/student_$label.tar.gz.part_"
        echo "kept student_$label.tar.gz in $(ls "$OUT"/student_"$label".tar.gz.part_* | wc -l) part(s): cat them | tar xz"
    done
fi
# more than 8 files (several students): the JSON results go into one archive too
if [ "$(find "$OUT" -maxdepth 1 -type f | wc -l)" -gt 8 ]; then
    (cd "$OUT" && tar czf dms_check_results.tar.gz --remove-files ./*.json)
    echo "packed the JSON results in dms_check_results.tar.gz (a device call returns at most 8 files)"
fi
echo "done $(date -u +%H:%M:%S)"
