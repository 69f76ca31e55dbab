#!/usr/bin/env bash
# Does training KVpop's scorers through the distillation loss close DMS's lead at CR 94%? (issue #10; docs/DESIGN.md
# section 5, "Scorers through the distillation loss"). KVpop students of Table 1's CR 94% recipe (budget 256, window
# 128, 1,300 steps, lr 1e-4; the mLSTM with its state in the budget and readout penalty 30) retrofitted from the
# teacher side by side on the one GPU, each with `kvlearn retrofit --scorer-kd W`, each a
# `benchmarks/device/kvpop_table.sh` chain that tables its student on both splits (n = N_PER_TASK, default 100) at
# its budget -> <tag>/kvpop_table.json. The comparison at weight 0 at budget 256: KVpop-MLP 0.65 / 0.60 of the
# teacher (results/kvpop_table.json), the mLSTM 0.62 / 0.58 (results/raw/kvpop_mlstm_readout_penalty_p30_b256_w128_3f69941.json),
# DMS 0.73 / 0.73. Session 30's two calls made Table 1's mLSTM rows (results/raw/README.md).
# RUNS: space-separated 'SCORER:W:TAU:SEED:RUN_BUDGET:RUN_WINDOW' entries (SCORER mlp or mlstm, W the --scorer-kd
# weight, TAU its temperature, default the trainer's 1, SEED default 0, RUN_BUDGET and RUN_WINDOW default BUDGET and
# WINDOW); the folder tag is <SCORER>_kd<W>, then _t<TAU>, _s<SEED>, _b<RUN_BUDGET> and _w<RUN_WINDOW> when given.
# Default: RUNS='mlp:1 mlstm:1 mlp:0.1'.
# BUDGET (default 256) and WINDOW (default 128) set the pattern; KD_QUERIES the rows per step (default the
# trainer's 256).
# Everything comes back packed in $OUT/kvpop_scorer_kd.tar (the device returns at most 8 files), with each run's
# training log as train_log_<tag>.jsonl.gz.
# Device time: 505 s for the default RUNS and 572 s for three mLSTMs at 256 / 512 / 1024 (session 30), plus the
# machine's start-up. STEPS (default 1300), RETROFIT_ARGS, TABLE_ARGS, WORK_DIR
# and the chain's DEVICE, MODEL, N_PER_TASK let it run as a CPU smoke test (tests/eval/test_kvpop_scorer_kd_script.py).
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/device/kvpop_scorer_kd.sh
set -u
. "$(dirname "$0")/pack_out.sh"
. "$(dirname "$0")/student_chains.sh"
OUT=${OUT:-out}; mkdir -p "$OUT"
export WORK_DIR=${WORK_DIR:-/tmp}
B=${BUDGET:-256}; WIN=${WINDOW:-128}
for run in ${RUNS:-mlp:1 mlstm:1 mlp:0.1}; do
    IFS=: read -r scorer w tau seed budget window <<< "$run"
    case $scorer in
        mlp) student=kvpop_mlp ;;
        mlstm) student=kvpop ;;
        *) echo "RUNS entry '$run': the scorer must be mlp or mlstm"; exit 2 ;;
    esac
    tag=${scorer}_kd$w; extra="--scorer-kd $w"; options=""
    # the soft rows compiled (a speed setting, results/raw/retrofit_step_speed_scorer_kd_h200_c2baa20.json); SCORER_KD_COMPILE=0: eager
    [ "$w" != 0 ] && [ "${SCORER_KD_COMPILE:-1}" != 0 ] && extra="$extra --scorer-kd-compile"
    [ -n "${tau:-}" ] && { tag=${tag}_t$tau; extra="$extra --scorer-kd-temperature $tau"; }
    [ -n "${KD_QUERIES:-}" ] && extra="$extra --scorer-kd-queries $KD_QUERIES"
    [ -n "${seed:-}" ] && { tag=${tag}_s$seed; options="--seed $seed"; }
    [ -n "${budget:-}" ] && tag=${tag}_b$budget
    [ -n "${window:-}" ] && tag=${tag}_w$window
    start_chain "$tag" "$student" "${budget:-$B}" "--window ${window:-$WIN} $options" "$extra"
done
finish_chains
pack_out "$OUT" kvpop_scorer_kd
