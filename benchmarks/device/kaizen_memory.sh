#!/usr/bin/env bash
# The KV-Kaizen memory / decode-speed benchmark (issue #11 item 9; benchmarks/kaizen_memory.py): a Qwen2.5-14B-shaped
# random bf16 model (48 layers, 8 KV heads of 128; MLP and vocabulary cut) at batch 1, configurations bf16, int4,
# kivi2, mla_r128, share4 and composed at contexts 16k..131k, into $OUT/kaizen_memory_h200.json (stdout in
# $OUT/kaizen_memory.log). Every row: peak memory, cache bytes vs the cost model, decode ms/token, ratios to bf16.
# Device time, measured (results/kaizen_memory_h200.json, commit 20c786f, 2026-12-01, one H200): the 18 rows at
# 16k, 32k and 64k (all six configurations) plus the model build took 305 s of the script's wall time: the chunked
# prefill 250 s (3-4 s per row at 16k, 7-11 s at 32k, 26-37 s at 64k: about 3.6x per doubling, its attention grows
# with context^2), the 19 decode steps per row 48 s, the model build and the rest about 7 s. That call ran the whole
# grid without PART/CONTEXTS and an outer `timeout 380` killed it in the first 131072 row. Not measured: a 131k row
# should take about 4x its 64k row, 100-150 s (bf16 ~120 s, kivi2 ~150 s), so the six 131k rows (~12 minutes) need
# more than one 10-minute device call. Run the grid in parts, each with its own PART (bf16 always runs too: the
# ratios' reference is measured in the same run), and give each call at least the time below plus ~1 minute:
#   PART=a CONTEXTS=16384,32768,65536                      (measured: 305 s)
#   PART=b CONTEXTS=131072 CONFIGS=int4,kivi2              (extrapolated 7 minutes; at d2a03be its first row,
#                                                           bf16@131072, had not finished after 590 s: run it alone
#                                                           first, CONFIGS=bf16, whose per-16k prefill lines say why)
#   PART=c CONTEXTS=131072 CONFIGS=share4,mla_r128         (about 6 minutes, extrapolated)
#   PART=d CONTEXTS=131072 CONFIGS=composed                (about 4 minutes, extrapolated)
# then `python -m kvlearn.results merge results/kaizen_memory_h200.json kaizen_memory_h200_{a,b,c,d}.json` (rows
# are keyed by method = config and budget = context; the first bf16 row of a context is kept, and each row's
# ratio_to_bf16 is against the bf16 row of its own part). MINUTES (default 6) is the script's time guard: no row
# starts after it (the call is killed at MINUTES + 230 s, inside a 10-minute device call), rows not started are
# listed in `not_run`, and the file is rewritten after every row with every row not measured yet in `not_run` (a call
# killed from outside leaves a file that says what it lacks; `complete` only when every planned row was measured
# without error). After the merge, `python benchmarks/kaizen_memory.py --summarise results/kaizen_memory_h200.json`
# recomputes the file's summary over all rows and its `not_run` / `complete` over the planned grid (the merge keeps
# part a's contexts and unites the parts' not_run, so a row one part lacked and another measured is listed until then).
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
