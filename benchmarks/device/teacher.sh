#!/usr/bin/env bash
# Train the testbed teacher from scratch with `kvlearn pretrain`'s defaults (one run, 18 minutes on one H200), then
# evaluate it greedily through the real caches (dense vs 4 sinks + window at budget 1024, context 4096, n=$N per
# family, splits eval and heldout).
# Device time: start ~1 min, pretrain 18 min + ~1 min of stage checks, eval n=100 ~3 min.
# The 10-minute limit of one device command is longer than the run: start it detached and wait in a second call:
#   call 1:  setsid bash benchmarks/device/teacher.sh > /tmp/teacher.log 2>&1 < /dev/null & sleep 570; tail /tmp/teacher.log
#   call 2:  while [ ! -e /tmp/teacher.done ]; do sleep 10; done; cp /tmp/teacher_out/* $OUT/
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/teacher_out}; mkdir -p "$OUT"
N=${N:-100}
CKPT=${CKPT:-/tmp/testbed-teacher}
rm -rf "$CKPT" /tmp/teacher.done
echo "$(python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name(0))')"
python3 -m kvlearn.cli pretrain --out "$CKPT" > "$OUT/pretrain.log" 2>&1 || echo "pretrain failed"
grep '"stage"' "$OUT/pretrain.log"
tar -C "$(dirname "$CKPT")" -cf "$OUT/teacher.tar" "$(basename "$CKPT")"
python3 benchmarks/teacher_eval.py --model "$CKPT" --n-per-task "$N" --batch-size 50 --out "$OUT/testbed_teacher.json" > "$OUT/eval.log" 2>&1 || echo "eval failed"
tail -n 40 "$OUT/eval.log"

touch /tmp/teacher.done
