#!/usr/bin/env bash
# Does the haystack variety stop the teacher from learning `trace`? Two short from-scratch pretrain runs side by
# side on one GPU, trace-only data, stages 512 then 1024: A = every training style and depth regime (the default
# testbed), B = the first testbed's haystack (style svo, uniform depths). The first teacher (svo, uniform, all four
# families) reached trace 0.84 teacher-forced after ~90M trace tokens; if B learns and A does not, the haystack is
# the cause; if both learn, the competition with the other families is.
# Device time: MINUTES (default 2.3) per run, both at once, plus ~30 s of stage checks and start-up.
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/device/trace_haystack_ablation.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}
mkdir -p "$OUT"
M=${MINUTES:-2.3}
common="--minutes $M --stages 512,1024 --stage-fractions 0.5,0.5 --family-weights 1,0,0,0 --eval-n 32 --num-workers 6"
python3 -m kvlearn.cli pretrain --out /tmp/ablation_all $common > "$OUT/trace_ablation_all.log" 2>&1 &
python3 -m kvlearn.cli pretrain --out /tmp/ablation_svo_uniform $common --train-styles svo --train-regimes uniform \
    > "$OUT/trace_ablation_svo_uniform.log" 2>&1 &
wait
for f in "$OUT"/trace_ablation_*.log; do echo "== $f"; grep '"stage"' "$f" || tail -n 5 "$f"; done
