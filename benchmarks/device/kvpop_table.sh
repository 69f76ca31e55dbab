#!/usr/bin/env bash
# The KVpop paper's Table 1 on the testbed in one device call (issue #10 item 6): four retrofits of the shipped
# teacher side by side on the one GPU, with the same data, minutes and budget (the teacher is small and its training
# launch-bound: at 894106b a retrofit sharing the H200 with two other jobs still ran ~4.6 steps/s):
#   kvpop_mlp (MLP scorer), kvpop (mLSTM scorer), streaming_plus, dms;
# RETROFIT_MINUTES each (default 5; or RETROFIT_STEPS steps each, below), BUDGET (default 512, CR 88%), KVPOP_EXTRA more options of the two KVpop runs
# (default '--decay-init 0.99999 --target-reduction peak': the target under which the teacher policy itself answers
# best, docs/notes/kvpop_retrofit_smoke.md section 7; method_tables.sh compares it with the total mass first). Then `benchmarks/kvpop_table.py` on them in
# parallel processes (one per student with --baselines none, two for the training-free baselines; only the first
# baselines part measures the teacher, the others pass --no-teacher), each with the
# minutes left of TOTAL_MINUTES (default 9.5), merged into $OUT/kvpop_table.json (`python -m kvlearn.results merge`;
# `not_run` lists the runs cut) and plotted. The students come back as bf16 tars ($OUT/<name>.tar).
# Device time: TOTAL_MINUTES plus the machine's start-up: one 10-minute call. DEVICE (default cuda), RETROFIT_ARGS and
# TABLE_ARGS (more options for every retrofit / table process) let the same script run as a CPU dry run:
#   DEVICE=cpu MODEL=<tiny model> BUDGET=48 RETROFIT_MINUTES=0.1 TOTAL_MINUTES=1 N_PER_TASK=1 \
#   RETROFIT_ARGS='--seq-len 256 --batch-size 2 --window 16' TABLE_ARGS='--context 256 --budgets 48 --tasks niah --splits eval' ...
# STUDENTS also picks which students are trained (kvpop: the mLSTM scorer, since f23f460 with its skip
# connection by default; kvpop_noskip=kvpop / kvpop_skip=kvpop: --mlstm-skip 0 / 1 explicitly; kvpop_immediate=kvpop:
# the immediate readout; every mLSTM student trains with --state-in-budget 1 since this was added, and every one with
# a skip path with --readout-penalty MLSTM_READOUT_PENALTY, default 30, since session 28: docs/DESIGN.md section 5,
# "The readout penalty", and with --scorer-kd MLSTM_SCORER_KD, default 1, since session 30: section 5, "Scorers through
# the distillation loss"; the MLP student keeps the paper's recipe, the boundary loss alone); TAG (e.g. _b256) keeps two chains' folders apart;
# WORK_DIR (default /tmp) is where the retrofits write.
# Students trained earlier: STUDENTS_FROM=<folder> (its <name>/ checkpoints, carried to the device) skips the
# retrofits and evaluates them; STUDENTS (default 'kvpop_mlp=kvpop kvpop=kvpop streaming_plus=streaming_plus dms=dms',
# name=method pairs) picks which; SPLIT_PARTS=1 runs each student's eval and held-out splits as two processes;
# BASELINES=0 leaves the training-free baselines out; CONTEXT_BASELINES=1 adds a part with every one of them under the
# context protocol on the eval split (the table of record's context rows; `kvlearn reproduce kvpop --context-rows`).
# EXTRA_PARTS: more table processes beside the students' (ablations on the same students), ';'-separated
# 'name|kvpop_table.py options', where {student} is that student's checkpoint folder, e.g.
# 'mlstm_fullk|--student kvpop_fullk=kvpop:{kvpop} --state-in-budget 0 --baselines none --no-teacher'.
# Table 1 of record (results/kvpop_table.json, CR 75% / 88%, session 22): RETROFIT_STEPS=1300 RETROFIT_ARGS='--lr 1e-4'
# BASELINES=0 SPLIT_PARTS=1 TABLE_MINUTES=3 TABLE_ARGS='--budgets 1024,512', two students a call (STUDENTS='kvpop_mlp=kvpop
# kvpop=kvpop', then 'streaming_plus=streaming_plus dms=dms'); the training-free rows come from eviction_baselines.sh.
# CR 94% (session 25): BUDGET=256 RETROFIT_STEPS=1300 RETROFIT_ARGS='--lr 1e-4 --window 128' TABLE_ARGS='--budgets 256'
# BASELINES=0 SPLIT_PARTS=1 EXPORT_STUDENTS=0, the students in pairs as above.
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/device/kvpop_table.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}; mkdir -p "$OUT"
MODEL=${MODEL:-checkpoints/testbed-teacher}
M=${RETROFIT_MINUTES:-5}; B=${BUDGET:-512}; TOTAL=${TOTAL_MINUTES:-9.5}
KVPOP_EXTRA=${KVPOP_EXTRA---decay-init 0.99999 --target-reduction peak}
RP=${MLSTM_READOUT_PENALTY:-30}
KD=${MLSTM_SCORER_KD:-1}
# the scorer distillation's soft rows compiled (--scorer-kd-compile, a speed setting: 2.65x -> 2.32x a plain distillation
# step with the MLP, 3.22x -> 2.65x with the mLSTM, results/raw/retrofit_step_speed_scorer_kd_h200_c2baa20.json);
# SCORER_KD_COMPILE=0: eager
KDC=""; [ "$KD" != 0 ] && [ "${SCORER_KD_COMPILE:-1}" != 0 ] && KDC="--scorer-kd-compile"
echo "commit=${KVLEARN_COMMIT:-?} $(python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
start=$(date +%s)
# RETROFIT_STEPS: every student trains that many steps (the same steps for every method, whatever the GPU's sharing
# does to their speed) instead of RETROFIT_MINUTES of wall clock; the table then gets TABLE_MINUTES (default 4)
if [ -n "${RETROFIT_STEPS:-}" ]; then LENGTH="--steps $RETROFIT_STEPS"; else LENGTH="--minutes $M"; fi
retrofit() {  # name, then retrofit options
    local name=$1; shift
    # shellcheck disable=SC2068
    python3 -m kvlearn.cli retrofit --model "$MODEL" --out "${WORK_DIR:-/tmp}/table${TAG:-}_$name" --overwrite --device "${DEVICE:-cuda}" \
        --budget "$B" $LENGTH --num-workers 3 $@ ${RETROFIT_ARGS:-} > "$OUT/retrofit_$name.log" 2>&1
    echo "retrofit $name rc=$? $(date -u +%H:%M:%S)"
}
STUDENTS=${STUDENTS:-kvpop_mlp=kvpop kvpop=kvpop streaming_plus=streaming_plus dms=dms}
student_dir() { if [ -n "${STUDENTS_FROM:-}" ]; then echo "$STUDENTS_FROM/$1"; else echo "${WORK_DIR:-/tmp}/table${TAG:-}_$1/final"; fi; }
if [ -z "${STUDENTS_FROM:-}" ]; then  # train the students STUDENTS names, side by side
    for s in $STUDENTS; do
        case ${s%%=*} in
            kvpop_mlp) retrofit kvpop_mlp --method kvpop --scorer mlp $KVPOP_EXTRA & ;;
            # the mLSTM students train with their state in the budget (Table 1's rule; kvpop_table.py evaluates so)
            # the mLSTM students with a skip path train under the readout penalty (MLSTM_READOUT_PENALTY, default 30,
            # the recipe of Table 1 since session 28; KVPOP_EXTRA's own --readout-penalty comes later and wins), and
            # since session 30 with their scorers also trained through the distillation loss (--scorer-kd
            # MLSTM_SCORER_KD, default 1; again KVPOP_EXTRA's own comes later and wins)
            kvpop) retrofit kvpop --method kvpop --scorer mlstm --state-in-budget 1 --readout-penalty "$RP" \
                --scorer-kd "$KD" $KDC $KVPOP_EXTRA & ;;
            kvpop_noskip) retrofit kvpop_noskip --method kvpop --scorer mlstm --state-in-budget 1 --mlstm-skip 0 $KVPOP_EXTRA & ;;
            kvpop_skip) retrofit kvpop_skip --method kvpop --scorer mlstm --state-in-budget 1 --mlstm-skip 1 \
                --readout-penalty "$RP" --scorer-kd "$KD" $KDC $KVPOP_EXTRA & ;;
            kvpop_immediate) retrofit kvpop_immediate --method kvpop --scorer mlstm --state-in-budget 1 --readout immediate \
                --readout-penalty "$RP" --scorer-kd "$KD" $KDC $KVPOP_EXTRA & ;;  # the readout ablation: scored at u, not u + window
            streaming_plus) retrofit streaming_plus --method streaming_plus & ;;
            # DMS_SCOPE (kvlearn reproduce kvpop --dms-scope): the compression scope; unset, kvlearn retrofit's
            # default (head since session 48; Table 1's DMS rows of record trained with model)
            dms) retrofit dms --method dms ${DMS_SCOPE:+--compression-scope "$DMS_SCOPE"} & ;;
            *) echo "STUDENTS: unknown student ${s%%=*}: expected kvpop_mlp, kvpop, kvpop_noskip, kvpop_skip, kvpop_immediate, streaming_plus or dms"; exit 2 ;;
        esac
    done
    wait
