"""Tuning sweep for the KVpop sparse attention forward and the transposed target pass (run on the device machine).

    KVLEARN_COMMIT=<commit> PYTHONPATH=src python benchmarks/kvpop_attention_sweep.py --out $OUT/kvpop_attention_sweep_h200.json

Same sizes and priorities as ``benchmarks/kvpop_ops.py`` (batch 1, T = 16384, 8 KV heads x 4 query heads, D = 128,
s = 4, w = 256, k = 2016 and 1792, bf16). Measures, in one run, dense causal SDPA forward (the reference of every
ratio), then one row per configuration:

* ``gathered_flex``: the gathered layout through FlexAttention, per query block size and flex ``kernel_options``;
* ``gathered_triton``: the fused Triton forward of :mod:`kvlearn.ops.gathered_triton` (when present), per tunables;
* ``target_flex``: the transposed target pass per ``kernel_options``.

Every configuration is checked against the first one of its family (relative error of the output or target) and
timed with ``triton.testing.do_bench`` (median, warm-up and compile excluded). A configuration that fails to
compile or run is recorded under ``checks`` and skipped; no new configuration starts after ``--budget-s`` seconds,
and rows are written as they come, so a cut-off run keeps what it measured. ``--smoke`` checks the script on the
CPU at tiny sizes (eager flex ignores kernel options there: it checks the plumbing, not speed).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from kvlearn.results import make_results, write_results
from kvlearn.ops.retention_attention import gathered_plan, gathered_tile_fraction, sparse_retention_attention
from kvlearn.ops.fenwick import running_topk_cutoff
from kvlearn.ops.future_target import future_attention_target
from kvlearn.ops.gathered_triton import gathered_attention_forward
from kvlearn.ops.triton_support import HAS_TRITON, interpreting
from kvpop_ops import priorities  # benchmarks/kvpop_ops.py: the same priority model (2 randn + 0.001 t)

TRITON_TUNABLES = [  # kvlearn.ops.gathered_triton.gathered_attention_forward launch choices ({} = its defaults)
    {},
    {"block_m": 128, "block_n": 64, "num_warps": 8, "num_stages": 3},
    {"block_m": 64, "block_n": 64, "num_warps": 4, "num_stages": 2},
    {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2},
    {"block_m": 64, "block_n": 32, "num_warps": 4, "num_stages": 3},
]

FLEX_OPTIONS = [  # None = flex's own choice first; then the usual Hopper forward tiles
    None,
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
    {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
    {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2},
    {"BLOCK_M": 128, "BLOCK_N": 32, "num_warps": 4, "num_stages": 4},
]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/kvpop_attention_sweep_h200.json")
    ap.add_argument("--budget-s", type=float, default=300.0, help="start no new configuration after this many seconds")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        print("this sweep needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    dev = torch.device("cpu" if smoke else "cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    B, H, G, T, D, s, w = (1, 2, 2, 256, 32, 4, 16) if smoke else (1, 8, 4, 16384, 128, 4, 256)
    topks = (24, 32) if smoke else (1792, 2016)  # k + w = T/8 first: the acceptance case
    block_sizes = (16, 32) if smoke else (128, 64)
    t_start = time.perf_counter()
    checks: dict = {}
    rows: list = []
    common = {"batch": B, "seq": T, "kv_heads": H, "q_heads": H * G, "head_dim": D, "sinks": s, "window": w}

    def bench(fn) -> float:
        if smoke:
            fn()
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))

    def save(partial=True):
        write_results(args.out, make_results("ops", rows, device="cuda" if not smoke else "cpu", checks=checks,
                                             partial=partial, smoke=smoke))

    def add(row):
        rows.append(row)
        print(f"{row['name']:<58} {row['ms']:>8.3f} ms  {row.get('over_dense', '')}", flush=True)
        save()

    def out_of_time() -> bool:
        return time.perf_counter() - t_start > args.budget_s

    def run(label, fn):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - a failed configuration must not stop the sweep
            checks[f"error_{label}"] = f"{type(exc).__name__}: {exc}"[:300]
            print(f"{label}: {checks[f'error_{label}']}", flush=True)
            return None

    torch.manual_seed(0)
    q = torch.randn(B, H * G, T, D, device=dev, dtype=dtype)
    k = torch.randn(B, H, T, D, device=dev, dtype=dtype)
    v = torch.randn(B, H, T, D, device=dev, dtype=dtype)
    with torch.no_grad():
        dense_ms = bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    add({"name": "attn_dense_sdpa_fwd", "ms": dense_ms, **common})

    def opt_name(opts) -> str:
        return "default" if not opts else "_".join(f"{key}{val}" for key, val in opts.items())

    lse_main = None
    for topk in topks:
        prio = priorities(B, H, T, True, dev)
        ranks, cutoffs = running_topk_cutoff(prio, s, w, topk)
        for bs in block_sizes:
            plan = gathered_plan(ranks, cutoffs, s, w, G, topk=topk, block_size=bs)
            base = {**common, "topk": topk, "query_block": bs, "capacity": plan.layout.capacity,
                    "tiles_computed_fraction": gathered_tile_fraction(plan)}
            ref = None
            for opts in FLEX_OPTIONS:
                if out_of_time():
                    break
                label = f"gathered_flex_k{topk}_bs{bs}_{opt_name(opts)}"

                def one(opts=opts, plan=plan, label=label):
                    nonlocal ref, lse_main
                    with torch.no_grad():
                        out, lse = sparse_retention_attention(q, k, v, ranks, cutoffs, s, w, plan=plan, kernel_options=opts,
                                                              backend="flex")
                        ms = bench(lambda: sparse_retention_attention(q, k, v, ranks, cutoffs, s, w, plan=plan,
                                                                      kernel_options=opts, backend="flex"))
                    if ref is None:
                        ref = out.float()
                    if lse_main is None:
                        lse_main = lse
                    checks[f"{label}_rel_err"] = ((out.float() - ref).norm() / ref.norm()).item()
                    add({"name": label, "ms": ms, "over_dense": ms / dense_ms, "kernel_options": opts or {}, **base})

                run(label, one)
            if HAS_TRITON and (not smoke or interpreting()):
                for tun in TRITON_TUNABLES:
                    if out_of_time():
                        break
                    label = f"gathered_triton_k{topk}_bs{bs}_{opt_name(tun)}"

                    def one_triton(tun=tun, plan=plan, label=label):
                        with torch.no_grad():
                            out, _ = gathered_attention_forward(q, k, v, plan.layout, D ** -0.5, **tun)
                            ms = bench(lambda: gathered_attention_forward(q, k, v, plan.layout, D ** -0.5, **tun))
                        if ref is not None:
                            checks[f"{label}_rel_err"] = ((out.float() - ref).norm() / ref.norm()).item()
                        add({"name": label, "ms": ms, "over_dense": ms / dense_ms, "tunables": tun, **base})

                    run(label, one_triton)

    target_ref = None
    for opts in FLEX_OPTIONS[:4]:
        if out_of_time() or lse_main is None:
            break
        label = f"target_flex_{opt_name(opts)}"

        def one_target(opts=opts, label=label):
            nonlocal target_ref
            r = future_attention_target(q, k, lse_main, w, kernel_options=opts, backend="flex")
            ms = bench(lambda: future_attention_target(q, k, lse_main, w, kernel_options=opts, backend="flex"))
            if target_ref is None:
                target_ref = r
            checks[f"{label}_max_abs_err"] = (r - target_ref).abs().max().item()
            add({"name": label, "ms": ms, "kernel_options": opts or {}, **common})

        run(label, one_target)

    checks["seconds"] = time.perf_counter() - t_start
    save(partial=False)
    print("done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
