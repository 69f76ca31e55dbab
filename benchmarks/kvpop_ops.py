"""GPU benchmark of the KVpop primitives at the paper's training sizes (run on the device machine).

    PYTHONPATH=src python benchmarks/kvpop_ops.py --out results/kvpop_ops_h200.json

Sizes: batch 1, T = 16384, 8 KV heads x 4 query heads, head dim 128, s = 4, w = 256, k = 2016, bf16 attention.
Every timing is the median of ``triton.testing.do_bench`` (CUDA events, warm-up excluded). Correctness is checked in
the same run: the Triton cutoff must equal the torch reference bit for bit, and the sparse attention output must
match a dense masked SDPA on the same mask.

Priorities: the learned static priority of Eq. 20 is ``raw - t log(gamma)``; rows use raw ~ N(0, 2^2) with the
paper's strongest decay gamma = 0.999 (``decayed``, the realistic case: retention is recency-biased with
content outliers) and, as a worst case for block sparsity, raw scores with no decay (``nodecay``: the retained
set is scattered uniformly over the history).

The KVpop additions (issue #10 item 8: mLSTM scorer forward + backward, the running cutoff and the future-attention
target, against dense attention's forward + backward) are summed twice: with ``target_pass``, the paper's mass target
(``kvpop_additions_over_dense_fwd_bwd``, the figure of the earlier runs), and with the target the retrofit trains
with, ``KVpopConfig().target_reduction`` (``"peak"``: a running maximum, no exponentials; its row
``target_pass_peak``, the sum ``kvpop_additions_over_dense_fwd_bwd_trained_target``). The acceptance records both
against the issue's 0.45.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F

from kvlearn.config import KVpopConfig
from kvlearn.results import make_results, write_results
from kvlearn.ops.retention_attention import block_sparsity, gathered_plan, gathered_tile_fraction, sparse_retention_attention
from kvlearn.kvpop.scorers import LinearScorer, MLPScorer, MLSTMScorer
from kvlearn.ops.fenwick import running_cutoff, running_topk_cutoff, static_ranks
from kvlearn.ops.future_target import future_attention_target
from kvlearn.ops.future_target_triton import default_config
from kvlearn.ops.triton_support import HAS_TRITON, kernel_supports
from kvlearn.ops.gathered import gathered_layout
from kvlearn.ops.masks import retention_block_mask


SMOKE = False  # --smoke: tiny sizes on the CPU, to check the script itself before spending device time
# the future-attention target the retrofit trains with (its row: target_pass for "mass", else target_pass_<reduction>)
TRAINED_REDUCTION = KVpopConfig().target_reduction
TRAINED_TARGET_ROW = "target_pass" if TRAINED_REDUCTION == "mass" else f"target_pass_{TRAINED_REDUCTION}"


def bench(fn, warmup=10, rep=50) -> float:
    if SMOKE:
        import time

        fn()
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))


def graphed_bench(fn) -> float | None:
    """``fn`` (a forward and backward) timed as a CUDA-graph replay: three eager calls on a side stream, one capture,
    then :func:`bench` of the replay. This is the GPU time of ``fn`` without its host launches, as the retrofit runs it
    with ``--cuda-graph-step`` (:class:`kvlearn.train.cuda_graph.CudaGraphStep`). None in --smoke (no CUDA graphs on
    the CPU)."""
    if SMOKE:
        return None
    from kvlearn.train.cuda_graph import CudaGraphStep

    step = CudaGraphStep(fn, torch.device("cuda"))
    for _ in range(step.eager_steps + 1):  # the eager calls, then the capture and a first replay
        step()
    torch.cuda.synchronize()
    ms = bench(step)
    del step  # the graph's private memory pool goes with it
    return ms


class _Rows(list):
    """Result rows, printed and saved (partial results file) as they are measured."""

    def __init__(self, out, checks):
        super().__init__()
        self.out, self.checks = out, checks

    def append(self, row):
        super().append(row)
        print(f"{row['name']:<34} {row['ms']:>9.3f}  {row.get('block_sparsity', '')}", flush=True)
        write_results(self.out, make_results("ops", list(self), device="cuda" if torch.cuda.is_available() else "cpu",
                                             checks=self.checks, partial=True))


def priorities(b, h, t, decay: bool, device) -> torch.Tensor:
    raw = 2.0 * torch.randn(b, h, t, device=device)
    if decay:
        raw = raw - torch.arange(t, device=device, dtype=torch.float32) * math.log(0.999)
    return raw.float().contiguous()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="results/kvpop_ops_h200.json")
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--topk", type=int, default=2016)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU (checks the script, times nothing)")
    ap.add_argument("--quick", action="store_true",
                    help="acceptance rows only (no host Fenwick reference, block-mask rows, no-decay rows or mLSTM eager/chunk "
                         "variants; the mLSTM matmul_dtype rows are included)")
    args = ap.parse_args()
    global SMOKE
    SMOKE = args.smoke
    if SMOKE:
        args.seq, args.kv_heads, args.group, args.head_dim, args.window, args.topk = 512, 2, 2, 32, 32, 64
    elif not torch.cuda.is_available():
        print("this benchmark needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cpu" if SMOKE else "cuda")
    tri = "torch" if SMOKE else "triton"
    dtype = torch.float32 if SMOKE else torch.bfloat16
    torch.manual_seed(0)
    B, H, G, T, D = 1, args.kv_heads, args.group, args.seq, args.head_dim
    triton_ok = HAS_TRITON and dev.type == "cuda" and kernel_supports(dtype, D)  # the "auto" backends' rule
    s, w, k = args.sinks, args.window, args.topk
    checks = {}
    rows = _Rows(args.out, checks)

    def guarded(label, fn):
        """Run one benchmark section; a failure is recorded in ``checks`` and the remaining sections still run."""
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - a benchmark must keep measuring the other rows
            import traceback

            traceback.print_exc()
            checks[f"error_{label}"] = f"{type(exc).__name__}: {exc}"[:400]
            return None
    common = {"batch": B, "seq": T, "kv_heads": H, "q_heads": H * G, "head_dim": D, "sinks": s, "window": w, "topk": k}

    # ---- running top-k cutoff ----
    # The torch Fenwick reference is a Python loop over T with ~190 small tensor ops per step; on the CPU a step
    # costs microseconds, on the GPU a kernel launch each (~30 s per call at T = 16384), so it runs on the CPU,
    # once, timed with a wall clock; the Triton kernel is checked against it bit for bit at the full size.
    import time

    prio = priorities(B, H, T, True, dev)
    ranks_tri, cut_tri = running_topk_cutoff(prio, s, w, k, backend=tri)
    if not args.quick:
        t0 = time.perf_counter()
        ranks_ref, cut_ref = running_topk_cutoff(prio.cpu(), s, w, k, backend="torch")
        ref_ms = (time.perf_counter() - t0) * 1e3
        checks["cutoff_triton_equals_reference"] = bool(torch.equal(cut_ref, cut_tri.cpu()) and torch.equal(ranks_ref, ranks_tri.cpu()))
    for trial in range(3):  # fresh draws at a smaller size, ties included
        n = min(T, 2048)
        p = priorities(B, H, n, trial % 2 == 0, dev)
        if trial == 2:
            p = torch.randint(0, 50, (B, H, n), device=dev).float()
        r = static_ranks(p)
        checks[f"cutoff_equal_draw{trial}"] = bool(torch.equal(running_cutoff(r.cpu(), s, w, min(k, n // 4), backend="torch"),
                                                               running_cutoff(r, s, w, min(k, n // 4), backend=tri).cpu()))
    ranks = ranks_tri
    rows.append({"name": "cutoff_triton", "ms": bench(lambda: running_topk_cutoff(prio, s, w, k, backend=tri)), "includes": "static_ranks (torch.sort) + cutoff", **common})
    rows.append({"name": "cutoff_triton_only", "ms": bench(lambda: running_cutoff(ranks, s, w, k, backend=tri)), "includes": "cutoff from precomputed ranks", **common})
    if not args.quick:
        rows.append({"name": "cutoff_reference", "ms": ref_ms, "includes": "torch Fenwick reference on the host CPU, one run, wall clock", **common})

    # ---- attention: sparse (flex: gathered layout, default; [T, T] block mask) vs dense causal SDPA ----
    q = torch.randn(B, H * G, T, D, device=dev, dtype=dtype, requires_grad=True)
    kk = torch.randn(B, H, T, D, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(B, H, T, D, device=dev, dtype=dtype, requires_grad=True)
    grad = torch.randn(B, H * G, T, D, device=dev, dtype=dtype)

    def dense_fwd_bwd():
        out = F.scaled_dot_product_attention(q, kk, v, is_causal=True, enable_gqa=True)
        out.backward(grad)

    def dense_fwd():
        with torch.no_grad():
            F.scaled_dot_product_attention(q, kk, v, is_causal=True, enable_gqa=True)

    dense_ms = bench(dense_fwd_bwd)
    rows.append({"name": "attn_dense_sdpa_fwd_bwd", "ms": dense_ms, **common})
    dense_fwd_ms = bench(dense_fwd)
    rows.append({"name": "attn_dense_sdpa_fwd", "ms": dense_fwd_ms, **common})

    def dense_graphed_row():  # the reference of the graphed additions below, replayed the same way
        ms_g = graphed_bench(dense_fwd_bwd)
        if ms_g is not None:
            rows.append({"name": "attn_dense_sdpa_fwd_bwd_graphed", "ms": ms_g, "includes": "CUDA-graph replay", **common})

    guarded("dense_graphed", dense_graphed_row)

    sparse_ms, lse_of = {}, {}

    def measure_sparse(label, decay, topk):
        p = priorities(B, H, T, decay, dev)
        r, c = running_topk_cutoff(p, s, w, topk)

        def sparse_fwd_bwd(**kw):
            out, _ = sparse_retention_attention(q, kk, v, r, c, s, w, **kw)
            out.backward(grad)

        def sparse_fwd(**kw):
            with torch.no_grad():
                return sparse_retention_attention(q.detach(), kk.detach(), v.detach(), r, c, s, w, **kw)

        base = {**common, "topk": topk, "priorities": "decayed (gamma=0.999)" if decay else "no decay",
                "k_plus_w_over_T": (topk + w) / T}

        def blockmask_rows():  # the [T, T] retention block mask (the first design)
            bm = retention_block_mask(r, c, s, w, G)
            blockmask = {**base, "layout": "blockmask", "block_sparsity": block_sparsity(bm),
                         "tiles_computed_fraction": 1.0 - block_sparsity(bm), "includes": "prebuilt block mask (see block_mask_build)"}
            bm_fb = bench(lambda: sparse_fwd_bwd(layout="blockmask", block_mask=bm))
            bm_f = bench(lambda: sparse_fwd(layout="blockmask", block_mask=bm))
            rows.append({"name": f"attn_sparse_blockmask_fwd_bwd{label}", "ms": bm_fb, "over_dense": bm_fb / dense_ms, **blockmask})
            rows.append({"name": f"attn_sparse_blockmask_fwd{label}", "ms": bm_f, "over_dense": bm_f / dense_fwd_ms, **blockmask})
            rows.append({"name": f"block_mask_build{label}", "ms": bench(lambda: retention_block_mask(r, c, s, w, G)), **blockmask})
            lse_of[label + "_blockmask"] = sparse_fwd(layout="blockmask", block_mask=bm)[1]

        def gathered_rows():  # the interval-gathered layout (the default)
            # forward rows run the default backend: the fused Triton forward (no grad, CUDA); flex rows for comparison
            plan = gathered_plan(r, c, s, w, G, topk=topk)
            # block_sparsity: fraction of the T x T grid's tiles the kernel skips (gathered: 1 - computed / nQ^2)
            tiles = gathered_tile_fraction(plan)
            gathered = {**base, "layout": "gathered", "block_sparsity": 1.0 - tiles, "tiles_computed_fraction": tiles,
                        "capacity": plan.layout.capacity, "includes": "prebuilt layout (see layout_build)"}
            checks[f"gathered_layout_within_capacity{label}"] = bool((plan.layout.num_used <= plan.layout.capacity).all())
            sparse_ms[label] = bench(lambda: sparse_fwd_bwd(plan=plan))
            rows.append({"name": f"attn_sparse_fwd_bwd{label}", "ms": sparse_ms[label], "over_dense": sparse_ms[label] / dense_ms,
                         **gathered, "backend": "flex (training: the Triton kernel is forward-only)"})
            fwd_backend = "triton" if triton_ok else "flex"  # what backend="auto" takes without grad
            fwd_ms = bench(lambda: sparse_fwd(plan=plan))
            rows.append({"name": f"attn_sparse_fwd{label}", "ms": fwd_ms, "over_dense": fwd_ms / dense_fwd_ms, **gathered,
                         "backend": fwd_backend})
            flex_ms = bench(lambda: sparse_fwd(plan=plan, backend="flex"))
            rows.append({"name": f"attn_sparse_fwd_flex{label}", "ms": flex_ms, "over_dense": flex_ms / dense_fwd_ms, **gathered,
                         "backend": "flex"})
            layout_ms = bench(lambda: gathered_layout(r, c, s, w, topk=topk))
            rows.append({"name": f"layout_build{label}", "ms": layout_ms,
                         **{**gathered, "includes": "eviction positions + gathered layout (what the Triton forward needs)"}})
            plan_ms = bench(lambda: gathered_plan(r, c, s, w, G, topk=topk))
            rows.append({"name": f"plan_build{label}", "ms": plan_ms,
                         **{**gathered, "includes": "eviction positions + gathered layout + BlockMask + gather index (flex)"}})
            with_build = bench(lambda: sparse_fwd(topk=topk))
            rows.append({"name": f"attn_sparse_fwd_with_layout_build{label}", "ms": with_build, "over_dense": with_build / dense_fwd_ms,
                         **{**gathered, "includes": "layout built inside the call", "backend": fwd_backend}})
            out_t, lse_t = sparse_fwd(plan=plan)
            out_f, lse_f = sparse_fwd(plan=plan, backend="flex")
            checks[f"sparse_fwd{label}_triton_vs_flex_rel_err"] = ((out_t.float() - out_f.float()).norm() / out_f.float().norm()).item()
            checks[f"sparse_fwd{label}_triton_vs_flex_lse_max_abs_err"] = (lse_t - lse_f).abs().max().item()
            lse_of[label] = lse_t

        guarded(f"gathered{label}", gathered_rows)
        if not args.quick:
            guarded(f"blockmask{label}", blockmask_rows)
        return p

    # the rows the acceptance needs come first (the call may be cut off): main sparse variant, target, scorers
    p = measure_sparse("", True, k)
    from kvlearn.ops.masks import retention_mask_dense

    def correctness():  # flex output vs dense masked SDPA on the same mask (bf16 tolerance)
        with torch.no_grad():
            n = min(T, 4096)  # on a prefix (the mask of a prefix is the prefix of the mask)
            rr, cc = running_topk_cutoff(p[..., :n].contiguous(), s, w, k)
            qn, kn, vn = q[:, :, :n].detach(), kk[:, :, :n].detach(), v[:, :, :n].detach()
            m = retention_mask_dense(rr, cc, s, w).repeat_interleave(G, dim=1)
            out_d = F.scaled_dot_product_attention(qn.float(), kn.float().repeat_interleave(G, 1),
                                                   vn.float().repeat_interleave(G, 1), attn_mask=m)
            for name, kw in (("", dict(topk=k)), ("_blockmask", dict(layout="blockmask")))[: 1 if args.quick else 2]:
                out_s, _ = sparse_retention_attention(qn, kn, vn, rr, cc, s, w, **kw)
                checks[f"sparse{name}_attention_rel_err_vs_dense_masked"] = ((out_s.float() - out_d).norm() / out_d.norm()).item()

    guarded("correctness", correctness)

    # ---- transposed future-attention target pass (sparse LSE from the student pass) ----
    qd, kd = q.detach(), kk.detach()
    sparse_lse = lse_of[""] if "" in lse_of else lse_of["_blockmask"]  # the same LSE from either layout
    target_backend = "triton" if triton_ok else ("flex" if dev.type == "cuda" else "torch")  # what "auto" takes

    def target_rows():
        got = future_attention_target(qd, kd, sparse_lse, w)
        rows.append({"name": "target_pass", "ms": bench(lambda: future_attention_target(qd, kd, sparse_lse, w)),
                     "lse": "sparse (student pass)", "backend": target_backend,
                     "launch": default_config(dtype, False) if triton_ok else None, **common})
        # the reduction the retrofit trains with (KVpopConfig.target_reduction; "peak" since Table 1's recipe): no
        # exp, one max per (key, future query) pair, so it is what a retrofit step's additions actually pay
        if TRAINED_REDUCTION != "mass":
            peak = future_attention_target(qd, kd, sparse_lse, w, reduction=TRAINED_REDUCTION)
            checks[f"target_{TRAINED_REDUCTION}_finite"] = int(torch.isfinite(peak).sum().item())
            rows.append({"name": f"target_pass_{TRAINED_REDUCTION}", "ms": bench(
                lambda: future_attention_target(qd, kd, sparse_lse, w, reduction=TRAINED_REDUCTION)),
                "lse": "sparse (student pass)", "reduction": TRAINED_REDUCTION, "backend": target_backend,
                "launch": default_config(dtype, False) if triton_ok else None, **common})
        if not SMOKE:
            flex = future_attention_target(qd, kd, sparse_lse, w, backend="flex")
            checks["target_triton_vs_flex_max_abs_err"] = (got - flex).abs().max().item()
            rows.append({"name": "target_pass_flex", "ms": bench(lambda: future_attention_target(qd, kd, sparse_lse, w, backend="flex")),
                         "lse": "sparse (student pass)", "backend": "flex", **common})

    guarded("target", target_rows)

    def ms_of(name):  # a row measured earlier in this run (nan if it failed)
        return next((r["ms"] for r in rows if r["name"] == name), float("nan"))

    # ---- scorers forward + backward on detached [k; v] ----
    kd32, vd = kk.detach(), v.detach()
    scorer_ms = {}
    for name, scorer in (("linear", LinearScorer(H, D)), ("mlp", MLPScorer(H, D)), ("mlstm", MLSTMScorer(H, D, window=w))):
        scorer = scorer.to(dev)
        for prm in scorer.parameters():  # non-trivial parameters (zero-initialised heads give constant scores)
            if prm.abs().sum() == 0:
                torch.nn.init.normal_(prm, std=0.02)

        def fwd_bwd(scorer=scorer):
            scores = scorer(kd32, vd)
            scores.square().mean().backward()

        def scorer_row(name=name, scorer=scorer, fwd_bwd=fwd_bwd):
            t0 = time.perf_counter()
            fwd_bwd()  # first call outside the timing: torch.compile (mLSTM on CUDA) compiles here
            first_s = time.perf_counter() - t0
            scorer_ms[name] = bench(fwd_bwd)
            rows.append({"name": f"scorer_{name}_fwd_bwd", "ms": scorer_ms[name], "parameters_per_head": scorer.num_parameters_per_head(),
                         "first_call_s": first_s, **({"chunk_size": scorer.chunk_size, "compile": scorer.compile} if name == "mlstm" else {}), **common})
            ms_g = graphed_bench(fwd_bwd) if name == "mlstm" else None
            if ms_g is not None:  # the same fwd+bwd as one CUDA-graph replay: its GPU time without the host launches
                rows.append({"name": "scorer_mlstm_fwd_bwd_graphed", "ms": ms_g, "includes": "CUDA-graph replay",
                             "chunk_size": scorer.chunk_size, "compile": scorer.compile, **common})

        guarded(f"scorer_{name}", scorer_row)

    # ---- mLSTM matmul precision (issue #10 item 8): the default scorer with each matmul_dtype, fwd+bwd, as a ratio
    # to dense attention fwd+bwd of this run; the KVpop additions (scorer + cutoff + target) likewise; the max abs
    # error of the scores and of the parameter gradients against float32 (same parameters, same inputs) ----
    from kvlearn.ops.mlstm import MATMUL_DTYPES

    precision_ref = {}
    for mdt in MATMUL_DTYPES:
        def precision_row(mdt=mdt):
            torch.manual_seed(2)  # same parameters in every variant
            scorer = MLSTMScorer(H, D, window=w, matmul_dtype=mdt).to(dev)
            for prm in scorer.parameters():
                if prm.abs().sum() == 0:
                    torch.nn.init.normal_(prm, std=0.02)

            def fwd_bwd():
                scorer(kd32, vd).square().mean().backward()

            t0 = time.perf_counter()
            scorer.zero_grad(set_to_none=True)
            out = scorer(kd32, vd)
            out.square().mean().backward()  # compiles (CUDA) outside the timing
            first_s = time.perf_counter() - t0
            grads = [p.grad.detach().clone() for p in scorer.parameters()]
            out = out.detach()
            if mdt == "float32":
                precision_ref.update(scores=out, grads=grads)
            ref_out, ref_grads = precision_ref.get("scores"), precision_ref.get("grads")
            ms_m = bench(fwd_bwd)
            adds = ms_m + ms_of("cutoff_triton") + ms_of("target_pass")
            adds_trained = ms_m + ms_of("cutoff_triton") + ms_of(TRAINED_TARGET_ROW)
            ms_g = graphed_bench(fwd_bwd)  # GPU time (replayed), over the replayed dense fwd+bwd
            dense_g = ms_of("attn_dense_sdpa_fwd_bwd_graphed")
            graphed = {} if ms_g is None else {
                "ms_graphed": ms_g,
                "kvpop_additions_trained_target_graphed_over_dense_fwd_bwd_graphed": (
                    ms_g + ms_of("cutoff_triton") + ms_of(TRAINED_TARGET_ROW)) / dense_g}
            rows.append({
                "name": f"scorer_mlstm_fwd_bwd_{mdt}", "ms": ms_m, "matmul_dtype": mdt, "first_call_s": first_s,
                "over_dense_fwd_bwd": ms_m / dense_ms,
                "kvpop_additions_ms": adds, "kvpop_additions_over_dense_fwd_bwd": adds / dense_ms,
                "kvpop_additions_trained_target_over_dense_fwd_bwd": adds_trained / dense_ms, **graphed,
                "scores_max_abs_err_vs_float32": None if ref_out is None else (out - ref_out).abs().max().item(),
                "scores_max_abs_float32": None if ref_out is None else ref_out.abs().max().item(),
                "grads_max_abs_err_vs_float32": None if ref_grads is None else max(
                    (a - b).abs().max().item() for a, b in zip(grads, ref_grads)),
                "grads_max_rel_err_vs_float32": None if ref_grads is None else max(
                    ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for a, b in zip(grads, ref_grads)),
                "chunk_size": scorer.chunk_size, "compile": scorer.compile,
                "includes": "scorer fwd+bwd; kvpop_additions_* add cutoff_triton + target_pass of this run "
                            f"(_trained_target: + {TRAINED_TARGET_ROW})", **common})

        guarded(f"scorer_mlstm_{mdt}", precision_row)

    # ---- acceptance rows: k + w = T/8 exactly, and the finite-lookahead target (appendix B.2) ----
    guarded("sparse_k1792", lambda: measure_sparse("_k1792", True, 1792 if not SMOKE else 32))
    look = min(2048, T // 8)
    def lookahead_row():
        rows.append({"name": f"target_pass_lookahead{look}", "ms": bench(lambda: future_attention_target(qd, kd, sparse_lse, w, lookahead=look)),
                     "lse": "sparse (student pass)", "includes": f"finite lookahead L={look} (appendix B.2)", "backend": target_backend,
                     "launch": default_config(dtype, True) if triton_ok else None, **common})

    guarded("target_lookahead", lookahead_row)

    # mLSTM variants (the row above is the scorer with its default arguments): eager vs torch.compile, chunk size.
    # The compiled path only runs on CUDA, so the compiled rows are skipped in --smoke (CPU).
    ref_scores = None
    for compiled in (False, True) if not args.quick else ():
        if compiled and SMOKE:
            print("scorer_mlstm_fwd_bwd_compiled_*: skipped (--smoke runs on the CPU, where the scorer is eager)")
            continue
        for chunk in (32, 64, 128):
            torch.manual_seed(1)  # same parameters in every variant
            scorer = MLSTMScorer(H, D, window=w, chunk_size=chunk, compile=compiled).to(dev)
            for prm in scorer.parameters():
                if prm.abs().sum() == 0:
                    torch.nn.init.normal_(prm, std=0.02)

            def fwd_bwd(scorer=scorer):
                scorer(kd32, vd).square().mean().backward()

            def variant_row(scorer=scorer, fwd_bwd=fwd_bwd, compiled=compiled, chunk=chunk):
                nonlocal ref_scores
                t0 = time.perf_counter()
                out = scorer(kd32, vd)  # compiles (compiled rows): do_bench then times compiled code only
                out.square().mean().backward()
                first_s = time.perf_counter() - t0
                out = out.detach()
                if ref_scores is None:
                    ref_scores = out
                label = f"{'compiled' if compiled else 'eager'}_chunk{chunk}"
                checks[f"scorer_mlstm_{label}_rel_err_vs_eager_chunk32"] = ((out - ref_scores).norm() / ref_scores.norm()).item()
                rows.append({"name": f"scorer_mlstm_fwd_bwd_{label}", "ms": bench(fwd_bwd), "chunk_size": chunk, "compile": compiled,
                             "first_call_s": first_s, **common})

            guarded(f"scorer_mlstm_{'compiled' if compiled else 'eager'}_chunk{chunk}", variant_row)
            del scorer

    # ---- secondary rows: worst-case sparsity (no decay: retained keys scattered uniformly) ----
    if not args.quick:
        guarded("sparse_nodecay", lambda: measure_sparse("_nodecay", False, k))

    ms = {r["name"]: r["ms"] for r in rows}
    look_name = f"target_pass_lookahead{look}"

    def ratio(a, b):
        return ms[a] / ms[b] if a in ms and b in ms else None

    mlstm_ms = ms.get("scorer_mlstm_fwd_bwd")
    additions = None if mlstm_ms is None or "target_pass" not in ms else mlstm_ms + ms["cutoff_triton"] + ms["target_pass"]
    additions_look = None if mlstm_ms is None or look_name not in ms else mlstm_ms + ms["cutoff_triton"] + ms[look_name]
    additions_trained = (None if mlstm_ms is None or TRAINED_TARGET_ROW not in ms
                         else mlstm_ms + ms["cutoff_triton"] + ms[TRAINED_TARGET_ROW])
    dense_ms = ms["attn_dense_sdpa_fwd_bwd"]
    # the same sum with the scorer replayed as a CUDA graph (its GPU time, as --cuda-graph-step runs it), over the
    # replayed dense fwd+bwd: the eager scorer row is bound by the host's launches and moves with the host
    mlstm_g = ms.get("scorer_mlstm_fwd_bwd_graphed")
    dense_g = ms.get("attn_dense_sdpa_fwd_bwd_graphed")
    additions_trained_g = (None if mlstm_g is None or dense_g is None or TRAINED_TARGET_ROW not in ms
                           else mlstm_g + ms["cutoff_triton"] + ms[TRAINED_TARGET_ROW])
    summary = {
        "kvpop_additions_ms": additions,
        "kvpop_additions_over_dense_fwd_bwd": None if additions is None else additions / dense_ms,
        # the same with the target the retrofit trains with (target_reduction, TRAINED_TARGET_ROW)
        "trained_target_reduction": TRAINED_REDUCTION,
        "kvpop_additions_trained_target_ms": additions_trained,
        "kvpop_additions_over_dense_fwd_bwd_trained_target": (
            None if additions_trained is None else additions_trained / dense_ms),
        "kvpop_additions_trained_target_graphed_ms": additions_trained_g,
        "kvpop_additions_over_dense_fwd_bwd_trained_target_graphed": (
            None if additions_trained_g is None else additions_trained_g / dense_g),
        "scorer_mlstm_graphed_over_eager": ratio("scorer_mlstm_fwd_bwd_graphed", "scorer_mlstm_fwd_bwd"),
        "kvpop_additions_with_lookahead_ms": additions_look,
        "kvpop_additions_over_dense_fwd_bwd_with_lookahead": None if additions_look is None else additions_look / dense_ms,
        "sparse_fwd_over_dense_fwd": ratio("attn_sparse_fwd", "attn_dense_sdpa_fwd"),
        "sparse_k1792_fwd_over_dense_fwd": ratio("attn_sparse_fwd_k1792", "attn_dense_sdpa_fwd"),
        "sparse_fwd_with_layout_build_over_dense_fwd": ratio("attn_sparse_fwd_with_layout_build", "attn_dense_sdpa_fwd"),
        "sparse_k1792_fwd_with_layout_build_over_dense_fwd": ratio("attn_sparse_fwd_with_layout_build_k1792", "attn_dense_sdpa_fwd"),
        "sparse_k1792_fwd_flex_over_dense_fwd": ratio("attn_sparse_fwd_flex_k1792", "attn_dense_sdpa_fwd"),
        "sparse_over_dense_fwd_bwd": ratio("attn_sparse_fwd_bwd", "attn_dense_sdpa_fwd_bwd"),
        "sparse_k1792_over_dense_fwd_bwd": ratio("attn_sparse_fwd_bwd_k1792", "attn_dense_sdpa_fwd_bwd"),
        # training builds the flex plan once per layer and step: its cost belongs to fwd+bwd
        "sparse_k1792_with_plan_build_over_dense_fwd_bwd": (
            None if "plan_build_k1792" not in ms or "attn_sparse_fwd_bwd_k1792" not in ms
            else (ms["attn_sparse_fwd_bwd_k1792"] + ms["plan_build_k1792"]) / ms["attn_dense_sdpa_fwd_bwd"]),
        "blockmask_fwd_over_dense_fwd": ratio("attn_sparse_blockmask_fwd", "attn_dense_sdpa_fwd"),
        # per mLSTM matmul_dtype: (scorer fwd+bwd, KVpop additions) over dense attention fwd+bwd, and the errors
        "mlstm_matmul_dtype": {
            r["matmul_dtype"]: {key: r[key] for key in ("over_dense_fwd_bwd", "kvpop_additions_over_dense_fwd_bwd",
                                                         "kvpop_additions_trained_target_over_dense_fwd_bwd",
                                                         "kvpop_additions_trained_target_graphed_over_dense_fwd_bwd_graphed",
                                                         "scores_max_abs_err_vs_float32", "grads_max_abs_err_vs_float32") if key in r}
            for r in rows if "matmul_dtype" in r},
    }
    # the acceptance of the KVpop-primitives issue, as measured in this run (None: a row is missing)
    summary["acceptance"] = {
        "cutoff_triton_le_1ms": ms.get("cutoff_triton", float("inf")) <= 1.0,
        # the forward as a caller runs it: the layout is built inside the call
        "sparse_fwd_no_slower_than_dense_at_k_plus_w_le_T_over_8": (
            None if summary["sparse_k1792_fwd_with_layout_build_over_dense_fwd"] is None
            else summary["sparse_k1792_fwd_with_layout_build_over_dense_fwd"] <= 1.0),
        "kvpop_additions_le_half_dense_fwd_bwd": (
            None if summary["kvpop_additions_over_dense_fwd_bwd"] is None else summary["kvpop_additions_over_dense_fwd_bwd"] <= 0.5),
        "kvpop_additions_with_lookahead_le_half_dense_fwd_bwd": (
            None if additions_look is None else additions_look / dense_ms <= 0.5),
        # issue #10 item 8: under 0.45 (the paper's mass target, and the target the retrofit trains with)
        "kvpop_additions_lt_0p45_dense_fwd_bwd": None if additions is None else additions / dense_ms < 0.45,
        "kvpop_additions_trained_target_lt_0p45_dense_fwd_bwd": (
            None if additions_trained is None else additions_trained / dense_ms < 0.45),
        "kvpop_additions_trained_target_graphed_lt_0p45_dense_fwd_bwd_graphed": (
            None if additions_trained_g is None else additions_trained_g / dense_g < 0.45),
    }
    results = make_results("ops", rows, device=str(dev), checks=checks, summary=summary, quick=args.quick,
                           torch=torch.__version__)
    write_results(args.out, results)
    print(f"{'name':<34} {'ms':>9}  extra")
    for r in rows:
        extra = f"sparsity={r['block_sparsity']:.3f}" if "block_sparsity" in r else ""
        print(f"{r['name']:<34} {r['ms']:>9.3f}  {extra}")
    print(json.dumps({"checks": checks, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