fi
if [ -n "${RETROFIT_STEPS:-}" ]; then left=${TABLE_MINUTES:-4}; else
    left=$(python3 -c "print(max(1.0, round($TOTAL - ($(date +%s) - $start) / 60 - 0.7, 2)))"); fi
echo "table: $left minutes"
parts=()
table() {  # part name, then kvpop_table.py options
    local name=$1; shift
    # shellcheck disable=SC2086
    python3 benchmarks/kvpop_table.py --model "$MODEL" --n-per-task "${N_PER_TASK:-100}" --minutes "$left" \
        --device "${DEVICE:-cuda}" --out "$OUT/part_$name.json" --plot "$OUT/part_$name.png" --budgets "$B" "$@" ${TABLE_ARGS:-} \
        > "$OUT/kvpop_table_$name.log" 2>&1
}
for s in $STUDENTS; do
    name=${s%%=*}; method=${s#*=}; dir=$(student_dir "$name")
    if [ ! -f "$dir/config.json" ]; then
        echo "$name: no checkpoint at $dir: its rows are missing (see $OUT/retrofit_$name.log)"
    elif [ "${SPLIT_PARTS:-0}" = 1 ]; then
        for split in eval heldout; do
            table "${name}_$split" --student "$name=$method:$dir" --baselines none --no-teacher --splits "$split" &
            parts+=("$OUT/part_${name}_$split.json")
        done
    else
        table "$name" --student "$name=$method:$dir" --baselines none --no-teacher &
        parts+=("$OUT/part_$name.json")
    fi
done
if [ -n "${EXTRA_PARTS:-}" ]; then
    IFS=';' read -ra extra_parts <<< "$EXTRA_PARTS"
    for part in "${extra_parts[@]}"; do
        name=${part%%|*}; part_args=${part#*|}
        for s in $STUDENTS; do part_args=${part_args//\{${s%%=*}\}/$(student_dir "${s%%=*}")}; done
        # shellcheck disable=SC2086
        table "$name" $part_args & parts+=("$OUT/part_$name.json")
    done
fi
if [ "${BASELINES:-1}" = 1 ]; then
    table baselines_a --baselines streaming,tova,h2o & parts+=("$OUT/part_baselines_a.json")
    table baselines_b --baselines snapkv,pyramidkv,knorm,random --no-teacher & parts+=("$OUT/part_baselines_b.json")
    # CONTEXT_BASELINES=1: the table of record's context rows too, every training-free baseline under the context
    # protocol on the eval split (they came from eviction_baselines.sh; `kvlearn reproduce kvpop --context-rows`)
    if [ "${CONTEXT_BASELINES:-0}" = 1 ]; then
        table baselines_context --baselines all --no-teacher --protocols context --splits eval &
        parts+=("$OUT/part_baselines_context.json")
    fi
fi
wait
existing=(); for p in "${parts[@]}"; do [ -f "$p" ] && existing+=("$p"); done
if [ ${#existing[@]} -eq 0 ]; then echo "no table part was written: see $OUT/kvpop_table_*.log"; tail -n 3 "$OUT"/kvpop_table_*.log; exit 1; fi
python3 -m kvlearn.results merge "$OUT/kvpop_table.json" "${existing[@]}"
python3 -c "
import sys; sys.path.insert(0, 'src')
from kvlearn.eval.plots import plot_pareto; from kvlearn.results import read_results
print(plot_pareto(read_results('$OUT/kvpop_table.json')['rows'], '$OUT/kvpop_table.png', title='KVpop Table 1 on the testbed, context 4096'))"
rm -f "$OUT"/part_*.json "$OUT"/part_*.png
tail -n 8 "$OUT"/kvpop_table_*.log
for s in $STUDENTS; do  # each trained student as a bf16 tar (EXPORT_STUDENTS=0: not)
    name=${s%%=*}
    [ "${EXPORT_STUDENTS:-1}" = 1 ] && [ -z "${STUDENTS_FROM:-}" ] && [ -f "${WORK_DIR:-/tmp}/table${TAG:-}_$name/final/config.json" ] || continue
    python3 benchmarks/export_checkpoint.py --overwrite "${WORK_DIR:-/tmp}/table${TAG:-}_$name/final" "${WORK_DIR:-/tmp}/student${TAG:-}-$name" \
        && tar -C "${WORK_DIR:-/tmp}" -cf "$OUT/$name.tar" "student${TAG:-}-$name"
done
ls -la "$OUT"
