# Sourced by the device scripts that retrofit several KVpop students side by side, each a
# `benchmarks/device/kvpop_table.sh` chain tabling its one student on both splits at its budget:
#   start_chain TAG STUDENT BUDGET RETROFIT_OPTIONS KVPOP_EXTRA   starts one chain in the background (STUDENT:
#       kvpop_mlp or kvpop, the mLSTM; Table 1's recipe: STEPS steps, default 1300, at lr 1e-4), its table in
#       $OUT/TAG, its log in $OUT/chain_TAG.log, its retrofit in $WORK_DIR/table_TAG_STUDENT
#   finish_chains   waits for them, prints each chain's summary and copies each training log to
#       $OUT/train_log_TAG.jsonl.gz
# RETROFIT_ARGS and TABLE_ARGS (more options of every retrofit / table) come last and win.
chain_pids=(); chain_tags=(); chain_students=()
start_chain() {
    local tag=$1 student=$2 budget=$3 options=$4 extra=$5
    OUT=$OUT/$tag TAG=_$tag STUDENTS="$student=kvpop" BUDGET=$budget RETROFIT_STEPS=${STEPS:-1300} \
        RETROFIT_ARGS="--lr 1e-4 --num-workers 2 $options ${RETROFIT_ARGS:-}" \
        KVPOP_EXTRA="--decay-init 0.99999 --target-reduction peak $extra" BASELINES=0 SPLIT_PARTS=1 \
        TABLE_ARGS="--budgets $budget ${TABLE_ARGS:-}" EXPORT_STUDENTS=0 \
        bash benchmarks/device/kvpop_table.sh > "$OUT/chain_$tag.log" 2>&1 &
    chain_pids+=($!); chain_tags+=("$tag"); chain_students+=("$student")
}
finish_chains() {
    local i tag log
    for p in "${chain_pids[@]}"; do wait "$p"; done
    for i in "${!chain_tags[@]}"; do
        tag=${chain_tags[$i]}
        echo "== $tag: $(grep -c 'rc=0' "$OUT/chain_$tag.log") runs ended well"
        grep -hE "^kvpop" "$OUT/$tag"/kvpop_table_*.log 2>/dev/null
        log=$WORK_DIR/table_${tag}_${chain_students[$i]}/train_log.jsonl
        [ -f "$log" ] && gzip -c "$log" > "$OUT/train_log_$tag.jsonl.gz"
    done
}
