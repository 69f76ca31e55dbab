#!/usr/bin/env bash
# Issue #10 item 2 on several GPUs (kind nvidia-h200-x2): the retrofit under FSDP2 with NCCL against the same
# retrofit on one GPU.
#   1. the GPU tests: tests/train/test_{distill,kaizen_train}_fsdp.py -m gpu (tiny random GQA Qwen3, 3 steps,
#      cuda:0 against cuda:0 + cuda:1; the retrofit's passed at df90aa3, kaizen-train's is not yet run)
#      -> $OUT/fsdp_nccl_test.log;
#   2. the real retrofit (the shipped student's recipe: KVpop-MLP at budget 512, lr 1e-4, peak target) for STEPS
#      steps (default 400) on cuda:0, then the same under `torchrun --nproc_per_node WORLD` (default 2), same
#      global batch and data; each student evaluated at its budget on the eval split (n = N, default 100), the two
#      evaluations side by side on two GPUs;
#   3. benchmarks/retrofit_fsdp_compare.py -> $OUT/retrofit_fsdp_h200x2.json (+ .png): step time, speed-up, final loss
#      terms and accuracy of both; the logs, evaluations and train logs (train_log_{one,fsdp}.jsonl) in
#      $OUT/fsdp_logs.tgz.
# Device time: about 4 minutes (two retrofits of ~1 minute with their compiles, two evaluations of ~40 s at once).
# After it, if AFTER is set, that command runs (e.g. another device script), so one call does both.
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/device/retrofit_fsdp.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-out}; mkdir -p "$OUT"
STEPS=${STEPS:-400}; WORLD=${WORLD:-2}; N=${N:-100}; BUDGET=512
gpus=$(python3 -c 'import torch; print(torch.cuda.device_count())')
echo "commit=${KVLEARN_COMMIT:-?} gpus=$gpus $(python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
[ "$gpus" -ge "$WORLD" ] || { echo "needs $WORLD GPUs, found $gpus"; exit 1; }
timeout 300 python3 -m pytest -q -s -m gpu tests/train/test_distill_fsdp.py tests/train/test_kaizen_train_fsdp.py -p no:cacheprovider > "$OUT/fsdp_nccl_test.log" 2>&1
echo "nccl test rc=$?"; grep -E "passed|failed|w2 - w1|Error" "$OUT/fsdp_nccl_test.log" | tail -n 5
ARGS=(retrofit --model checkpoints/testbed-teacher --overwrite --device cuda --scorer mlp --budget "$BUDGET"
      --steps "$STEPS" --num-workers 8 --lr 1e-4 --decay-init 0.99999 --target-reduction peak)
CUDA_VISIBLE_DEVICES=0 python3 -m kvlearn.cli "${ARGS[@]}" --out /tmp/fsdp_one > "$OUT/retrofit_one.log" 2>&1
echo "one gpu rc=$?"
python3 -m torch.distributed.run --nproc_per_node "$WORLD" --master_addr 127.0.0.1 --master_port 29511 \
    -m kvlearn.cli "${ARGS[@]}" --out /tmp/fsdp_sharded > "$OUT/retrofit_fsdp.log" 2>&1
echo "fsdp rc=$?"
for f in "$OUT"/retrofit_one.log "$OUT"/retrofit_fsdp.log; do  # thin the progress lines
    tr '\r' '\n' < "$f" | awk '!/step\/s|it\/s|s\/step/ || NR % 50 == 0' > "$f.t" && mv "$f.t" "$f"; done
EVAL=(eval --method kvpop --budget "$BUDGET" --n-per-task "$N" --split eval --device cuda --batch-size 64 --chunk-size 512)
CUDA_VISIBLE_DEVICES=0 python3 -m kvlearn.cli "${EVAL[@]}" --model /tmp/fsdp_one/final --out "$OUT/eval_one.json" > "$OUT/eval_one.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1 python3 -m kvlearn.cli "${EVAL[@]}" --model /tmp/fsdp_sharded/final --out "$OUT/eval_fsdp.json" > "$OUT/eval_fsdp.log" 2>&1 &
wait
cp /tmp/fsdp_one/train_log.jsonl "$OUT/train_log_one.jsonl"; cp /tmp/fsdp_sharded/train_log.jsonl "$OUT/train_log_fsdp.jsonl"
python3 benchmarks/retrofit_fsdp_compare.py --one /tmp/fsdp_one --sharded /tmp/fsdp_sharded --world "$WORLD" \
    --eval-one "$OUT/eval_one.json" --eval-sharded "$OUT/eval_fsdp.json" --out "$OUT/retrofit_fsdp_h200x2.json" \
    --command "STEPS=$STEPS WORLD=$WORLD N=$N bash benchmarks/device/retrofit_fsdp.sh"
echo "compare rc=$?"
# at most 8 files come back from a device call: the logs and evaluations go into one archive
(cd "$OUT" && tar czf fsdp_logs.tgz fsdp_nccl_test.log retrofit_one.log retrofit_fsdp.log eval_one.json eval_one.log \
    eval_fsdp.json eval_fsdp.log train_log_one.jsonl train_log_fsdp.jsonl && rm -f fsdp_nccl_test.log retrofit_one.log \
    retrofit_fsdp.log eval_one.json eval_one.log eval_fsdp.json eval_fsdp.log train_log_one.jsonl train_log_fsdp.jsonl)
if [ -n "${AFTER:-}" ]; then echo "then: $AFTER"; bash -c "$AFTER"; fi
