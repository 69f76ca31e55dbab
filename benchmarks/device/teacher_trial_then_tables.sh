#!/usr/bin/env bash
# One device session that tries a teacher recipe and, if the trial fails early, spends the rest on method tables of
# the shipped teacher. Detached, so that no device time is lost between calls.
#   1. `teacher.sh` trains a teacher with `kvlearn pretrain` defaults + TEACHER_EXTRA (default: the first teacher's
#      longer short stages, `--stage-fractions 0.12,0.13,0.2,0.2,0.35`; the trace-first arm,
#      `--family-weights '3,1,0,1;3,1,0,1;1,1,1,1;1,1,1,1;1,1,1,1'`, failed this gate at fea99dc, and the defaults
#      with trace's in-context lookups, TEACHER_EXTRA='', at 0872de9 (trace at 1024) and d2a03be (recall at 2048);
#      since 3edd072 the defaults weight the families adaptively: docs/TESTBED.md).
#   2. Gate: at the stage check of curriculum stage GATE_STAGE (default 2, length 1024) the teacher-forced accuracy
#      of GATE_FAMILY (default trace) on the eval split must reach GATE_THRESHOLD (default 0.2, or GATE_TRACE as
#      before; e.g. GATE_STAGE=3 GATE_FAMILY=recall GATE_THRESHOLD=0.5: has retrieval formed by 2048? For trace at
#      1024: the first teacher had 0.84 there, every
#      teacher on the current testbed <= 0.05). Passed: the teacher trains to the end and is evaluated greedily,
#      alone on the GPU (its recipe follows wall-clock time), and nothing else runs. Failed: the pretrain is killed
#      (its log up to then stays in RUN_DIR/teacher) and step 3 runs.
#   3. On the shipped teacher, side by side (small, launch-bound jobs):
#      - the eviction baselines' missing rows (`eviction_baselines.sh`, METHODS default streaming,snapkv,random,
#        BUDGETS default 1024,512);
#      - `kvpop_table.sh` for the mLSTM KVpop student at budget 512 trained for MLSTM_MINUTES (default 9);
#      - `kvpop_table.sh` at budget 256 (CR 94%, window WINDOW_256, default 64) for kvpop_mlp, streaming_plus and
#        dms trained for MINUTES_256 (default 6) each, with the training-free baselines at 256;
#      then, alone on the GPU, `benchmarks/packed_decode_speed.py --graph`.
#      FALLBACK='<command line>' runs that instead (alone on the GPU; RUN_DIR is exported), e.g.
#      FALLBACK='OUT=$RUN_DIR/kaizen bash benchmarks/device/kaizen_overheads.sh; ...'.
#   PRE='<command line>' runs first, alone on the GPU, before the trial (e.g. the GPU tests of changed kernels), and
#   WITH_EVAL='<command line>' beside a passed teacher's evaluation, once its checkpoint is written (e.g. GPU tests:
#   the evaluation measures accuracy, not time), and THEN='<command line>' after that evaluation, alone on the GPU
#   (e.g. the kernel timings); they log to RUN_DIR/pre.log, with_eval.log and then.log, and none shares the GPU with
#   the pretrain, whose recipe follows time. E.g. (benchmarks/device/kernel_checks.sh):
#     WITH_EVAL='TIMINGS=0 SKIP_MEMORY=1 OUT=$RUN_DIR/checks bash benchmarks/device/kernel_checks.sh'
#     THEN='TESTS=0 SKIP_MEMORY=1 OUT=$RUN_DIR/checks bash benchmarks/device/kernel_checks.sh'
# Everything goes to RUN_DIR (default /tmp/session_out); /tmp/session.log is the chain's log, /tmp/session.done its
# end. Device time on one H200: ~1 start + either ~21 (teacher passed) or ~5 + ~14 (failed) minutes:
#   call 1:  KVLEARN_COMMIT=<sha> setsid bash benchmarks/device/teacher_trial_then_tables.sh > /tmp/session.log 2>&1 < /dev/null & sleep 565; cat /tmp/session.log
#   call 2 (within the 30 s the machine stays warm):  WAIT_S=<seconds> bash benchmarks/device/collect_session.sh
# DRY_RUN=1 replaces every GPU job by a few seconds of `sleep` and the pretrain by a fake log (tested on the CPU).
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
RUN_DIR=${RUN_DIR:-/tmp/session_out}; mkdir -p "$RUN_DIR/teacher"
rm -f /tmp/session.done /tmp/teacher.pretrained /tmp/teacher.done
GATE_STAGE=${GATE_STAGE:-2}; GATE_THRESHOLD=${GATE_THRESHOLD:-${GATE_TRACE:-0.2}}; GATE_FAMILY=${GATE_FAMILY:-trace}
TEACHER_EXTRA=${TEACHER_EXTRA---stage-fractions 0.12,0.13,0.2,0.2,0.35}
export RUN_DIR
job() {  # name, then the command: its output to RUN_DIR/name.log
    local name=$1; shift
    if [ "${DRY_RUN:-0}" = 1 ]; then sleep 1; echo "dry run: $*" > "$RUN_DIR/$name.log"; else "$@" > "$RUN_DIR/$name.log" 2>&1; fi
    echo "== $name done rc=$? $(date -u +%H:%M:%S)"
}
[ -n "${PRE:-}" ] && job pre bash -c "$PRE"
echo "== teacher trial $(date -u +%H:%M:%S): pretrain $TEACHER_EXTRA; gate: $GATE_FAMILY >= $GATE_THRESHOLD after stage $GATE_STAGE"
CKPT=${CKPT:-/tmp/testbed-teacher}  # teacher.sh's output folder: pretrain rewrites its pretrain_log.json per stage
if [ "${DRY_RUN:-0}" = 1 ]; then  # a fake pretrain: one stage check a second, every family at DRY_TRACE
    rm -rf "$CKPT"; mkdir -p "$CKPT"
    setsid python3 -c "
