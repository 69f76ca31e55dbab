#!/usr/bin/env bash
# Does refitting the mLSTM student's scorers on its own frozen backbone close its gap at CR 88%? (issue #10; the
# question of docs/DESIGN.md section 5, "Where the mLSTM's gap is"). One device call, three steps:
#   1. Table 1's mLSTM student at CR 88% as it was until session 28 (benchmarks/device/kvpop_table.sh: budget 512,
#      1,300 steps, lr 1e-4, the state in the budget, no readout penalty: MLSTM_READOUT_PENALTY default 0 here), evaluated through its cache on both splits -> $OUT/student/kvpop_table.json;
#   2. two scorer-only refits of it side by side (benchmarks/device/retrofit.sh with `--init-student <step 1>
#      --freeze-backbone`: only the scorers and decays train, by the boundary loss, on the student's own backbone),
#      REFIT_STEPS steps each (default 400), one at the trainer's lr_new (1e-3, warm-up then cosine) and one at
#      REFIT_LOW_LR (default 3e-4: a fine-tune of scorers that are already trained), each evaluated through its cache
#      on both splits -> $OUT/refit/kvpop_mlstm_512_refit_<split>.json and $OUT/refit_lr/...;
#   3. everything but the students packed into $OUT/kvpop_mlstm_scorer_refit.tar (the device returns at most 8
#      files), the refitted student at lr_new as $OUT/refit/kvpop_mlstm_512_refit.tar (bf16).
# Device time: about 8 minutes plus the machine's start-up. WORK_DIR (default /tmp) is where the runs write; BUDGET
# (default 512), STUDENT_ARGS / REFIT_ARGS (more retrofit options of step 1 / 2), TABLE_ARGS, and the sub-scripts'
# DEVICE, MODEL, CONTEXT, N, N_PER_TASK and EVAL_ARGS let it run as a CPU smoke test on a tiny model
# (tests/eval/test_kvpop_mlstm_scorer_refit_script.py).
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/device/kvpop_mlstm_scorer_refit.sh
set -u
. "$(dirname "$0")/pack_out.sh"
OUT=${OUT:-out}; mkdir -p "$OUT"
export WORK_DIR=${WORK_DIR:-/tmp}
STEPS_1=${STUDENT_STEPS:-1300}
REFIT=${REFIT_STEPS:-400}
B=${BUDGET:-512}
echo "step 1: the mLSTM student, $STEPS_1 steps $(date -u +%H:%M:%S)"
OUT=$OUT/student STUDENTS='kvpop=kvpop' MLSTM_READOUT_PENALTY=${MLSTM_READOUT_PENALTY:-0} TAG=_m$B BUDGET=$B RETROFIT_STEPS=$STEPS_1 RETROFIT_ARGS="--lr 1e-4 ${STUDENT_ARGS:-}" \
    BASELINES=0 SPLIT_PARTS=1 TABLE_MINUTES=${TABLE_MINUTES:-3} TABLE_ARGS="--budgets $B ${TABLE_ARGS:-}" EXPORT_STUDENTS=0 \
    bash benchmarks/device/kvpop_table.sh > "$OUT/student.log" 2>&1
echo "step 1 rc=$? $(date -u +%H:%M:%S)"; grep -E "rc=|^kvpop" "$OUT/student.log" | tail -n 8
student=$WORK_DIR/table_m${B}_kvpop/final
if [ ! -f "$student/config.json" ]; then echo "no student at $student: see $OUT/student.log"; exit 1; fi
refit_common="--init-student $student --freeze-backbone --state-in-budget 1 --decay-init 0.99999 --target-reduction peak"
echo "step 2: two scorer-only refits, $REFIT steps each $(date -u +%H:%M:%S)"
OUT=$OUT/refit SCORER=mlstm BUDGET=$B STEPS=$REFIT TAG=refit PARALLEL_EVALS=1 EXTRA="$refit_common ${REFIT_ARGS:-}" \
    bash benchmarks/device/retrofit.sh > "$OUT/refit.log" 2>&1 &
a=$!
OUT=$OUT/refit_lr SCORER=mlstm BUDGET=$B STEPS=$REFIT TAG=refit_lr PARALLEL_EVALS=1 \
    EXTRA="$refit_common --lr-new ${REFIT_LOW_LR:-3e-4} ${REFIT_ARGS:-}" \
    bash benchmarks/device/retrofit.sh > "$OUT/refit_lr.log" 2>&1 &
b=$!
wait $a; echo "refit rc=$?"; wait $b; echo "refit_lr rc=$? $(date -u +%H:%M:%S)"
grep -hE "^kvpop|rc=" "$OUT/refit.log" "$OUT/refit_lr.log" | tail -n 12
# the training logs of all three runs (per-step loss terms and the retention recall against the teacher policy)
for run in table_m${B}_kvpop retrofit_mlstm_${B}_refit retrofit_mlstm_${B}_refit_lr; do
    [ -f "$WORK_DIR/$run/train_log.jsonl" ] && gzip -c "$WORK_DIR/$run/train_log.jsonl" > "$OUT/train_log_$run.jsonl.gz"
done
rm -f "$OUT"/refit_lr/*.tar
pack_out "$OUT" kvpop_mlstm_scorer_refit
