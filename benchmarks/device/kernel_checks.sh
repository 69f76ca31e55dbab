#!/usr/bin/env bash
# Short GPU checks of what the CPU cannot measure, in one call (or as the PRE / WITH_EVAL / THEN / FALLBACK of
# teacher_trial_then_tables.sh):
#   1. unless TESTS=0: the GPU tests (TEST_FILES: a space list of test files instead) of the decode kernels (KIVI, packed store with both dequant paths, the caches over
#      them), of the retrofit step (distillation, scorers, the sparse attention, the scorer distillation with its
#      compiled rows), of the future-attention target kernel, of the caches' sparse chunk attention (the fused
#      forward for a long prefill), of the compiled decode step (streaming, knorm, KVpop) and of the graphed retrofit
#      step (retrofit --cuda-graph-step: one CUDA graph replaying the eager steps; a graphed run killed and resumed) -> $OUT/gpu_tests_kernels.log
#   2. unless TIMINGS=0, each alone on the GPU:
#      a. the retrofit step against a plain distillation step (and the operators one step of each dispatches,
#         --count-operators, and the host syncs of one step with where they are issued, --sync-sites), with the variants
#         STEP_VARIANTS (default scorer_kd,scorer_kd_compiled: the scorer distillation's cost, eager and compiled)
#         and, with PROFILE=1, a kernel profile of one step per method (benchmarks/retrofit_step_speed.py --profile)
#         -> $OUT/retrofit_step_speed_h200.json[, $OUT/profile/*.txt]
#      b. unless KIVI=0: the KIVI decode kernel against the bf16 cache and the read-back path, graph-replayed,
#         16k-131k, 2 bits (benchmarks/packed_decode_speed.py --store kivi --graph) -> $OUT/kivi_decode_h200.json
#      c. unless PACKED=0: the packed-store decode kernel (bit planes; `fused_magic`: its dequant="magic" path) against the bf16 cache
#         and the read-back path, graph-replayed, at PACKED_BITS (default 4,2) -> $OUT/packed_decode_h200.json
#      d. with MAGIC_SWEEP=1: the launch sweep of the packed kernel's magic path at 131k, 4 bits
#         (packed_decode_speed.py --sweep-warps --sweep-dequant magic) -> $OUT/packed_decode_magic_sweep_h200.json
#   3. with OPS=1: `benchmarks/kvpop_ops.py --quick` (the KVpop additions against dense attention fwd+bwd, the 0.45
#      bar) -> $OUT/kvpop_ops_quick.json; with PREFILL=1: `benchmarks/kvpop_prefill_attention.py --repeats 2` (a long
#      prompt in one forward through a KVpop cache, mask against sparse, and the 256-token chunks)
#      -> $OUT/kvpop_prefill_attention.json (190 and 200 s timeouts)
#   4. unless SKIP_MEMORY=1: the 131k bf16 row of the Kaizen memory benchmark alone
#      -> $OUT/kaizen_memory_h200_bf16_131k.json
# Every step under its own timeout (420; 200 + 180 + 180 s; then MEMORY_MINUTES (default 3) * 60 + 230 s), typically
# ~2 + (~2.5, ~3 with PROFILE=1, + ~1 + ~1.5) minutes and the memory row; run it detached when the memory row is
# included. The session-31 additions alone: SKIP_MEMORY=1 KIVI=0 MAGIC_SWEEP=1 (about 7 minutes).
# Usage on the device:  KVLEARN_COMMIT=<sent commit> OUT=... bash benchmarks/device/kernel_checks.sh
set -u
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
echo "commit=${KVLEARN_COMMIT:-?} $(python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)') triton $(python3 -c 'import triton; print(triton.__version__)' 2>/dev/null || echo none)"
if [ "${TESTS:-1}" != 0 ]; then
    # shellcheck disable=SC2086
    timeout 420 python3 -m pytest -q -m gpu -p no:cacheprovider ${TEST_FILES:-tests/ops/test_kivi_decode.py tests/ops/test_packed_decode.py tests/cache/test_packed_decode_cache.py tests/train/test_distill.py tests/kvpop/test_scorers.py tests/ops/test_retention_attention.py tests/kvpop/test_scorer_kd.py tests/ops/test_future_target_triton.py tests/eval/test_packed_decode_speed_script.py tests/kvpop/test_sparse_chunk_attention.py tests/cache/test_compile_gpu.py tests/train/test_retrofit_step_speed_script.py tests/train/test_cuda_graph_step.py} \
        > "$OUT/gpu_tests_kernels.log" 2>&1
    echo "gpu tests rc=$?"; tail -n 3 "$OUT/gpu_tests_kernels.log"
