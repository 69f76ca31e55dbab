#!/usr/bin/env bash
# Does a selector's per-family choice pay? (issue #11; benchmarks/kaizen_family_swap.py, docs/DESIGN.md section 8,
# "Per-prompt choices"). One device call:
#   1. an 8x selector trained by benchmarks/device/kaizen_table.sh (TARGETS=8, SEEDS=SEED default 0, TRAIN_MINUTES
#      default 6.3, TRAIN_ARGS default: session 26's threshold-0.2 recipe, the one whose seed 0 chose per family), its
#      rows on both splits (no untrained-backbone rows) -> sel/;
#   2. the configuration each family mostly received (plus EXTRA_CONFIGS, ';'-separated, e.g. the other family's
#      configuration when the selector returns one for all), each served to every family on the selector's own
#      folder (`kvlearn eval --method kaizen_static --configuration C`, both splits, side by side) -> static_<i>_<split>.json;
#   3. `kaizen_family_swap.py summary` -> kaizen_family_swap.json: per family, its own configuration against the others.
# Everything but the selector's weights comes back in $OUT/kaizen_family_swap.tar.
# Device time: about 9 minutes plus the machine's start-up. DEVICE, MODEL, N_PER_TASK, SEQ_LEN, BATCH, TRAIN_MINUTES,
# TOTAL_MINUTES, TRAIN_ARGS, SELECTOR_TABLE_ARGS and EVAL_ARGS let it run as a CPU smoke test
# (tests/eval/test_kaizen_family_swap_script.py).
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/device/kaizen_family_swap.sh
set -u
. "$(dirname "$0")/pack_out.sh"
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
SEED=${SEED:-0}
OUT=$OUT/sel BASELINE_PARTS=none TARGETS=8 SEEDS=$SEED TRAIN_MINUTES=${TRAIN_MINUTES:-6.3} \
    TOTAL_MINUTES=${TOTAL_MINUTES:-8.2} \
    TRAIN_ARGS=${TRAIN_ARGS:---dense-fraction 0.25 --underuse-weight 1 --share-layers auto --share-threshold 0.2 --lr 1e-4} \
    SELECTOR_TABLE_ARGS="--no-untrained ${SELECTOR_TABLE_ARGS:-}" bash benchmarks/device/kaizen_table.sh > "$OUT/selector.log" 2>&1
echo "selector rc=$? $(date -u +%H:%M:%S)"
rows=$OUT/sel/kaizen_table_selector_t8_s$SEED.json
selector=$OUT/sel/kaizen-t8_s$SEED/final
extra=()
IFS=';' read -ra extra_configs <<< "${EXTRA_CONFIGS:-}"
for c in "${extra_configs[@]}"; do [ -n "$c" ] && extra+=(--extra "$c"); done
if ! mapfile -t configs < <(python3 benchmarks/kaizen_family_swap.py configs "$rows" "${extra[@]}") || [ ${#configs[@]} -eq 0 ]; then
    echo "no configurations from $rows: see $OUT/selector.log"; tail -n 5 "$OUT/selector.log"; exit 1
fi
printf 'configuration: %s\n' "${configs[@]}"
i=0
for c in "${configs[@]}"; do
    for split in eval heldout; do
        # shellcheck disable=SC2086
        python3 -m kvlearn.cli eval --model "$selector" --method kaizen_static --configuration "$c" --split "$split" \
            --n-per-task "${N_PER_TASK:-100}" --device "${DEVICE:-cuda}" --batch-size 64 ${EVAL_ARGS:-} \
            --out "$OUT/static_${i}_$split.json" > "$OUT/static_${i}_$split.log" 2>&1 &
    done
    i=$((i + 1))
done
wait
python3 benchmarks/kaizen_family_swap.py summary "$rows" "$OUT"/static_*.json --out "$OUT/kaizen_family_swap.json"
echo "summary rc=$?"
find "$OUT/sel" \( -name '*.safetensors' -o -name '*.pt' \) -delete
pack_out "$OUT" kaizen_family_swap
