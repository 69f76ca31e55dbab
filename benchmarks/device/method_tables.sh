#!/usr/bin/env bash
# One device session's method tables on the shipped teacher, detached so that no device time is lost between calls:
# three jobs share the GPU (the teacher is small and its jobs launch-bound):
#   - the eviction baselines, whole (`eviction_baselines.sh`, BASELINE_MINUTES default 8, 3 processes);
#   - two KVpop retrofits (MLP scorer, budget 1024) and their evaluation on both splits (`retrofit.sh`,
#     RETROFIT_MINUTES default 5, N default 100), one per target under which the teacher policy itself answers
#     (docs/notes/kvpop_retrofit_smoke.md section 7): PEAK_EXTRA (default '--decay-init 0.99999 --target-reduction
#     peak') and TOTAL_EXTRA (default '--decay-init 0.99999 --target-count-normalize 0', the total mass);
#   - the KV-Kaizen table (`kaizen_table.sh`, KAIZEN_MINUTES default 9.5 in all);
# TEACHER_N=<n> first evaluates the teacher (`benchmarks/teacher_eval.py`, dense and streaming at 1024, both splits) at n
# per family beside the kernel tests -> $RUN_DIR/testbed_teacher.json (~1.2 minutes per 100); KAIZEN=0 leaves the
# KV-Kaizen table out;
# BASELINES=0 leaves the eviction baselines out (e.g. when results/baselines_table.json is already on this teacher);
# RETROFITS=0 leaves the two retrofits out (their question, peak or total mass, is answered: docs/DESIGN.md 4.1),
# RETROFITS=peak runs the peak one only (the shipped student's recipe: its tar replaces checkpoints/testbed-kvpop);
# METHODS / BUDGETS reach eviction_baselines.sh (e.g. only the rows results/baselines_table.json's not_run lists);
# then, alone on the GPU, with SPEED=1 (the default) the GPU tests of the retrofit step,
# `benchmarks/retrofit_step_speed.py --variants foreach_adamw,bf16_mlstm_matmuls --profile` (~1 min) and
# `benchmarks/packed_decode_speed.py --store kivi --graph --sweep` (the KIVI kernel against the bf16 cache over the
# launches of KIVI_SWEEP, each checked against the read-back; ~5 min) and `--graph --sweep --bits 4,2,8` for the
# packed store (its launch grid; ~5 min); with SPEED=0 instead
# `benchmarks/packed_decode_speed.py --graph` (the packed-store decode kernel against the
# bf16 cache at 16k-131k, eager and replayed from CUDA graphs, about a minute).
# Everything goes to RUN_DIR (default /tmp/session_out); /tmp/session.done marks the end; /tmp/session.log is the
# chain's own log. Device time: ~1 start + max(BASELINE_MINUTES + 1, RETROFIT_MINUTES + 5, KAIZEN_MINUTES) + 1, about
# 12 minutes, plus ~12 with SPEED=1 (the profile's *.txt come back in the small tar), so the calls are:
#   call 1:  KVLEARN_COMMIT=<sha> setsid bash benchmarks/device/method_tables.sh > /tmp/session.log 2>&1 < /dev/null & sleep 570; cat /tmp/session.log
#   call 2 (within the 30 s the machine stays warm):  WAIT_S=540 bash benchmarks/device/collect_session.sh
# (a pause longer than those 30 s between the calls loses the whole chain: session 15's first call, 7822af1, left
# nothing. A chain that fits one call runs in the foreground instead and collects itself:
#   timeout 562 bash benchmarks/device/method_tables.sh > /tmp/session.log 2>&1; WAIT_S=0 bash benchmarks/device/collect_session.sh)
# With THEN_KVPOP_TABLE=1 the chain goes on, on the GPU alone, with `kvpop_table.sh` (the KVpop Table 1: OUT
# TABLE_DIR, default /tmp/table_out; its log /tmp/table.log; /tmp/table.done marks its end), so that one machine
# start serves both (with its training-free rows unless TABLE_BASELINES=0; the chain's BASELINES does not reach it);
# collect it with a third call (KVPOP_TABLE=1 instead runs it beside the other jobs from the start, OUT TABLE_DIR
# default $RUN_DIR/table, so that the one collecting call brings it back; SPEED=none then skips the timings):
#   call 3:  WAIT_S=560 RUN_DIR=/tmp/table_out DONE=/tmp/table.done LOG=/tmp/table.log bash benchmarks/device/collect_session.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
RUN_DIR=${RUN_DIR:-/tmp/session_out}; mkdir -p "$RUN_DIR"
rm -f /tmp/session.done
MODEL=${MODEL:-checkpoints/testbed-teacher}
echo "== start $(date -u +%H:%M:%S) on $MODEL"
if [ "${TEACHER_N:-0}" != 0 ]; then  # the teacher's acceptance evaluation at n=TEACHER_N, beside the kernel tests (accuracy, not time)
    (python3 benchmarks/teacher_eval.py --model "$MODEL" --n-per-task "$TEACHER_N" --batch-size 100 \
        --out "$RUN_DIR/testbed_teacher.json" > "$RUN_DIR/teacher_eval.log" 2>&1; echo "== teacher eval done rc=$? $(date -u +%H:%M:%S)") &
