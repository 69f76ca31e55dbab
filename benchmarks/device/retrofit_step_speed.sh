#!/usr/bin/env bash
# Issue #10 item 8, "one retrofit step <= 1.5x a plain distillation step of the dense model on the same batch"
# (benchmarks/retrofit_step_speed.py): ms per optimizer step of a plain distillation step of the dense model and of
# the retrofit's own step (KVpop with the MLP and with the mLSTM scorer; budget 1024, window 256), timed in one
# process on one batch, interleaved in rounds; summary.acceptance judged on the mLSTM (the paper's KVpop). Two runs:
#   1. the committed testbed teacher, seq 4096, batch 8 (the real retrofit) -> $OUT/retrofit_step_speed_h200.json
#   2. a random Qwen3-0.6B-shaped model (testbed vocabulary), seq 8192, batch 1 -> $OUT/retrofit_step_speed_0p6b_h200.json;
#      SHAPES='qwen3-0.6b qwen3-1.7b' adds the Qwen3-1.7B shape (1.41 B parameters with the testbed vocabulary), where
#      the step is less launch-bound -> $OUT/retrofit_step_speed_1p7b_h200.json; that shape runs with --one-resident
#      (one row's student in memory at a time: its rows did not fit an H100 together, session 35)
# stdout in $OUT/retrofit_step_speed.log and $OUT/retrofit_step_speed_0p6b.log; run 1 also profiles one step of each
# method (profile/<method>.txt: the CUDA kernels by self time; profile/<method>.trace.json.gz: its timeline;
# profile/<method>.host.txt: three steps under cProfile, --host-profile), all in $OUT/profile.tgz (the device tool
# returns at most 8 files; each timeline's idle gaps printed by benchmarks/step_timeline_gaps.py), and counts each
# step's host syncs by the line that
# issued them (--sync-sites: the rows' host_syncs_per_step, host_sync_sites); each run under `timeout 200` (the
# file is rewritten after every timed round, so a time-out keeps what it measured, marked "partial").
# METHODS adds rows, e.g. METHODS=retrofit_kvpop_mlp,retrofit_kvpop_mlstm,retrofit_dms,retrofit_streaming_plus;
# VARIANTS adds variant rows to both runs (retrofit_step_speed.py --variants), e.g. VARIANTS=mlstm_cudagraphs.
# Expected device time: about 3 minutes on one H200 (compiles included: flex attention and the mLSTM scorer).
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/device/retrofit_step_speed.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
echo "commit=${KVLEARN_COMMIT:-?} $(python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)') triton $(python3 -c 'import triton; print(triton.__version__)' 2>/dev/null || echo none)"
timeout 200 python3 benchmarks/retrofit_step_speed.py ${METHODS:+--methods "$METHODS"} ${VARIANTS:+--variants "$VARIANTS"} --sync-sites --profile "$OUT/profile" \
    --host-profile "$OUT/profile" \
    --out "$OUT/retrofit_step_speed_h200.json" > "$OUT/retrofit_step_speed.log" 2>&1
echo "teacher rc=$?"
for trace in "$OUT"/profile/*.trace.json.gz; do  # where each step's GPU idles, by the host operator that was late
    [ -e "$trace" ] && echo "== $(basename "$trace")" && python3 benchmarks/step_timeline_gaps.py "$trace" --top 8
done
tar czf "$OUT/profile.tgz" -C "$OUT" profile && rm -r "$OUT/profile"
grep -vE "Warn|Loading weights|Writing model" "$OUT/retrofit_step_speed.log" | tail -n 12
for shape in ${SHAPES:-qwen3-0.6b}; do  # a random model of each shape: results file retrofit_step_speed_<0p6b|1p7b>_h200.json
    tag=$(echo "${shape#qwen3-}" | tr . p)
    resident=""; [ "$shape" = qwen3-1.7b ] && resident="--one-resident"
    timeout 200 python3 benchmarks/retrofit_step_speed.py --shape "$shape" $resident ${METHODS:+--methods "$METHODS"} ${VARIANTS:+--variants "$VARIANTS"} \
        --out "$OUT/retrofit_step_speed_${tag}_h200.json" > "$OUT/retrofit_step_speed_$tag.log" 2>&1
    echo "$shape shape rc=$?"
    grep -vE "Warn|Loading weights|Writing model" "$OUT/retrofit_step_speed_$tag.log" | tail -n 12
done
