#!/usr/bin/env bash
# Second device call: GPU 0 continues the teacher at long lengths (resume from checkpoints/testbed-teacher) and
# evaluates it; GPU 1 runs the KVpop ops benchmark, then the mLSTM/scorer GPU tests.
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}; mkdir -p "$OUT"
MINUTES=${MINUTES:-2.5}
CKPT=/tmp/testbed-teacher
(CUDA_VISIBLE_DEVICES=1 timeout 260 python3 benchmarks/kvpop_ops.py --out "$OUT/kvpop_ops_h200.json" > "$OUT/bench.log" 2>&1;
 CUDA_VISIBLE_DEVICES=1 timeout 60 python3 -m pytest -q -m gpu tests/ops/test_mlstm.py tests/kvpop/test_scorers.py -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1) &
CUDA_VISIBLE_DEVICES=0 python3 -m kvlearn.cli pretrain --resume checkpoints/testbed-teacher --out $CKPT --minutes "$MINUTES" \
  --stages 2048,4096 --stage-fractions 0.3,0.7 --lr 1e-3 --warmup-steps 50 --num-workers 6 --eval-n 32 > "$OUT/pretrain.log" 2>&1
grep '"stage"' "$OUT/pretrain.log"
tar -C /tmp -cf "$OUT/teacher.tar" testbed-teacher
CUDA_VISIBLE_DEVICES=0 python3 benchmarks/teacher_eval.py --model $CKPT --n-per-task 100 --out "$OUT/testbed_teacher.json" > "$OUT/eval.log" 2>&1
wait
tail -n 10 "$OUT/eval.log"; grep -v Warn "$OUT/bench.log" | tail -n 40; tail -n 3 "$OUT/gpu_tests.log"
