#!/usr/bin/env bash
# Retrofit KVpop onto the testbed teacher on the GPU (`kvlearn retrofit`), then evaluate the student through its
# cache at the same budget on both splits (`kvlearn eval --method kvpop`), next to the teacher's streaming rows.
# SCORER (default mlp), BUDGET (default 1024), MINUTES (default 8; STEPS=<n> trains n steps instead, so that two
# retrofits run side by side, e.g. one with --kv-bits and its full-precision control, see the same data and steps),
# MODEL (default checkpoints/testbed-teacher),
# N (examples per family, default 100), EXTRA (more retrofit options), TAG (a suffix of the run's names, so that
# several retrofits can run side by side). Writes $OUT/retrofit_<scorer>_<budget>.log,
# $OUT/kvpop_<scorer>_<budget>_<split>.json, and the student as $OUT/kvpop_<scorer>_<budget>.tar (bf16 weights).
# COMPOSE_TARGET (e.g. 64, with EXTRA='--kv-bits 2' and BUDGET=512: a student retrofitted under 2-bit K/V at CR 88%):
# evaluate the student as it serves, `kvlearn eval --method kaizen+kvpop --target COMPOSE_TARGET` (the static
# configuration at COMPOSE_TARGET x BUDGET / 4096 under its own eviction), instead of `--method kvpop`; rows in
# $OUT/kaizen_kvpop_<tag>_<split>.json.
# DECOMPOSE=1 (with COMPOSE_TARGET): the same student also under each part alone, on the eval split, so that the
# composed rows are read against baselines of the same checkpoint: `dense` (its backbone), `kvpop --budget BUDGET`
# (the eviction alone) and the representation alone: `kaizen_static --configuration C` for a student retrofitted under
# a configuration C (`--kv-bits`, recorded in its config.json), else `kaizen_static --target COMPOSE_TARGET x BUDGET /
# 4096` (the uniform choice at that factor; before session 24 it was always this one); rows
# in $OUT/decompose_<tag>_<method>.json (about 40 s each on the H200).
# The evaluations run at the tables' batch 64 and prefill chunk 512 (kvpop_table.py, kaizen_table.py): at kvlearn
# eval's defaults (8, 256) one split of the composed cache took 179 s on the H200 (7fce8b6), at 64 / 512 38 s.
# PARALLEL_EVALS=1: the evaluations run at once (side by side on the GPU, each its own process; they are
# launch-bound, so together they take little longer than one).
# STUDENT=<folder>: no retrofit; that trained student is evaluated as above (with COMPOSE_TARGET / DECOMPOSE), and no
# tar is written (e.g. STUDENT=checkpoints/testbed-kvpop, the shipped student).
# Device time: MINUTES + ~1 minute of start-up + ~40 s of evaluation per split.
# DEVICE (default cuda), CONTEXT (default 4096), EVAL_ARGS (more options for every evaluation), WORK_DIR (default
# /tmp: the run and the exported student) let the same script run as a CPU smoke test on a tiny model
# (tests/eval/test_retrofit_script.py).
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/device/retrofit.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}
mkdir -p "$OUT"
SCORER=${SCORER:-mlp}; BUDGET=${BUDGET:-1024}; MINUTES=${MINUTES:-8}; N=${N:-100}
MODEL=${MODEL:-checkpoints/testbed-teacher}
tag=${SCORER}_${BUDGET}${TAG:+_$TAG}
RUN=${WORK_DIR:-/tmp}/retrofit_$tag
DEVICE=${DEVICE:-cuda}; CONTEXT=${CONTEXT:-4096}
length=(--minutes "$MINUTES"); [ -n "${STEPS:-}" ] && length=(--steps "$STEPS")
echo "commit=${KVLEARN_COMMIT:-?} $(python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
if [ -n "${STUDENT:-}" ]; then  # evaluate a trained student: its folder stands for the run's final checkpoint
    mkdir -p "$RUN" && ln -sfn "$(realpath "$STUDENT")" "$RUN/final" && : > "$OUT/retrofit_$tag.log"
else
    # shellcheck disable=SC2086
    python3 -m kvlearn.cli retrofit --model "$MODEL" --out "$RUN" --overwrite --device "$DEVICE" --scorer "$SCORER" \
        --budget "$BUDGET" "${length[@]}" --num-workers 8 ${EXTRA:-} > "$OUT/retrofit_$tag.log" 2>&1
    echo "retrofit rc=$?"; tail -n 3 "$OUT/retrofit_$tag.log"
fi
run_eval() {  # name, then kvlearn eval's arguments; in the background with PARALLEL_EVALS=1 (each its own log)
    local name=$1; shift
    if [ "${PARALLEL_EVALS:-0}" = 1 ]; then
        { python3 -m kvlearn.cli eval "$@" > "$OUT/eval_$name.log" 2>&1; echo "$name rc=$?"; } &
    else
        python3 -m kvlearn.cli eval "$@" >> "$OUT/retrofit_$tag.log" 2>&1; echo "$name rc=$?"
    fi
}
# shellcheck disable=SC2206
COMMON=(--n-per-task "$N" --device "$DEVICE" --context "$CONTEXT" --batch-size 64 --chunk-size 512 ${EVAL_ARGS:-})
for split in eval heldout; do
    if [ -n "${COMPOSE_TARGET:-}" ]; then
        run_eval "$split" --model "$RUN/final" --method kaizen+kvpop --budget "$BUDGET" --target "$COMPOSE_TARGET" \
            --split "$split" "${COMMON[@]}" --out "$OUT/kaizen_kvpop_${tag}_$split.json"
    else
        run_eval "$split" --model "$RUN/final" --method kvpop --budget "$BUDGET" --split "$split" "${COMMON[@]}" \
            --out "$OUT/kvpop_${tag}_$split.json"
    fi
done
if [ -n "${COMPOSE_TARGET:-}" ] && [ "${DECOMPOSE:-0}" = 1 ]; then
    rep=$(python3 -c "print(round($COMPOSE_TARGET * $BUDGET / $CONTEXT, 6))")
    for part in "dense" "kvpop --budget $BUDGET"; do
        # shellcheck disable=SC2086
        run_eval "decompose_${part%% *}" --model "$RUN/final" --method $part --split eval "${COMMON[@]}" \
            --out "$OUT/decompose_${tag}_${part%% *}.json"
    done
    # the representation alone: the configuration the student was retrofitted under (--kv-bits, recorded in its
    # config.json), else kaizen_static's uniform choice at the representation's factor
    trained=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1])).get('kvpop_kv_configuration') or '')" \
        "$RUN/final/config.json")
    representation=(--target "$rep"); [ -n "$trained" ] && representation=(--configuration "$trained")
    run_eval decompose_kaizen_static --model "$RUN/final" --method kaizen_static "${representation[@]}" --split eval \
        "${COMMON[@]}" --out "$OUT/decompose_${tag}_kaizen_static.json"
fi
wait
[ "${PARALLEL_EVALS:-0}" = 1 ] && cat "$OUT"/eval_*.log >> "$OUT/retrofit_$tag.log" && rm -f "$OUT"/eval_*.log
grep -E "^kvpop|^kaizen|^dense|^method" "$OUT/retrofit_$tag.log" | tail -n 16
[ -n "${STUDENT:-}" ] && exit 0  # a trained student: nothing to export
python3 benchmarks/export_checkpoint.py --overwrite "$RUN/final" "${WORK_DIR:-/tmp}/kvpop-$tag" \
    && tar -C "${WORK_DIR:-/tmp}" -cf "$OUT/kvpop_$tag.tar" "kvpop-$tag"
