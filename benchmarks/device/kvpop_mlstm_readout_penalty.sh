#!/usr/bin/env bash
# Does a penalty on the mLSTM readout's weights keep recall at CR 88%? (issue #10; docs/DESIGN.md section 5, "The
# readout penalty"). Three mLSTM students of Table 1's recipe (budget 512, 1,300 steps, lr 1e-4, the state in the
# budget) retrofitted from the teacher side by side on the one GPU, one per weight of WEIGHTS (default '0.3 3 30',
# `kvlearn retrofit --readout-penalty W`), each a `benchmarks/device/kvpop_table.sh` chain that tables its student on
# both splits (n = N_PER_TASK, default 100) -> p<W>/kvpop_table.json. Everything comes back packed in
# $OUT/kvpop_mlstm_readout_penalty.tar (the device returns at most 8 files), with each run's training log (the
# penalty is logged per step).
# Device time: about 8.5 minutes plus the machine's start-up. STEPS (default 1300), BUDGET (default 512),
# RETROFIT_ARGS, TABLE_ARGS, WORK_DIR and the chain's DEVICE, MODEL, N_PER_TASK let it run as a CPU smoke test
# (tests/eval/test_kvpop_mlstm_readout_penalty_script.py).
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/device/kvpop_mlstm_readout_penalty.sh
set -u
. "$(dirname "$0")/pack_out.sh"
OUT=${OUT:-out}; mkdir -p "$OUT"
export WORK_DIR=${WORK_DIR:-/tmp}
B=${BUDGET:-512}
pids=()
for w in ${WEIGHTS:-0.3 3 30}; do
    OUT=$OUT/p$w TAG=_p$w STUDENTS='kvpop=kvpop' BUDGET=$B RETROFIT_STEPS=${STEPS:-1300} \
        RETROFIT_ARGS="--lr 1e-4 --num-workers 2 ${RETROFIT_ARGS:-}" \
        KVPOP_EXTRA="--decay-init 0.99999 --target-reduction peak --readout-penalty $w" BASELINES=0 SPLIT_PARTS=1 \
        TABLE_ARGS="--budgets $B ${TABLE_ARGS:-}" EXPORT_STUDENTS=0 \
        bash benchmarks/device/kvpop_table.sh > "$OUT/chain_p$w.log" 2>&1 &
    pids+=($!)
done
for p in "${pids[@]}"; do wait "$p"; done
for w in ${WEIGHTS:-0.3 3 30}; do
    echo "== weight $w: $(grep -c 'rc=0' "$OUT/chain_p$w.log") runs ended well"
    grep -hE "^kvpop " "$OUT/p$w"/kvpop_table_*.log 2>/dev/null
    log=$WORK_DIR/table_p${w}_kvpop/train_log.jsonl
    [ -f "$log" ] && gzip -c "$log" > "$OUT/train_log_p$w.jsonl.gz"
done
pack_out "$OUT" kvpop_mlstm_readout_penalty