fi
# the new kernels first (about a minute): if the packed or KIVI decode kernel fails on this GPU, the Kaizen table runs on
# the read-back path (KVLEARN_PACKED_DECODE=0) rather than losing its rows; the log says which (KERNEL_TESTS=0: not)
if [ "${KERNEL_TESTS:-1}" != 0 ]; then
    timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops/test_packed_decode.py tests/ops/test_future_target_triton.py \
        tests/cache/test_packed_decode_cache.py tests/ops/test_kivi_decode.py > "$RUN_DIR/gpu_tests_new_kernels.log" 2>&1 \
        || { echo "new-kernel GPU tests failed: KVLEARN_PACKED_DECODE=0"; export KVLEARN_PACKED_DECODE=0; }
    tail -n 3 "$RUN_DIR/gpu_tests_new_kernels.log"
fi
if [ "${BASELINES:-1}" != 0 ]; then
    (OUT="$RUN_DIR/baselines" MODEL=$MODEL MINUTES=${BASELINE_MINUTES:-8} \
        bash benchmarks/device/eviction_baselines.sh > "$RUN_DIR/baselines.log" 2>&1; echo "== baselines done $(date -u +%H:%M:%S)") &
fi
if [ "${RETROFITS:-1}" != 0 ]; then
    (OUT="$RUN_DIR/retrofit" MODEL=$MODEL MINUTES=${RETROFIT_MINUTES:-5} N=${N:-100} TAG=peak \
        EXTRA=${PEAK_EXTRA---decay-init 0.99999 --target-reduction peak} \
        bash benchmarks/device/retrofit.sh > "$RUN_DIR/retrofit_peak.log" 2>&1; echo "== retrofit peak done $(date -u +%H:%M:%S)") &
fi
if [ "${RETROFITS:-1}" = 1 ]; then
    (OUT="$RUN_DIR/retrofit" MODEL=$MODEL MINUTES=${RETROFIT_MINUTES:-5} N=${N:-100} TAG=total \
        EXTRA=${TOTAL_EXTRA---decay-init 0.99999 --target-count-normalize 0} \
        bash benchmarks/device/retrofit.sh > "$RUN_DIR/retrofit_total.log" 2>&1; echo "== retrofit total done $(date -u +%H:%M:%S)") &
fi
if [ "${KAIZEN:-1}" != 0 ]; then
    (OUT="$RUN_DIR/kaizen" MODEL=$MODEL TOTAL_MINUTES=${KAIZEN_MINUTES:-9.5} \
        bash benchmarks/device/kaizen_table.sh > "$RUN_DIR/kaizen.log" 2>&1; echo "== kaizen done $(date -u +%H:%M:%S)") &
fi
if [ "${KVPOP_TABLE:-0}" = 1 ]; then  # the KVpop Table 1 beside the jobs above (its env: kvpop_table.sh's)
    (OUT=${TABLE_DIR:-$RUN_DIR/table} MODEL=$MODEL BASELINES=${TABLE_BASELINES:-1} bash benchmarks/device/kvpop_table.sh \
        > "$RUN_DIR/kvpop_table.log" 2>&1; echo "== kvpop table beside done rc=$? $(date -u +%H:%M:%S)") &
fi
wait
# alone on the GPU, so that its timings are not shared: the packed-store decode kernel against the bf16 cache
if [ "${SPEED:-1}" = none ]; then
    echo "SPEED=none: no timing"
elif [ "${SPEED:-1}" = 1 ]; then  # the step and the decode kernels' launch sweeps
    timeout 180 python3 -m pytest -q -m gpu -p no:cacheprovider tests/train/test_distill.py tests/kvpop/test_scorers.py \
        tests/ops/test_retention_attention.py tests/eval/test_packed_decode_speed_script.py > "$RUN_DIR/gpu_tests_speed.log" 2>&1
    tail -n 3 "$RUN_DIR/gpu_tests_speed.log"
    timeout 200 python3 benchmarks/retrofit_step_speed.py --variants foreach_adamw,bf16_mlstm_matmuls --profile "$RUN_DIR/prof" \
        --out "$RUN_DIR/retrofit_step_speed_h200.json" > "$RUN_DIR/retrofit_step_speed.log" 2>&1
    grep -vE "Warn|Loading weights|Writing model" "$RUN_DIR/retrofit_step_speed.log" | tail -n 6
    timeout 330 python3 benchmarks/packed_decode_speed.py --store kivi --graph --sweep --out "$RUN_DIR/kivi_decode_h200.json" \
        > "$RUN_DIR/kivi_decode.log" 2>&1
    grep -v Warn "$RUN_DIR/kivi_decode.log" | cut -c1-400 | tail -n 4
    timeout 330 python3 benchmarks/packed_decode_speed.py --graph --sweep --bits 4,2,8 --out "$RUN_DIR/packed_decode_h200.json" \
        > "$RUN_DIR/packed_decode.log" 2>&1
    grep -v Warn "$RUN_DIR/packed_decode.log" | cut -c1-400 | tail -n 4
else
    python3 benchmarks/packed_decode_speed.py --graph --out "$RUN_DIR/packed_decode_h200.json" > "$RUN_DIR/packed_decode.log" 2>&1
    tail -n 8 "$RUN_DIR/packed_decode.log"
fi
echo "== done $(date -u +%H:%M:%S)"
touch /tmp/session.done
if [ "${THEN_KVPOP_TABLE:-0}" = 1 ]; then
    rm -f /tmp/table.done
    # the chain's own BASELINES (the eviction-baselines job) must not reach the table: TABLE_BASELINES=0 leaves the
    # table's training-free rows out
    OUT=${TABLE_DIR:-/tmp/table_out} MODEL=$MODEL BASELINES=${TABLE_BASELINES:-1} bash benchmarks/device/kvpop_table.sh \
        > /tmp/table.log 2>&1
    echo "== kvpop table done rc=$? $(date -u +%H:%M:%S)"
    touch /tmp/table.done
fi
