#!/usr/bin/env bash
# An mLSTM student that starts from the trained MLP student (issue #10, the mLSTM's gap at CR 88%; docs/DESIGN.md
# section 5, "The mLSTM from the MLP student"). `benchmarks/kvpop_mlstm_from_mlp.py` converts MLP_STUDENT (default
# checkpoints/testbed-kvpop, Table 1's MLP student at budget 512) into an mLSTM student whose skip path is the MLP
# scorer and whose readout weight is 0 (scores equal to the MLP student's), then, side by side on the one GPU:
#   as_is:  the converted student evaluated through its cache, its state in the budget (top-k 234 at 512), both
#           splits (benchmarks/kvpop_table.py) -> as_is/kvpop_table.json;
#   joint:  `kvlearn retrofit --init-student <converted> --scorer mlstm` with Table 1's recipe (budget 512, STEPS
#           default 1300, lr 1e-4, the state in the budget): backbone and scorer trained on from there -> joint/;
#   frozen: the same with --freeze-backbone, REFIT_STEPS (default 400): only the scorers and decays train -> frozen/;
# each retrofit evaluated through its cache on both splits (benchmarks/device/retrofit.sh). Everything but the
# students comes back in $OUT/kvpop_mlstm_from_mlp.tar (with the training logs), the joint student as
# $OUT/joint/kvpop_mlstm_512_joint.tar (bf16).
# Device time: about 7 minutes plus the machine's start-up. WORK_DIR (default /tmp), BUDGET, RETROFIT_ARGS, TABLE_ARGS
# and the sub-scripts' DEVICE, MODEL, CONTEXT, N, N_PER_TASK, EVAL_ARGS let it run as a CPU smoke test
# (tests/eval/test_kvpop_mlstm_from_mlp_script.py).
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/device/kvpop_mlstm_from_mlp.sh
set -u
. "$(dirname "$0")/pack_out.sh"
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}; mkdir -p "$OUT"
export WORK_DIR=${WORK_DIR:-/tmp}
B=${BUDGET:-512}
converted=$WORK_DIR/mlstm-from-mlp
python3 benchmarks/kvpop_mlstm_from_mlp.py --mlp-student "${MLP_STUDENT:-checkpoints/testbed-kvpop}" --out "$converted" \
    > "$OUT/convert.log" 2>&1 || { echo "conversion failed"; tail -n 3 "$OUT/convert.log"; exit 1; }
echo "converted $(date -u +%H:%M:%S)"
mkdir -p "$OUT/as_is"
# shellcheck disable=SC2086
python3 benchmarks/kvpop_table.py --model "${MODEL:-checkpoints/testbed-teacher}" --n-per-task "${N_PER_TASK:-100}" \
    --device "${DEVICE:-cuda}" --budgets "$B" --student "kvpop=kvpop:$converted" --baselines none --no-teacher \
    --out "$OUT/as_is/kvpop_table.json" --plot "$OUT/as_is/kvpop_table.png" ${TABLE_ARGS:-} > "$OUT/as_is/table.log" 2>&1 &
c=$!
common="--init-student $converted --state-in-budget 1 --decay-init 0.99999 --target-reduction peak --lr 1e-4 ${RETROFIT_ARGS:-}"
OUT=$OUT/joint SCORER=mlstm BUDGET=$B STEPS=${STEPS:-1300} TAG=joint PARALLEL_EVALS=1 EXTRA="$common" \
    bash benchmarks/device/retrofit.sh > "$OUT/joint.log" 2>&1 &
a=$!
OUT=$OUT/frozen SCORER=mlstm BUDGET=$B STEPS=${REFIT_STEPS:-400} TAG=frozen PARALLEL_EVALS=1 EXTRA="$common --freeze-backbone" \
    bash benchmarks/device/retrofit.sh > "$OUT/frozen.log" 2>&1 &
f=$!
wait $c; echo "as_is rc=$? $(date -u +%H:%M:%S)"
wait $f; echo "frozen rc=$? $(date -u +%H:%M:%S)"
wait $a; echo "joint rc=$? $(date -u +%H:%M:%S)"
grep -h "^kvpop" "$OUT/as_is/table.log" "$OUT/frozen.log" "$OUT/joint.log" | tail -n 24
for run in retrofit_mlstm_${B}_joint retrofit_mlstm_${B}_frozen; do
    [ -f "$WORK_DIR/$run/train_log.jsonl" ] && gzip -c "$WORK_DIR/$run/train_log.jsonl" > "$OUT/train_log_$run.jsonl.gz"
done
rm -f "$OUT"/frozen/*.tar
pack_out "$OUT" kvpop_mlstm_from_mlp
