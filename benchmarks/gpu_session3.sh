#!/usr/bin/env bash
# Third teacher run (device call): continue checkpoints/testbed-teacher on the fixed training format (every
# in-context answer ends with <eos>, a quarter of the rows in the evaluation format: docs/TESTBED.md) with DDP
# over every visible GPU, then evaluate it (dense vs streaming, n=$N per family, context 4096).
# Timing on nvidia-h200-x2: start ~40 s, pretrain MINUTES + ~40 s, eval n=100 ~2 min.
# Usage on the device:  OUT=... bash benchmarks/gpu_session3.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}; mkdir -p "$OUT"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
MINUTES=${MINUTES:-5.0}
N=${N:-100}
CKPT=/tmp/testbed-teacher
echo "gpus=$NGPU minutes=$MINUTES n=$N $(python3 -c 'import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)')"
ARGS="pretrain --resume checkpoints/testbed-teacher --out $CKPT --minutes $MINUTES --seed 3 --stages 2048,4096
      --stage-fractions 0.3,0.7 --lr 1e-3 --warmup-steps 50 --dense-fraction 0.75 --num-workers 6 --eval-n 64"
torchrun --standalone --nproc_per_node="$NGPU" -m kvlearn.cli $ARGS > "$OUT/pretrain.log" 2>&1 || echo "pretrain failed"
grep '"stage"' "$OUT/pretrain.log"; tail -n 3 "$OUT/pretrain.log"
tar -C /tmp -cf "$OUT/teacher.tar" testbed-teacher
python3 benchmarks/teacher_eval.py --model $CKPT --n-per-task $N --out "$OUT/testbed_teacher.json" > "$OUT/eval.log" 2>&1
tail -n 14 "$OUT/eval.log"
