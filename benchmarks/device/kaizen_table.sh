#!/usr/bin/env bash
# The KV-Kaizen comparison table on the testbed (benchmarks/kaizen_table.py, issue #11 item 9), in two processes
# that share the GPU from the start (the testbed teacher is small):
#   - the training-free rows on the teacher: the control, the baselines at factors 2,4,8,16 and
#     kaizen+snapkv/kaizen+kvpop at 16 and 32 (`--minutes TOTAL_MINUTES - 0.5`) -> $OUT/kaizen_table_baselines.json;
#   - selectors trained with `kvlearn kaizen-train` (TARGETS, default 4 and 8, precision + depth, TRAIN_MINUTES
#     each, concurrently), then each selector's rows and untrained-backbone rows with the minutes left, one process
#     per selector -> $OUT/kaizen_table_selector_t<target>.json;
# merged (`python -m kvlearn.results merge`) into $OUT/kaizen_table.json with its plot $OUT/kaizen_table.png; the
# selectors under $OUT/kaizen-t4, $OUT/kaizen-t8, logs in $OUT/*.log. (Before, the baselines ran after the selectors
# and two runs in a row, 3859a14 and b6634e3, were cut by the time guard before any baseline row.)
# Device time: one call of about TOTAL_MINUTES (default 9.5: training TRAIN_MINUTES default 4 with ~1 minute of
# start-up and saving, then the selectors' rows with what is left, at least 1 minute) plus the machine's start-up;
# `not_run` in the merged file lists the runs a guard cut (run kaizen_table.py again with --selector
# $OUT/kaizen-t4/final ... and --baselines/--factors for them, then merge).
# MODEL (default: the shipped checkpoints/testbed-teacher); N_PER_TASK (default 100); SEQ_LEN and BATCH (training,
# defaults 4096 and 8); TRAIN_ARGS: more kaizen-train options (e.g. '--dense-fraction 0.25': more rows in the
# evaluation format, docs/DESIGN.md section 8, "Which layers the selector may share"); CONTROL: a same-recipe
# uncompressed fine-tune for the control row (default: the teacher); SMALLER_MODEL: a smaller dense model trained with
# the teacher's recipe (`kvlearn pretrain --num-layers 2`), whose rows the first baseline part measures (smaller_model).
# DEVICE (default cuda for the training, kaizen_table.py's own default for the rows) lets the selector part run on the
# CPU (benchmarks/device/kaizen_family_swap.sh's smoke test).
# DRY_RUN=1 checks the plumbing on the CPU: the processes print their command lines, and fake parts are merged.
# TARGETS (default '4 8'): the selectors trained, one kaizen-train each; an entry may be a comma list (a
# budget-conditioned selector sampling its target per sequence, e.g. '1,2,4', folder kaizen-t1_2_4, label kaizen1_2_4).
# Each selector's rows run in their own process after training, with --no-control (the first baseline part measures it).
# SEEDS (default: one run per target with kaizen-train's default seed): a space list; each target is trained once per
# seed (`--seed S`, folder kaizen-t<target>_s<S>, label kaizen<target>_s<S>), concurrently, so that the spread of one
# recipe over seeds is measured in one call. Trainers side by side share the GPU's steps: two 8x seeds side by side
# ran 2,233 and 2,223 steps in 6.3 minutes where one alone ran 3,681 in 6 and met the 8x bar that the same seed side
# by side only just met (session 51; docs/FINDINGS.md, "KV-Kaizen"), so a selector of record trains alone.
# SELECTOR_TABLE_ARGS: more kaizen_table.py options for each selector's rows, after its defaults (--baselines none
# --compose-factors none), e.g. '--compose-selectors --compose-factors 64 --compose-methods kaizen+kvpop --kvpop
# checkpoints/testbed-kvpop --no-untrained': the selector's backbone and choice under KVpop eviction at 64x with the
# shipped student's scorers grafted on (and no untrained-backbone rows, to fit the call).
# BASELINE_PARTS (default '--first-factors 4,8'): the training-free part's kaizen_table.py options; several parts
# separated by ';' run as that many processes side by side, the first measuring the control, the others with
# --no-control (e.g. '--factors 2 --baselines static,dp_search,random --compose-factors none;--factors 16 ...');
# 'none': no training-free part (the selectors alone get the GPU; their rows are compared with a committed control).
# NUM_WORKERS: each trainer's data-generation processes (`kaizen-train --num-workers`; default kaizen-train's own:
# 3 on a CUDA device, 0 on the CPU, kvlearn.train.distill.default_num_workers).
# The data stream is the same for any number (batches are dealt round robin); before session 51 the trainers had none,
# and one trainer alone on an H100 then ran 8.9 steps/s against 10.3 with 3 (session 51's train logs, in
# results/raw/kaizen8_alone_and_side_by_side_logs_dadd62a.tar.xz; docs/FINDINGS.md, "KV-Kaizen").
# LABEL: the selector's label in its rows (default kaizen<tag>, e.g. kaizen8_s3), for a run of one selector only (one
# target, at most one seed), so that a run of record needs no `python -m kvlearn.results relabel` afterwards; letters,
# digits, '_', '-' and '.'.
# PACK=1 (the end of the script) packs what a device call can return into $OUT/kaizen_table.tar.
# RETURN_DIR=DIR (a device call's $OUT, with OUT a work folder outside it, e.g. R=$OUT; OUT=/tmp/kz RETURN_DIR=$R;
# not OUT=/tmp/kz RETURN_DIR=$OUT, where the shell has already set OUT to /tmp/kz when it expands $OUT): each
# EXPORT=1 tar is copied there as soon as it is written, and every tar of OUT at the end (PACK=1's among them). A call
# cut at its limit then still returns the export, whatever else OUT holds (a call returns at most 8 files; a trained
# selector's folder alone holds more); session 56 ran that way by hand.
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... PACK=1 bash benchmarks/device/kaizen_table.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
MODEL=${MODEL:-checkpoints/testbed-teacher}
TRAIN_MINUTES=${TRAIN_MINUTES:-4}
TOTAL_MINUTES=${TOTAL_MINUTES:-9.5}
TARGETS=${TARGETS:-4 8}
if [ -n "${TRAIN_STEPS:-}" ]; then  # checked before any process starts
    case $TRAIN_STEPS in *[!0-9]*) ok=0 ;; *) [ "$TRAIN_STEPS" -gt 0 ] && ok=1 || ok=0 ;; esac
    [ "$ok" = 1 ] || { echo "TRAIN_STEPS=$TRAIN_STEPS is invalid: expected a positive whole number of steps"; exit 2; }
