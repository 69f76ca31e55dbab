#!/usr/bin/env bash
# Does a penalty on the mLSTM readout's weights keep recall? (issue #10; docs/DESIGN.md section 5, "The readout
# penalty"). Three mLSTM students of Table 1's recipe (1,300 steps, lr 1e-4, the state in the budget) retrofitted from
# the teacher side by side on the one GPU, each with `kvlearn retrofit --readout-penalty W`, each a
# `benchmarks/device/kvpop_table.sh` chain that tables its student on both splits (n = N_PER_TASK, default 100) at its
# budget -> <tag>/kvpop_table.json.
# RUNS: space-separated 'W:BUDGET:WINDOW:SEED' entries (BUDGET default $BUDGET or 512, WINDOW default the trainer's,
# SEED default 0); the folder tag is p<W>, then _b<BUDGET> when the budget is not $BUDGET, _w<WINDOW> and _s<SEED>
# when given. Without RUNS: one run per weight of WEIGHTS (default '0.3 3 30') at BUDGET, session 28's first sweep.
# Session 28's second call (Table 1's three budgets at weight 30, and a second seed at 512):
#   RUNS='30:1024 30:256:128 30:512::1'
# Everything comes back packed in $OUT/kvpop_mlstm_readout_penalty.tar (the device returns at most 8 files), with
# each run's training log (the penalty is logged per step) as train_log_<tag>.jsonl.gz.
# The students train without the scorer-KD path that Table 1's mLSTM recipe gained in session 30 (MLSTM_SCORER_KD,
# default here 0), so the sweep stays the one session 28 recorded.
# Device time: about 7 minutes plus the machine's start-up. STEPS (default 1300), RETROFIT_ARGS, TABLE_ARGS,
# WORK_DIR and the chain's DEVICE, MODEL, N_PER_TASK let it run as a CPU smoke test
# (tests/eval/test_kvpop_mlstm_readout_penalty_script.py).
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/device/kvpop_mlstm_readout_penalty.sh
set -u
. "$(dirname "$0")/pack_out.sh"
. "$(dirname "$0")/student_chains.sh"
OUT=${OUT:-out}; mkdir -p "$OUT"
export WORK_DIR=${WORK_DIR:-/tmp} MLSTM_SCORER_KD=${MLSTM_SCORER_KD:-0}
B=${BUDGET:-512}
if [ -z "${RUNS:-}" ]; then RUNS=""; for w in ${WEIGHTS:-0.3 3 30}; do RUNS="$RUNS $w"; done; fi
for run in $RUNS; do
    IFS=: read -r w b win seed <<< "$run"
    b=${b:-$B}; tag=p$w; options=""
    [ "$b" != "$B" ] && tag=${tag}_b$b
    [ -n "${win:-}" ] && { tag=${tag}_w$win; options="$options --window $win"; }
    [ -n "${seed:-}" ] && { tag=${tag}_s$seed; options="$options --seed $seed"; }
    start_chain "$tag" kvpop "$b" "$options" "--readout-penalty $w"
done
finish_chains
pack_out "$OUT" kvpop_mlstm_readout_penalty
