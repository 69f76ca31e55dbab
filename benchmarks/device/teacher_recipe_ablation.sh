#!/usr/bin/env bash
# Short from-scratch `kvlearn pretrain` runs side by side, one per GPU (round robin when there are fewer GPUs than
# arms), to compare teacher recipes by their stage checks before paying for a full 18-minute run. Each arm runs
# MINUTES (default 5) on stages 256,512,1024 with the default recipe's relative time shares (.06/.08/.12 -> .23/.31/.46);
# on one H200 GPU-alone throughput (~1.2M tokens/s) 5 minutes reach ~350M tokens, where the first teacher had
# trace 0.84 teacher-forced.
# ARMS: 'name=extra pretrain args|name=extra args|...' (default: the default recipe; the default recipe with another
# seed; trace first: trace weighted 0.7 in the 256 and 512 stages, uniform at 1024; docs/TESTBED.md "The shipped
# teacher" says why). Arms that share one GPU also share its throughput: compare them by their stage checks at equal
# tokens (the logs' step lines), not at equal minutes.
# Writes $OUT/ablation_<name>.log (stdout of each run; its stage-check JSON lines).
# Device time: MINUTES + ~1 minute of checks and start-up.
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... ARMS='...' bash benchmarks/device/teacher_recipe_ablation.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}
mkdir -p "$OUT"
M=${MINUTES:-5}
ARMS=${ARMS:-"varied=|varied_seed1=--seed 1|trace_first=--family-weights 0.7,0.1,0.1,0.1;0.7,0.1,0.1,0.1;1,1,1,1"}
NGPU=$(python3 -c 'import torch; print(max(1, torch.cuda.device_count()))')
i=0
IFS='|' read -ra LIST <<< "$ARMS"
for arm in "${LIST[@]}"; do
    name=${arm%%=*}; extra=${arm#*=}
    # shellcheck disable=SC2086
    CUDA_VISIBLE_DEVICES=$((i % NGPU)) python3 -m kvlearn.cli pretrain --out "/tmp/ablation_$name" --overwrite \
        --minutes "$M" --stages 256,512,1024 --stage-fractions 0.23,0.31,0.46 --eval-n 32 \
        --num-workers $((12 / ${#LIST[@]})) $extra > "$OUT/ablation_$name.log" 2>&1 &
    i=$((i + 1))
done
wait
for f in "$OUT"/ablation_*.log; do echo "== $f"; grep '"stage"' "$f" || tail -n 5 "$f"; done