fi
runs=()  # "target tag seed-options" per selector
for t in $TARGETS; do
    if [ -z "${SEEDS:-}" ]; then runs+=("$t ${t//,/_}"); continue; fi
    for s in $SEEDS; do runs+=("$t ${t//,/_}_s$s --seed $s"); done
done
if [ -n "${LABEL:-}" ]; then  # checked before any process starts
    [ ${#runs[@]} -eq 1 ] || { echo "LABEL=$LABEL names one selector, but TARGETS='$TARGETS' SEEDS='${SEEDS:-}' train ${#runs[@]}: expected one target and at most one seed"; exit 2; }
    case $LABEL in *[!A-Za-z0-9_.-]*) echo "LABEL=$LABEL is invalid: expected letters, digits, '_', '-' and '.'"; exit 2 ;; esac
fi
mkdir -p "$OUT"
if [ -n "${RETURN_DIR:-}" ]; then  # checked before any process starts
    case $RETURN_DIR in  # OUT=X RETURN_DIR=$OUT/kz expands $OUT to X already (session 57): say so
        "$OUT"/*) inside=" (it lies inside OUT=$OUT: in 'OUT=$OUT RETURN_DIR=\$OUT/...' the shell expands \$OUT to $OUT; save the call's \$OUT first: R=\$OUT; OUT=$OUT RETURN_DIR=\$R)" ;;
        *) inside="" ;;
    esac
    [ -d "$RETURN_DIR" ] || { echo "RETURN_DIR=$RETURN_DIR is invalid: expected an existing folder (the device call's \$OUT)$inside"; exit 2; }
    [ "$(cd "$RETURN_DIR" && pwd -P)" != "$(cd "$OUT" && pwd -P)" ] || { echo "RETURN_DIR=$RETURN_DIR is invalid: expected a folder other than OUT=$OUT"; exit 2; }
fi
echo "commit=${KVLEARN_COMMIT:-?} $(python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
start=$(date +%s)
run() {  # the command, or with DRY_RUN=1 its line
    if [ "${DRY_RUN:-0}" = 1 ]; then echo "dry run: $*"; else "$@"; fi
}
parts=()
IFS=';' read -ra baseline_parts <<< "${BASELINE_PARTS:---first-factors 4,8}"
[ "${BASELINE_PARTS:-}" = none ] && baseline_parts=()
i=0
for part_args in "${baseline_parts[@]}"; do
    name=baselines; [ "$i" -gt 0 ] && name=baselines$i
    control=(); [ "$i" -gt 0 ] && control=(--no-control)
    [ "$i" -eq 0 ] && [ -n "${SMALLER_MODEL:-}" ] && control+=(--smaller-model "$SMALLER_MODEL")
    # shellcheck disable=SC2086
    run python3 benchmarks/kaizen_table.py --model "$MODEL" ${CONTROL:+--control "$CONTROL"} --n-per-task "${N_PER_TASK:-100}" \
        $part_args "${control[@]}" --minutes "$(python3 -c "print(max(1.0, $TOTAL_MINUTES - 0.5))")" \
        --out "$OUT/kaizen_table_$name.json" > "$OUT/kaizen_table_$name.log" 2>&1 &
    parts+=("$OUT/kaizen_table_$name.json")
    i=$((i + 1))
done
# TRAIN_STEPS: every trainer runs that many steps (`--steps`) instead of TRAIN_MINUTES, so that runs of one recipe on
# two GPUs differ by their seed only (6 minutes gave 3,681 steps on one H100 and 4,470 on another, session 52); the
# GPU's speed then sets the training time (4,000 steps: 5.4 minutes at 12.4 steps/s, 6.5 at 10.2): keep TOTAL_MINUTES
# above it, or the selectors' rows get the 1-minute floor.
train_budget=(--minutes "$TRAIN_MINUTES"); [ -n "${TRAIN_STEPS:-}" ] && train_budget=(--steps "$TRAIN_STEPS")
trainers=()
for r in "${runs[@]}"; do
    read -r t tag seed_args <<< "$r"
    # shellcheck disable=SC2086
    run python3 -m kvlearn.cli kaizen-train --model "$MODEL" --out "$OUT/kaizen-t$tag" --overwrite --target "$t" \
        "${train_budget[@]}" --seq-len "${SEQ_LEN:-4096}" --batch-size "${BATCH:-8}" --device "${DEVICE:-cuda}" \
        --save-interval 100000 ${NUM_WORKERS:+--num-workers "$NUM_WORKERS"} ${TRAIN_ARGS:-} $seed_args > "$OUT/kaizen_train_t$tag.log" 2>&1 &
    trainers+=($!)
done
wait "${trainers[@]}"
tail -n 3 "$OUT"/kaizen_train_t*.log
# EXPORT=1: each trained selector is exported in bf16 (benchmarks/export_checkpoint.py: backbone and selector, about
# 15 MB on the testbed teacher, under the 16 MiB a returned file may have) as $OUT/kaizen_t<tag>_export.tar, folder
# kaizen-t<tag>-export/ (written under WORK_DIR, default /tmp), which PACK leaves out of its tar. It runs right after
# training, before the rows, so that a call cut short during the rows still returns it (session 55: 8.5 minutes of
# training on a slow H100 left the rows the 1-minute floor, the call's 600 s ran out before the export, then written
# after the rows, and the weights were lost). Carried to a
# later call (carry_eval/kaizen-t<tag>-export), it is the --init-student of a refinement that trains on (docs/DESIGN.md
# section 8, "Refinement: training over several runs"): TRAIN_ARGS='<the recipe> --init-student
# carry_eval/kaizen-t8_s1-export --tau-start 0.1' with another seed. The 8x recipe of record is TRAIN_ARGS='--recipe
# 8x' (with TARGETS=8 TRAIN_STEPS=4000), its refinement TRAIN_ARGS='--recipe 8x-refine --init-student
# carry_eval/kaizen-t8_s<S>-export' (TRAIN_STEPS=3000): this script's --target and --steps / --minutes are given, so
# they win over the recipe's (docs/DESIGN.md section 8, "Recipes").
if [ "${EXPORT:-0}" = 1 ]; then
    for r in "${runs[@]}"; do
        read -r _ tag _ <<< "$r"
        if [ -f "$OUT/kaizen-t$tag/final/model.safetensors" ]; then
            run python3 benchmarks/export_checkpoint.py --overwrite "$OUT/kaizen-t$tag/final" \
                "${WORK_DIR:-/tmp}/kaizen-t$tag-export" \
                && run tar -C "${WORK_DIR:-/tmp}" -cf "$OUT/kaizen_t${tag}_export.tar" "kaizen-t$tag-export"
            echo "export of kaizen$tag rc=$?"
            if [ -n "${RETURN_DIR:-}" ] && [ -f "$OUT/kaizen_t${tag}_export.tar" ]; then
                cp "$OUT/kaizen_t${tag}_export.tar" "$RETURN_DIR/" && echo "copied kaizen_t${tag}_export.tar to $RETURN_DIR"
            fi
        else
            echo "kaizen$tag has no final/ weights: nothing to export"
        fi
    done
fi
left=$(python3 -c "print(max(1.0, round($TOTAL_MINUTES - ($(date +%s) - $start) / 60 - 0.5, 2)))")
echo "selectors' rows: $left minutes"
for r in "${runs[@]}"; do
    read -r t tag _ <<< "$r"
    if [ -f "$OUT/kaizen-t$tag/final/config.json" ] || [ "${DRY_RUN:-0}" = 1 ]; then
        # shellcheck disable=SC2086
        run python3 benchmarks/kaizen_table.py --model "$MODEL" ${CONTROL:+--control "$CONTROL"} \
            --selector "${LABEL:-kaizen$tag}=$OUT/kaizen-t$tag/final" --no-control --baselines none --compose-factors none \
            --n-per-task "${N_PER_TASK:-100}" --minutes "$left" --out "$OUT/kaizen_table_selector_t$tag.json" \
            ${DEVICE:+--device "$DEVICE"} \
            ${SELECTOR_TABLE_ARGS:-} \
            > "$OUT/kaizen_table_selector_t$tag.log" 2>&1 &
        parts+=("$OUT/kaizen_table_selector_t$tag.json")
    else
        echo "kaizen-train target $t left no final/ folder: its rows are missing (see $OUT/kaizen_train_t$tag.log)"
    fi
done
wait
logs=("$OUT"/kaizen_table_selector_t*.log "$OUT"/kaizen_table_baselines*.log)  # BASELINE_PARTS=none: no baselines log
existing=(); for f in "${logs[@]}"; do [ -f "$f" ] && existing+=("$f"); done
[ ${#existing[@]} -gt 0 ] && tail -n 20 "${existing[@]}"
if [ "${DRY_RUN:-0}" = 1 ]; then  # fake parts, so that the merge and the plot below run
    tags=(); for r in "${runs[@]}"; do read -r _ tag _ <<< "$r"; tags+=("$tag"); done
    python3 - "$OUT" "${tags[@]}" <<'PY'
import os
import sys
from kvlearn.results import make_results, write_results
row = lambda m, f, **kw: {"method": m, "protocol": "bounded", "split": "eval", "budget": 4096, "context": 4096,
                          "task": "niah", "accuracy": 0.5, "n": 2, "factor": f, "compression": 1 - 1 / f, "model": "teacher", **kw}
out, targets = sys.argv[1], sys.argv[2:]
for tag in targets:
    t = tag.split("_s")[0].replace("_", ",")
    write_results(f"{out}/kaizen_table_selector_t{tag}.json", make_results(
        "accuracy", [row("kaizen", float(t.split(",")[-1]), selector=os.environ.get("LABEL") or f"kaizen{tag}")],
        device="cpu", command="s", commit="x"))
write_results(f"{out}/kaizen_table_baselines.json", make_results(
    "accuracy", [row("control", 1.0), row("static", 4.0)], device="cpu", command="b", commit="x"))
PY
fi
existing=(); for p in "${parts[@]}"; do [ -f "$p" ] && existing+=("$p"); done
python3 -m kvlearn.results merge "$OUT/kaizen_table.json" "${existing[@]}"
python3 benchmarks/kaizen_table.py --replot "$OUT/kaizen_table.json" --plot "$OUT/kaizen_table.png"
# PACK=1, for a device call (it returns at most 8 files, each at most 16 MiB): the selectors' weights and trainer
# states are deleted (about 54 MB a selector: the call cannot return them) and everything else, tables, logs, train
# logs, sensitivity reports and the plot, is packed as $OUT/kaizen_table.tar; EXPORT=1's tars stay beside it.
if [ "${PACK:-0}" = 1 ]; then
    find "$OUT" -path "$OUT/kaizen-t*" -type f \( -name '*.safetensors' -o -name '*.pt' \) -delete
    . "$(dirname "$0")/pack_out.sh"
    pack_out "$OUT" kaizen_table
fi
if [ -n "${RETURN_DIR:-}" ]; then
    for f in "$OUT"/*.tar; do [ -f "$f" ] && cp "$f" "$RETURN_DIR/"; done
    ls -la "$RETURN_DIR"
fi