import json, sys, time
stages = []
for s in range(5):
    stages.append({'stage': s, 'accuracy': {'eval': {f: float(sys.argv[2]) for f in ('trace', 'niah', 'vt', 'recall')}}})
    open(sys.argv[1] + '/pretrain_log.json', 'w').write(json.dumps({'stages': stages}))
    time.sleep(1)
open('/tmp/teacher.done', 'w').close()" "$CKPT" "${DRY_TRACE:-0.0}" &
else
    RUN_DIR="$RUN_DIR/teacher" CKPT=$CKPT EXTRA=$TEACHER_EXTRA setsid bash benchmarks/device/teacher.sh > "$RUN_DIR/teacher.log" 2>&1 &
fi
teacher=$!
verdict=""
gate_verdict() { python3 benchmarks/pretrain_early_gate.py "$CKPT" --stage "$GATE_STAGE" --family "$GATE_FAMILY" \
    --threshold "$GATE_THRESHOLD"; }
while kill -0 "$teacher" 2>/dev/null && [ -z "$verdict" ]; do
    verdict=$(gate_verdict)
    [ -z "$verdict" ] && sleep 5
done
# a teacher that ended between two checks has its whole log written: read it once more
[ -z "$verdict" ] && verdict=$(gate_verdict)
echo "== gate $(date -u +%H:%M:%S): ${verdict:-teacher ended before stage $GATE_STAGE}"
echo "${verdict:-none}" > "$RUN_DIR/gate.txt"
if [ "${verdict%% *}" = pass ]; then
    if [ -n "${WITH_EVAL:-}" ]; then  # beside the evaluation: after the checkpoint is written, before the teacher ends
        while kill -0 "$teacher" 2>/dev/null && [ ! -e /tmp/teacher.pretrained ]; do sleep 5; done
        job with_eval bash -c "$WITH_EVAL" &
    fi
    wait "$teacher"; echo "== teacher done $(date -u +%H:%M:%S)"; cat "$RUN_DIR/teacher.log"
    wait  # WITH_EVAL
    [ -n "${THEN:-}" ] && job then bash -c "$THEN"
    touch /tmp/session.done; exit 0
fi
kill -- -"$teacher" 2>/dev/null; pkill -f "kvlearn.cli pretrain" 2>/dev/null; wait "$teacher" 2>/dev/null
# the stopped trial's last stage checkpoint, for a diagnosis on the CPU (collect_session.sh brings it back)
[ -e "$CKPT/config.json" ] && tar -C "$(dirname "$CKPT")" -cf "$RUN_DIR/teacher/trial_checkpoint.tar" "$(basename "$CKPT")"
echo "== teacher trial stopped; method tables on the shipped teacher $(date -u +%H:%M:%S)"
if [ -n "${FALLBACK:-}" ]; then  # instead of the tables below: this command line, alone on the GPU
    job fallback bash -c "$FALLBACK"
    echo "== done $(date -u +%H:%M:%S)"; touch /tmp/session.done; exit 0
fi
job baselines env OUT="$RUN_DIR/baselines" METHODS=${METHODS:-streaming,snapkv,random} BUDGETS=${BUDGETS:-1024,512} \
    MINUTES=8 bash benchmarks/device/eviction_baselines.sh &
job table512 env OUT="$RUN_DIR/table512" TAG=_b512 BUDGET=512 STUDENTS=kvpop=kvpop RETROFIT_MINUTES=${MLSTM_MINUTES:-9} \
    TOTAL_MINUTES=$(python3 -c "print(${MLSTM_MINUTES:-9} + 3.5)") BASELINES=0 SPLIT_PARTS=1 \
    bash benchmarks/device/kvpop_table.sh &
job table256 env OUT="$RUN_DIR/table256" TAG=_b256 BUDGET=256 STUDENTS="kvpop_mlp=kvpop streaming_plus=streaming_plus dms=dms" \
    RETROFIT_MINUTES=${MINUTES_256:-6} TOTAL_MINUTES=$(python3 -c "print(${MINUTES_256:-6} + 5.5)") \
    RETROFIT_ARGS="--window ${WINDOW_256:-64}" TABLE_ARGS="--budgets 256" bash benchmarks/device/kvpop_table.sh &
wait
job packed_decode_speed python3 benchmarks/packed_decode_speed.py --graph --out "$RUN_DIR/packed_decode_h200.json"
echo "== done $(date -u +%H:%M:%S)"
touch /tmp/session.done
