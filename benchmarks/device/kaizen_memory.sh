#!/usr/bin/env bash
# The KV-Kaizen memory / decode-speed benchmark (issue #11 item 9; benchmarks/kaizen_memory.py): a Qwen2.5-14B-shaped
# random bf16 model (48 layers, 8 KV heads of 128; MLP and vocabulary cut) at batch 1, configurations bf16, int4,
# kivi2, mla_r128, share4 and composed at contexts 16k..131k, into $OUT/kaizen_memory_h200.json (stdout in
# $OUT/kaizen_memory.log). Every row: peak memory, cache bytes vs the cost model, decode ms/token, ratios to bf16.
# Expected device time (an estimate from FLOPs, not yet measured): the chunked prefill dominates; its attention
# grows with context^2 (every chunk attends the whole preallocated capacity: about 1e6 x T^2 FLOPs per row, 1.7e16 at
# 131k, 2-3 minutes per row at 100-150 TFLOP/s of masked SDPA; MLA rows about 1.3-1.5x that), the decode steps and
# the model build (~1 minute) are small. The whole grid (24 rows) is about 20-25 minutes, more than one 10-minute
# device call, so run it in parts, each with its own PART (bf16 always runs too: the ratios' reference is measured
# in the same run):
#   PART=a CONTEXTS=16384,32768,65536                      (about 6-7 minutes)
#   PART=b CONTEXTS=131072 CONFIGS=int4,kivi2              (about 7-9 minutes)
#   PART=c CONTEXTS=131072 CONFIGS=share4,mla_r128         (about 7-9 minutes)
#   PART=d CONTEXTS=131072 CONFIGS=composed                (about 5-6 minutes)
# then `python -m kvlearn.results merge results/kaizen_memory_h200.json kaizen_memory_h200_{a,b,c,d}.json` (rows
# are keyed by method = config and budget = context; the first bf16 row of a context is kept, and each row's
# ratio_to_bf16 is against the bf16 row of its own part). MINUTES (default 6) is the script's time guard: no row
# starts after it (the call is killed at MINUTES + 230 s, inside a 10-minute device call), rows not started are
# listed in `not_run`, and the file is rewritten after every row. After the merge, `python
# benchmarks/kaizen_memory.py --summarise results/kaizen_memory_h200.json` recomputes the file's summary over all rows.
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... [CONTEXTS=...] [CONFIGS=...] [PART=...] \
#                       bash benchmarks/device/kaizen_memory.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
echo "commit=${KVLEARN_COMMIT:-?} $(python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)') triton $(python3 -c 'import triton; print(triton.__version__)' 2>/dev/null || echo none)"
NAME=kaizen_memory_h200${PART:+_$PART}
MINUTES=${MINUTES:-6}
timeout $(( ${MINUTES%.*} * 60 + 230 )) python3 benchmarks/kaizen_memory.py \
    --contexts "${CONTEXTS:-16384,32768,65536,131072}" --configs "${CONFIGS:-all}" --minutes "$MINUTES" \
    --out "$OUT/$NAME.json" > "$OUT/kaizen_memory${PART:+_$PART}.log" 2>&1
echo "rc=$?"
grep -v Warn "$OUT/kaizen_memory${PART:+_$PART}.log" | tail -n 40
[ -f "$OUT/$NAME.json" ] && python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
print(json.dumps({k: d.get(k) for k in ('summary', 'not_run', 'complete', 'wall_seconds')}, indent=1))
" "$OUT/$NAME.json"
