#!/usr/bin/env bash
# Trains the testbed teacher from scratch (`kvlearn pretrain` with its defaults; DDP over every visible GPU), copies
# the checkpoint to $OUT/testbed-teacher, then evaluates it (dense vs 4-sink streaming at budget 1024, context
# 4096, n=$N per task family) into $OUT/testbed_teacher.json.
# Expected device time: pretrain's default 15 minutes (+ about 40 s of start-up) + about 2 minutes of evaluation;
# set MINUTES (for example MINUTES=6 on nvidia-h200-x2) to fit one 10-minute device call.
# The committed teacher came from three resumed runs of an earlier version of this script (results/raw/README.md).
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/device/teacher.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}
mkdir -p "$OUT"
echo "commit=${KVLEARN_COMMIT:-?} $(python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)') triton $(python3 -c 'import triton; print(triton.__version__)' 2>/dev/null || echo none)"
CKPT=/tmp/testbed-teacher
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
ARGS="pretrain --out $CKPT ${MINUTES:+--minutes $MINUTES}"
if [ "$NGPU" -ge 2 ]; then
  torchrun --standalone --nproc_per_node="$NGPU" -m kvlearn.cli $ARGS > "$OUT/pretrain.log" 2>&1
else
  python3 -m kvlearn.cli $ARGS > "$OUT/pretrain.log" 2>&1
fi
echo "pretrain rc=$?"; tail -n 3 "$OUT/pretrain.log"
cp -r "$CKPT" "$OUT/testbed-teacher"
python3 benchmarks/teacher_eval.py --model "$CKPT" --n-per-task "${N:-100}" --out "$OUT/testbed_teacher.json" \
  > "$OUT/teacher_eval.log" 2>&1
echo "eval rc=$?"; tail -n 14 "$OUT/teacher_eval.log"