fi
if [ "${TIMINGS:-1}" != 0 ]; then
    profile=(); [ "${PROFILE:-0}" = 1 ] && profile=(--profile "$OUT/profile")
    timeout 200 python3 benchmarks/retrofit_step_speed.py --variants "${STEP_VARIANTS:-scorer_kd,scorer_kd_compiled}" \
        --count-operators --sync-sites ${profile[@]+"${profile[@]}"} --out "$OUT/retrofit_step_speed_h200.json" > "$OUT/retrofit_step_speed.log" 2>&1
    echo "retrofit step speed rc=$?"; grep -vE "Warn|Loading weights|Writing model" "$OUT/retrofit_step_speed.log" | tail -n 8
    if [ "${KIVI:-1}" != 0 ]; then
        timeout 180 python3 benchmarks/packed_decode_speed.py --store kivi --bits 2 --graph \
            --out "$OUT/kivi_decode_h200.json" > "$OUT/kivi_decode.log" 2>&1
        echo "kivi decode speed rc=$?"; grep -v Warn "$OUT/kivi_decode.log" | cut -c1-400 | tail -n 4
    fi
    if [ "${PACKED:-1}" != 0 ]; then
        timeout 180 python3 benchmarks/packed_decode_speed.py --bits "${PACKED_BITS:-4,2}" --graph \
            --out "$OUT/packed_decode_h200.json" > "$OUT/packed_decode.log" 2>&1
        echo "packed decode speed rc=$?"; grep -v Warn "$OUT/packed_decode.log" | cut -c1-400 | tail -n 4
    fi
    if [ "${MAGIC_SWEEP:-0}" = 1 ]; then  # the magic path's launches at 131k, 4 bits (tile x warps x stages x split)
        timeout 180 python3 benchmarks/packed_decode_speed.py --bits 4 --contexts 131072 --graph --sweep-warps \
            --sweep-dequant magic --out "$OUT/packed_decode_magic_sweep_h200.json" > "$OUT/packed_decode_magic_sweep.log" 2>&1
        echo "packed decode magic sweep rc=$?"; grep -o "'sweep_best[^,]*, '[^,]*" "$OUT/packed_decode_magic_sweep.log" | tail -n 2
    fi
fi
if [ "${OPS:-0}" = 1 ]; then  # the KVpop primitives' acceptance rows (the additions against dense fwd+bwd)
    timeout 190 python3 benchmarks/kvpop_ops.py --quick --out "$OUT/kvpop_ops_quick.json" > "$OUT/kvpop_ops.log" 2>&1
    echo "kvpop ops rc=$?"; grep -E '"kvpop_additions_over_dense_fwd_bwd(_trained_target)?"' "$OUT/kvpop_ops_quick.json"
fi
if [ "${PREFILL:-0}" = 1 ]; then  # one long prompt through a KVpop cache: mask, sparse, 256-token chunks
    timeout 200 python3 benchmarks/kvpop_prefill_attention.py --repeats 2 \
        --out "$OUT/kvpop_prefill_attention.json" > "$OUT/kvpop_prefill_attention.log" 2>&1
    echo "kvpop prefill rc=$?"; grep "^wrote" "$OUT/kvpop_prefill_attention.log" | tail -n 1 | cut -c1-600
fi
if [ "${SKIP_MEMORY:-0}" != 1 ]; then
    OUT=$OUT PART=bf16_131k CONTEXTS=131072 CONFIGS=bf16 MINUTES=${MEMORY_MINUTES:-3} bash benchmarks/device/kaizen_memory.sh
fi
