#!/usr/bin/env bash
# `kvlearn reproduce kvpop` (issue #10 item 6: the KVpop Table 1 rebuilt from the committed teacher) on a device whose
# calls are shorter than the whole run (about 9 minutes a budget by the chain's time guard, 27 for the three): each
# call runs the budgets BUDGETS (default 1024) with --resume into REP (default carry_eval/reproduce-kvpop), so the
# budgets an earlier call finished are kept, and the merged table covers every finished budget. At the end the
# students' checkpoints are deleted (about 13 MB of weights each, and their optimizer states) but their
# train_log.jsonl kept, and REP is packed as $OUT/reproduce-kvpop.tar: the per-budget tables and logs, the settings,
# the students' training logs and the merged table.
# Between calls: unpack the returned tar into REP on this machine and pass carry ["carry_eval"] to the next call,
# e.g. BUDGETS=1024, then 1024,512, then 1024,512,256 (a budget an earlier call finished costs nothing). The budgets
# of one table must come from one device model (a resumed folder another device measured is refused before anything
# runs: a call may get an H100 when it names an H200). A budget whose table
# stage was cut by its time guard (the baselines' held-out runs, on an H100 in session 40) is finished by the next
# call: only the runs it lacks are measured, the retrofits are not run again (a missing student run, whose
# checkpoint this script deleted, would need the whole chain again). A chain this call's LIMIT killed inside its
# table stage leaves its parts in the budget folder; the next call merges them before finishing.
# Passed through: MINUTES (default 5: a budget's chain fits one device call; not the table of record's recipe, whose
# students trained 1,300 steps each: in 5 minutes beside three others on one H100 DMS trains 481-488, session 41) or
# STEPS (`kvlearn reproduce`'s own default is 1,300 steps: four students and the table are longer than one call here;
# session 42 ran budget 512 with STEPS=1300 as STUDENT_LABELS=dms, then kvpop_mlp,kvpop, then streaming_plus: 375, 363
# and 177 s of reproduce command, results/reproduce_kvpop_1300_h100.json), N_PER_TASK (default 100), DEVICE (default cuda),
# STUDENT_LABELS (default all four: kvpop_mlp,kvpop,streaming_plus,dms) -> --students: the students this call trains;
# a later call with the others adds them to each budget's table (e.g. STEPS=1300 with STUDENT_LABELS=dms, then
# STUDENT_LABELS=kvpop_mlp,kvpop,streaming_plus: the recipe of record in calls of 10 minutes),
# CONTEXT_ROWS=1 -> --context-rows (the table of record's context rows of the training-free baselines, eval split),
# DMS_SCOPE (default head) -> --dms-scope: the DMS student's compression scope (a folder begun before session 48
# trained its DMS students with model: resuming it needs DMS_SCOPE=model);
# RETROFIT_ARGS and TABLE_ARGS (a CPU smoke run's tiny shapes: tests/eval/test_reproduce.py). LIMIT (default 580 s)
# is the reproduce command's timeout, under the call's 600 s.
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... BUDGETS=1024 bash benchmarks/device/reproduce_kvpop.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
REP=${REP:-carry_eval/reproduce-kvpop}
echo "commit=${KVLEARN_COMMIT:-?} $(python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
mkdir -p "$REP"
start=$(date +%s)
length=(--minutes "${MINUTES:-5}"); [ -n "${STEPS:-}" ] && length=(--steps "$STEPS")
context=(); [ "${CONTEXT_ROWS:-0}" = 1 ] && context=(--context-rows)
timeout "${LIMIT:-580}" python3 -m kvlearn.cli reproduce kvpop --resume --out "$REP" --budgets "${BUDGETS:-1024}" \
    "${length[@]}" --n-per-task "${N_PER_TASK:-100}" --device "${DEVICE:-cuda}" \
    --students "${STUDENT_LABELS:-kvpop_mlp,kvpop,streaming_plus,dms}" ${context[@]+"${context[@]}"} \
    --retrofit-args "${RETROFIT_ARGS:-}" --table-args "${TABLE_ARGS:-}" --dms-scope "${DMS_SCOPE:-head}" \
    > "$REP/reproduce.log" 2>&1
echo "reproduce rc=$? after $(( $(date +%s) - start )) s"; grep -E "^\[|^    finishing|^wrote|Error" "$REP/reproduce.log" | tail -n 8
sed -n '/^against /,$p' "$REP/reproduce.log"  # the merged table next to results/kvpop_table.json
[ -d "$REP/students" ] && find "$REP/students" -type f ! -name train_log.jsonl -delete && find "$REP/students" -type d -empty -delete
for f in "$REP"/budget*/kvpop_table.json; do
    [ -f "$f" ] && python3 -c "import json, sys; d = json.load(open(sys.argv[1])); print(sys.argv[1], 'rows', len(d['rows']), 'complete', d.get('complete'), 'not_run', len(d.get('not_run', [])))" "$f"
done
tar -C "$REP" -cf "$OUT/reproduce-kvpop.tar" . && ls -la "$OUT/reproduce-kvpop.tar"
