#!/usr/bin/env bash
# Train the testbed teacher from scratch with `kvlearn pretrain`'s defaults (one run, 18 minutes on one H200), then
# evaluate it greedily through the real caches (dense vs 4 sinks + window at budget 1024, context 4096, n=$N per
# family, splits eval and heldout). Everything goes to RUN_DIR (default /tmp/teacher_out, not the device call's
# $OUT: that folder is emptied at every call, and the run outlives one call); /tmp/teacher.pretrained marks the
# checkpoint written, /tmp/teacher.done the end.
# Device time: start ~1 min, pretrain 18 min + ~1 min of stage checks, eval n=100 ~2 min. With several GPUs it
# trains with DDP for 18/NGPU minutes (the same tokens: ~1.2M tokens/s per H200). EXTRA: more pretrain options
# (e.g. EXTRA='--family-weights 3,1,1,1;3,1,1,1;1,1,1,1;1,1,1,1;1,1,1,1'); MINUTES overrides the time.
# One device command may run 10 minutes, so start it detached and collect it in later calls:
#   call 1:  setsid bash benchmarks/device/teacher.sh > /tmp/teacher.log 2>&1 < /dev/null & sleep 570; cat /tmp/teacher.log
#   call 2 (within the 30 s the machine stays warm):  for i in $(seq 57); do [ -e /tmp/teacher.done ] && break; sleep 10; done
#   call 3:  same wait, then  cp /tmp/teacher_out/* $OUT/
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
RUN_DIR=${RUN_DIR:-/tmp/teacher_out}; mkdir -p "$RUN_DIR"
N=${N:-100}
CKPT=${CKPT:-/tmp/testbed-teacher}
rm -rf "$CKPT" /tmp/teacher.done /tmp/teacher.pretrained
echo "$(python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__, torch.cuda.get_device_name(0))')"
NGPU=$(python3 -c 'import torch; print(max(1, torch.cuda.device_count()))')
if [ "$NGPU" -gt 1 ]; then  # DDP: the same tokens in 18/NGPU minutes (the recipe follows elapsed time)
    # shellcheck disable=SC2086
    python3 -m torch.distributed.run --standalone --nproc_per_node "$NGPU" -m kvlearn.cli pretrain --out "$CKPT" \
        --minutes "${MINUTES:-$(python3 -c "print(round(18 / $NGPU, 2))")}" ${EXTRA:-} > "$RUN_DIR/pretrain.log" 2>&1 || echo "pretrain failed"
else
    # shellcheck disable=SC2086
    python3 -m kvlearn.cli pretrain --out "$CKPT" --minutes "${MINUTES:-18}" ${EXTRA:-} > "$RUN_DIR/pretrain.log" 2>&1 || echo "pretrain failed"
fi
grep '"stage"' "$RUN_DIR/pretrain.log"
tar -C "$(dirname "$CKPT")" -cf "$RUN_DIR/teacher.tar" "$(basename "$CKPT")"
touch /tmp/teacher.pretrained  # the checkpoint is complete: a chain may start using it
python3 benchmarks/teacher_eval.py --model "$CKPT" --n-per-task "$N" --batch-size 50 --out "$RUN_DIR/testbed_teacher.json" \
    > "$RUN_DIR/eval.log" 2>&1 || echo "eval failed"
tail -n 40 "$RUN_DIR/eval.log"
# which digits of a trace answer it gets wrong (definition lookups, arithmetic, ...), teacher-forced at 4096: seconds
python3 benchmarks/trace_token_accuracy.py --model "$CKPT" --length 4096 --n 50 --device cuda \
    --out "$RUN_DIR/trace_token_accuracy.json" > "$RUN_DIR/trace_token_accuracy.log" 2>&1 || echo "trace token accuracy failed"
grep -v "Loading" "$RUN_DIR/trace_token_accuracy.log" | tail -n 8
touch /tmp/teacher.done
