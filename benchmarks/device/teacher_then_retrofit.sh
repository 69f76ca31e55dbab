#!/usr/bin/env bash
# One device session's chain, detached so that no device time is lost between calls: train the testbed teacher
# (`teacher.sh`: `kvlearn pretrain` defaults + TEACHER_EXTRA, then its greedy evaluation). As soon as the checkpoint
# is written, `benchmarks/teacher_stage_gate.py` picks the teacher to measure methods on: the new one if its last
# stage check reached 0.8 on niah, vt and recall on both splits, else the shipped checkpoints/testbed-teacher (so a
# failed teacher costs only its own training). Then three jobs share the GPU: the new teacher's greedy evaluation, a
# KVpop retrofit onto the chosen teacher (`retrofit.sh`: the default window 256, RETROFIT_MINUTES, default 3, N
# examples per family, default 50, RETROFIT_EXTRA more retrofit options, default '--decay-init 0.99999': decays that start with almost no recency
# prior on a 4k context and move with their own learning rate, docs/DESIGN.md "The learned decay") and the eviction baselines on it
# (`eviction_baselines.sh`, BASELINE_MINUTES, default 4; rows not reached are listed in its `not_run`). The three are
# small-model, launch-bound jobs, so sharing one H200 costs each little; the retrofit's step count in its log says
# what it got. Everything goes to RUN_DIR (default /tmp/session_out; `chosen_teacher.txt` names the teacher used);
# /tmp/session.done marks the end; /tmp/session.log is the chain's own log. Device time on one H200: ~1 start + 18
# pretrain + ~1 stage checks + max(~3 eval, RETROFIT_MINUTES + ~2, BASELINE_MINUTES + ~1), about 25 minutes: the
# collecting call must bundle RUN_DIR into at most 8 files before the session's 30 minutes are spent.
# With several GPUs the teacher trains with DDP for 18/NGPU minutes and the baselines spread over the GPUs.
#   call 1:  setsid bash benchmarks/device/teacher_then_retrofit.sh > /tmp/session.log 2>&1 < /dev/null & sleep 580; cat /tmp/session.log
#   call 2 (within the 30 s the machine stays warm):  sleep 590; cat /tmp/session.log
#   call 3:  WAIT_S=<device seconds left - 60> bash benchmarks/device/collect_session.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
RUN_DIR=${RUN_DIR:-/tmp/session_out}; mkdir -p "$RUN_DIR"
rm -f /tmp/session.done /tmp/teacher.pretrained
echo "== teacher $(date -u +%H:%M:%S)"
RUN_DIR="$RUN_DIR/teacher" EXTRA=${TEACHER_EXTRA:-} bash benchmarks/device/teacher.sh > "$RUN_DIR/teacher.log" 2>&1 &
teacher=$!
while [ ! -e /tmp/teacher.pretrained ] && kill -0 "$teacher" 2>/dev/null; do sleep 5; done
if [ ! -e /tmp/teacher.pretrained ]; then echo "pretrain did not finish"; cat "$RUN_DIR/teacher.log"; touch /tmp/session.done; exit 1; fi
TEACHER=$(python3 benchmarks/teacher_stage_gate.py /tmp/testbed-teacher --fallback checkpoints/testbed-teacher)
echo "$TEACHER" > "$RUN_DIR/chosen_teacher.txt"
echo "== retrofit and baselines on $TEACHER $(date -u +%H:%M:%S)"
(OUT="$RUN_DIR/retrofit" MODEL=$TEACHER MINUTES=${RETROFIT_MINUTES:-3} N=${N:-50} EXTRA=${RETROFIT_EXTRA---decay-init 0.99999} \
    bash benchmarks/device/retrofit.sh > "$RUN_DIR/retrofit.log" 2>&1; echo "== retrofit done $(date -u +%H:%M:%S)") &
(OUT="$RUN_DIR/baselines" MODEL=$TEACHER MINUTES=${BASELINE_MINUTES:-4} \
    bash benchmarks/device/eviction_baselines.sh > "$RUN_DIR/baselines.log" 2>&1; echo "== baselines done $(date -u +%H:%M:%S)") &
wait "$teacher"; echo "== teacher done $(date -u +%H:%M:%S)"; cat "$RUN_DIR/teacher.log"
wait
echo "== done $(date -u +%H:%M:%S)"
touch /tmp/session.done
