#!/usr/bin/env bash
# A full retrofit with `--cuda-graph-step` against the same retrofit eager (issue #10 item 8), one after the other on
# one GPU: `kvlearn retrofit` for STEPS steps (default 400) each, same model, data and seed (SCORER default mlstm,
# BUDGET default 1024), then both students evaluated through their caches on the eval split (side by side, N default
# 100 per family), then benchmarks/graphed_retrofit_compare.py: time per step, loss terms per tenth, accuracy
# -> $OUT/graphed_retrofit_compare.json (+ the two train logs gzipped and the logs).
# Device time: about 2 x (30 s start-up + STEPS x ~0.1 s) + 60 s of evaluation on the testbed teacher.
# SKIP (default 20): the first steps left out of the time per step (compilation, the graph's capture). EXTRA: more
# retrofit options for both runs. DEVICE (default cuda), MODEL, CONTEXT and EVAL_ARGS let the plumbing run on the CPU
# (tests/eval/test_graphed_retrofit_compare.py; there without the graph: GRAPH_FLAG='').
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/device/graphed_retrofit_compare.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}; mkdir -p "$OUT"
STEPS=${STEPS:-400}; SCORER=${SCORER:-mlstm}; BUDGET=${BUDGET:-1024}; N=${N:-100}
MODEL=${MODEL:-checkpoints/testbed-teacher}; DEVICE=${DEVICE:-cuda}; CONTEXT=${CONTEXT:-4096}
WORK=${WORK_DIR:-/tmp}/graphed_compare
GRAPH_FLAG=${GRAPH_FLAG---cuda-graph-step}
echo "commit=${KVLEARN_COMMIT:-?} $(python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
for run in eager graphed; do
    flag=(); [ "$run" = graphed ] && [ -n "$GRAPH_FLAG" ] && flag=("$GRAPH_FLAG")
    # shellcheck disable=SC2086
    python3 -m kvlearn.cli retrofit --model "$MODEL" --out "$WORK/$run" --overwrite --device "$DEVICE" \
        --scorer "$SCORER" --budget "$BUDGET" --steps "$STEPS" --num-workers 8 ${flag[@]+"${flag[@]}"} ${EXTRA:-} \
        > "$OUT/retrofit_$run.log" 2>&1
    echo "$run retrofit rc=$? $(date -u +%H:%M:%S)"; tail -n 2 "$OUT/retrofit_$run.log" | cut -c1-300
done
for run in eager graphed; do
    # shellcheck disable=SC2086
    { python3 -m kvlearn.cli eval --model "$WORK/$run/final" --method kvpop --budget "$BUDGET" --split eval \
        --n-per-task "$N" --device "$DEVICE" --context "$CONTEXT" --batch-size 64 --chunk-size 512 ${EVAL_ARGS:-} \
        --out "$OUT/eval_$run.json" > "$OUT/eval_$run.log" 2>&1; echo "$run eval rc=$?"; } &
done
wait
python3 benchmarks/graphed_retrofit_compare.py --eager "$WORK/eager/train_log.jsonl" \
    --graphed "$WORK/graphed/train_log.jsonl" --eager-eval "$OUT/eval_eager.json" --graphed-eval "$OUT/eval_graphed.json" \
    --skip "${SKIP:-20}" --device "$DEVICE" --out "$OUT/graphed_retrofit_compare.json" \
    --command "STEPS=$STEPS SCORER=$SCORER BUDGET=$BUDGET N=$N bash benchmarks/device/graphed_retrofit_compare.sh"
for run in eager graphed; do gzip -c "$WORK/$run/train_log.jsonl" > "$OUT/train_log_$run.jsonl.gz"; done
cat "$OUT/eval_eager.log" "$OUT/eval_graphed.log" >> "$OUT/retrofit_eager.log"; rm -f "$OUT"/eval_*.log
