#!/usr/bin/env bash
# Evaluates the eviction baselines on the testbed (benchmarks/eviction_baselines.py) into $OUT/baselines_table.json,
# stdout in $OUT/eviction_baselines*.log. The methods are dealt round robin over PROCS_PER_GPU (default 3) processes
# on each GPU, each measuring the full cache too, and the parts are merged (`python -m kvlearn.results merge`): the
# testbed teacher is small and its decoding launch-bound, so processes sharing one H200 slow each other far less than
# they would queue (from the committed tables' wall_seconds: the 68c180d baselines process alone took ~20 s per run of
# 400 examples, the 894106b one, sharing the GPU with two other jobs, ~28 s).
# Device time: at most MINUTES (default 9, one 10-minute device call) plus start-up; rows not reached are listed
# in the file's `not_run` (run the script again with --methods/--budgets for them). The partial run at 68c180d did 9
# runs of 400 examples in 183 s on one H200; the whole table has 25 runs (about 9 minutes in one process).
# MODEL (default: the shipped checkpoints/testbed-teacher) evaluates another checkpoint folder; METHODS (default all
# seven) and BUDGETS (default the script's, 1024,512) pick the rows, e.g. the ones a merged table's `not_run` lists:
#   METHODS=streaming,snapkv,random BUDGETS=512 ...
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/device/eviction_baselines.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
echo "commit=${KVLEARN_COMMIT:-?} $(python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)') triton $(python3 -c 'import triton; print(triton.__version__)' 2>/dev/null || echo none)"
NGPU=$(python3 -c 'import torch; print(max(1, torch.cuda.device_count()))')
NPROC=$((NGPU * ${PROCS_PER_GPU:-3}))
METHODS=${METHODS:-streaming,tova,h2o,snapkv,pyramidkv,knorm,random}
IFS=',' read -ra M <<< "$METHODS"
parts=()
for p in $(seq 0 $((NPROC - 1))); do
    group=""
    for i in "${!M[@]}"; do [ $((i % NPROC)) -eq "$p" ] && group="$group,${M[$i]}"; done
    [ -z "$group" ] && continue
    CUDA_VISIBLE_DEVICES=$((p % NGPU)) python3 benchmarks/eviction_baselines.py --model "${MODEL:-checkpoints/testbed-teacher}" \
        --methods "${group#,}" ${BUDGETS:+--budgets "$BUDGETS"} --minutes "${MINUTES:-9}" --out "$OUT/baselines_part$p.json" \
        --plot "$OUT/baselines_part$p.png" > "$OUT/eviction_baselines_part$p.log" 2>&1 &
    parts+=("$OUT/baselines_part$p.json")
done
wait
python3 -m kvlearn.results merge "$OUT/baselines_table.json" "${parts[@]}"
python3 -c "
import sys; sys.path.insert(0, 'src')
from kvlearn.eval.plots import plot_pareto; from kvlearn.results import read_results
print(plot_pareto(read_results('$OUT/baselines_table.json')['rows'], '$OUT/baselines_table.png', title='eviction baselines, context 4096'))"
rm -f "$OUT"/baselines_part*.json "$OUT"/baselines_part*.png
tail -n 12 "$OUT"/eviction_baselines_part*.log
