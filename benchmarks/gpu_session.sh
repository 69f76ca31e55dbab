#!/usr/bin/env bash
# One device call that builds, checks and measures everything the foundation and KVpop-primitives issues need:
#   1. trains the testbed teacher (DDP over every visible GPU) for $MINUTES minutes;
#   2. evaluates it (dense vs streaming, n=$N per family, context 4096) -> testbed_teacher.json;
#   3. in parallel on the second GPU (or afterwards on the first): the KVpop ops benchmark -> kvpop_ops_h200.json
#      (it writes its rows as it goes, so a time-out keeps what it measured), then, if GPU_TESTS=1, the GPU tests.
# Timing on nvidia-h200-x2 (2026-11-30): start ~40 s, pretrain MINUTES + ~40 s, eval n=100 ~2 min: keep
# MINUTES <= 6 so the call ends inside the 10-minute command limit.
# Usage on the device:  OUT=... bash benchmarks/gpu_session.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}
mkdir -p "$OUT"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
MINUTES=${MINUTES:-$([ "$NGPU" -ge 2 ] && echo 6.0 || echo 4.5)}
GPU_TESTS=${GPU_TESTS:-0}
N=${N:-100}
echo "gpus=$NGPU minutes=$MINUTES n=$N $(python3 -c 'import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)')"
CKPT=/tmp/testbed-teacher
TRAIN_ARGS="pretrain --out $CKPT --minutes $MINUTES --num-workers 5 --eval-n 32"
if [ "$NGPU" -ge 2 ]; then
  torchrun --standalone --nproc_per_node="$NGPU" -m kvlearn.cli $TRAIN_ARGS > "$OUT/pretrain.log" 2>&1 \
    || { echo "DDP failed, single GPU"; python3 -m kvlearn.cli $TRAIN_ARGS --minutes 3 >> "$OUT/pretrain.log" 2>&1; }
else
  python3 -m kvlearn.cli $TRAIN_ARGS > "$OUT/pretrain.log" 2>&1
fi
grep '"stage"' "$OUT/pretrain.log"; tail -n 3 "$OUT/pretrain.log"
tar -C /tmp -cf "$OUT/teacher.tar" testbed-teacher
EVAL="python3 benchmarks/teacher_eval.py --model $CKPT --n-per-task $N --out $OUT/testbed_teacher.json"
BENCH="timeout 140 python3 benchmarks/kvpop_ops.py --out $OUT/kvpop_ops_h200.json"
TESTS="true"
[ "$GPU_TESTS" = 1 ] && TESTS="timeout 150 python3 -m pytest -q -m gpu tests -p no:cacheprovider"
if [ "$NGPU" -ge 2 ]; then
  CUDA_VISIBLE_DEVICES=0 $EVAL > "$OUT/eval.log" 2>&1 &
  (CUDA_VISIBLE_DEVICES=1 $BENCH > "$OUT/bench.log" 2>&1; CUDA_VISIBLE_DEVICES=1 $TESTS > "$OUT/gpu_tests.log" 2>&1) &
  wait
else
  $EVAL > "$OUT/eval.log" 2>&1
  $BENCH > "$OUT/bench.log" 2>&1
  $TESTS > "$OUT/gpu_tests.log" 2>&1
fi
tail -n 12 "$OUT/eval.log"; tail -n 30 "$OUT/bench.log"; tail -n 5 "$OUT/gpu_tests.log"
