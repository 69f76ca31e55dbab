#!/usr/bin/env bash
# One device session's chain, detached so that no device time is lost between calls: train the testbed teacher
# (`teacher.sh`: `kvlearn pretrain` defaults + its greedy evaluation), then retrofit KVpop onto it (`retrofit.sh`,
# the default window 256, RETROFIT_MINUTES, default 5) and measure the student's needle retention on the CPU cores,
# then the eviction baselines on the new teacher with what is left (`eviction_baselines.sh`, BASELINE_MINUTES,
# default 3; rows not reached are listed in its `not_run`). Everything goes to RUN_DIR (default /tmp/session_out);
# /tmp/session.done marks the end; /tmp/session.log is the chain's own log.
# Device time on one H200: ~1 start + 18 pretrain + ~1 checks + ~3 eval + RETROFIT_MINUTES + ~3 + BASELINE_MINUTES.
# With several GPUs the teacher trains with DDP for 18/NGPU minutes and the baselines spread over the GPUs.
#   call 1:  setsid bash benchmarks/device/teacher_then_retrofit.sh > /tmp/session.log 2>&1 < /dev/null & sleep 570; cat /tmp/session.log
#   call 2 (within the 30 s the machine stays warm):  for i in $(seq 57); do [ -e /tmp/session.done ] && break; sleep 10; done; cat /tmp/session.log
#   call 3:  same wait, then  cp -r /tmp/session_out/* $OUT/
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
RUN_DIR=${RUN_DIR:-/tmp/session_out}; mkdir -p "$RUN_DIR"
rm -f /tmp/session.done
echo "== teacher $(date -u +%H:%M:%S)"
RUN_DIR="$RUN_DIR/teacher" bash benchmarks/device/teacher.sh
echo "== retrofit $(date -u +%H:%M:%S)"
OUT="$RUN_DIR/retrofit" MODEL=/tmp/testbed-teacher MINUTES=${RETROFIT_MINUTES:-5} N=${N:-100} \
    bash benchmarks/device/retrofit.sh
python3 benchmarks/kvpop_retention.py --model /tmp/retrofit_mlp_1024/final --family vt --n 8 --threads 8 \
    --out "$RUN_DIR/retrofit/kvpop_retention.json" --heatmap "$RUN_DIR/retrofit/kvpop_retention.png" > "$RUN_DIR/retrofit/kvpop_retention.log" 2>&1 &
echo "== baselines $(date -u +%H:%M:%S)"
OUT="$RUN_DIR/baselines" MODEL=/tmp/testbed-teacher MINUTES=${BASELINE_MINUTES:-3} bash benchmarks/device/eviction_baselines.sh
wait
echo "== done $(date -u +%H:%M:%S)"
touch /tmp/session.done
