"""Decode attention over a packed KV store against the bf16 cache, one layer of a Qwen2.5-14B shape, on the GPU.

    PYTHONPATH=src python benchmarks/packed_decode_speed.py --out results/packed_decode_h200.json

For each context ``C`` and bit-width, one decode step's attention (batch 1, 40 query heads over 8 KV heads of 128,
every slot visible) three ways, timed with CUDA events (median of ``--iters`` after warm-up), in one process:

- ``bf16``: ``scaled_dot_product_attention`` over bf16 K/V ``[1, 8, C, 128]`` (the plain store's read is a view);
- ``read_then_attend``: what the cache does today, ``PackedStore.read()`` (unpack and dequantize every slot into
  a full-size bf16 temporary) then the same SDPA;
- ``fused``: :func:`kvlearn.ops.packed_decode.packed_decode_attention` (codes unpacked in registers, no temporary),
  at its default tile of 64 slots, and ``fused_block_c_128`` at 128 (the choice of the default); ``fused_planes``
  the bit-plane kernel it replaced (``variant="planes"``, default launch), in the same run, with its ratio to
  ``bf16`` and its largest difference from ``fused``.

``--store kivi`` measures the KIVI store the same way (``KIVIStore`` with key groups of 32 tokens and a 128-token
bf16 window; ``fused`` is :func:`kvlearn.ops.kivi_decode.kivi_decode_attention` at its default launch, the split
kernel, and ``fused_rebuild`` its first kernel, ``key_path="rebuild"`` at a tile of 64 slots, what ``fused`` was
before: both in the same run, with their ratios to ``bf16``; ``--graph --sweep`` then times the variants of
:data:`KIVI_SWEEP` (:func:`kivi_launch_sweep`), old and new side by side).

Rows: ``ms`` per variant and the ratios ``fused / bf16`` and ``read_then_attend / bf16`` measured in the same run,
``--graph`` adds ``ms_graph``: each variant replayed from a CUDA graph, so the kernels are timed without the host's
Python and launch overhead (what a compiled / graph-captured decode loop pays), and ``fused_over_bf16_graph``;
``--graph --sweep`` adds the fused kernel's graph-replayed time over its launch grid (:func:`launch_sweep`), to
choose :func:`kvlearn.ops.packed_decode.default_split` by measurement, and the variants of :data:`PACKED_SWEEP`
(kernel variant x launch: ``variant_sweep*`` keys, :func:`variant_launch_sweep`), old and new kernel side by side;
plus the largest difference of ``fused`` from ``read_then_attend`` (same codes: only float rounding, chiefly the
bf16 probabilities of the value product, as in flash attention). KV-Kaizen's
acceptance asks ``fused / bf16 <= 1`` at 131k (issue #11 item 9). ``--smoke`` runs tiny shapes on the CPU through
the torch backend (checks the plumbing, times nothing meaningful).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from kvlearn.cache import KIVIStore, PackedStore
from kvlearn.ops.kivi_decode import kivi_decode_attention
from kvlearn.ops.packed_decode import default_split, packed_decode_attention
from kvlearn.results import make_results, write_results

KIVI_GROUP, KIVI_RESIDUAL = 32, 128  # --store kivi: KIVI's key group and full-precision window (kaizen_memory's)

# --store kivi --graph --sweep: (key_path, block_c, num_warps, num_stages, split as a multiple of the default split);
# the first two are the first kernel (at the API's tile and at the one the benchmark timed), the third the default
KIVI_SWEEP = (
    ("rebuild", 32, 4, 2, 1), ("rebuild", 64, 4, 2, 1),
    ("broadcast", 32, 4, 2, 1), ("broadcast", 32, 4, 2, 0.5), ("broadcast", 32, 4, 2, 2),
    ("broadcast", 32, 4, 3, 1), ("broadcast", 32, 8, 2, 1), ("broadcast", 16, 4, 2, 1),
    ("broadcast", 64, 4, 2, 1), ("broadcast", 64, 8, 2, 1), ("broadcast", 128, 4, 2, 1), ("broadcast", 128, 8, 2, 1),
    ("gather", 32, 4, 2, 1), ("gather", 64, 8, 2, 1),
)

# --store packed --graph --sweep: (variant, block_c, num_warps, num_stages, split as a multiple of the default
# split); the first is the bit-plane kernel at its default launch, the third the default
PACKED_SWEEP = (
    ("planes", 64, 4, 2, 1), ("planes_exact", 64, 4, 2, 1),
    ("channels", 64, 4, 2, 1), ("channels", 64, 4, 2, 0.5), ("channels", 64, 4, 2, 2),
    ("channels", 64, 4, 3, 1), ("channels", 64, 8, 2, 1), ("channels", 32, 4, 2, 1), ("channels", 32, 2, 2, 1),
    ("channels", 128, 4, 2, 1), ("channels", 128, 8, 2, 1), ("channels", 128, 8, 3, 1),
)


def graphed(fn):
    """``fn`` captured in a CUDA graph (after warm-up on a side stream): returns the graph's ``replay``, so a timing
    measures the kernels alone, without the host's Python and launch overhead."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def timed(fn, iters: int, device) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls after 3 warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


@torch.no_grad()
def row(context: int, bits: int, hq: int, hkv: int, d: int, iters: int, device, backend: str,
        graph: bool = False, sweep: bool = False, store_kind: str = "packed") -> dict:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device=device).manual_seed(0)
    k = torch.randn(1, hkv, context, d, device=device, dtype=dtype, generator=g)
    v = torch.randn(1, hkv, context, d, device=device, dtype=dtype, generator=g)
    q = torch.randn(1, hq, 1, d, device=device, dtype=dtype, generator=g)
    store = (PackedStore(bits) if store_kind == "packed"
             else KIVIStore(bits, KIVI_GROUP, KIVI_RESIDUAL, value_group_size=min(KIVI_GROUP, d)))
    store.allocate(1, hkv, context, d, d, dtype, device)
    store.write(torch.arange(context, device=device).expand(1, hkv, context), k, v)
    visible = torch.ones(1, 1, context, dtype=torch.bool, device=device)
    group = hq // hkv

    def bf16():
        return F.scaled_dot_product_attention(q, k.repeat_interleave(group, 1) if device.type != "cuda" else k,
                                              v.repeat_interleave(group, 1) if device.type != "cuda" else v,
                                              enable_gqa=device.type == "cuda")

    def read_then_attend():
        keys, values = store.read()
        return F.scaled_dot_product_attention(q, keys, values, enable_gqa=True) if device.type == "cuda" else \
            F.scaled_dot_product_attention(q, keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1))

    def fused(block_c=None, split=None, **launch):  # block_c None: the kernel's default (packed 64, KIVI 32)
        if store_kind == "kivi":
            return kivi_decode_attention(q[:, :, 0], *store._buffers(), visible, bits, KIVI_GROUP, backend=backend,
                                         block_c=block_c or 32, split=split, **launch)
        return packed_decode_attention(q[:, :, 0], store.key_codes, store.key_scales, store.value_codes,
                                       store.value_scales, visible, bits, backend=backend, block_c=block_c or 64,
                                       split=split, **launch)

    variants = [("bf16", bf16), ("read_then_attend", read_then_attend), ("fused", fused),
                ("fused_block_c_128", lambda: fused(128))]
    if store_kind == "kivi":  # the first kernel at the tile the benchmark timed it with, in the same run
        variants.append(("fused_rebuild", lambda: fused(64, key_path="rebuild")))
    else:  # the bit-plane kernel the default replaced, in the same run
        variants.append(("fused_planes", lambda: fused(variant="planes")))
    ms = {name: timed(fn, iters, device) for name, fn in variants}
    diff = (fused().float() - read_then_attend()[:, :, 0].float()).abs().max().item()
    extra = {}
    if store_kind == "kivi":
        extra["fused_rebuild_over_bf16"] = round(ms["fused_rebuild"] / ms["bf16"], 3)
        old = fused(64, key_path="rebuild")
        extra["max_abs_diff_fused_vs_rebuild"] = (fused().float() - old.float()).abs().max().item()
    else:
        extra["fused_planes_over_bf16"] = round(ms["fused_planes"] / ms["bf16"], 3)
        old = fused(variant="planes")
        extra["max_abs_diff_fused_vs_planes"] = (fused().float() - old.float()).abs().max().item()
    if graph:  # the same, each replayed from a CUDA graph: the kernels' own time
        ms_graph = {}
        for name, fn in variants:
            if name == "fused_block_c_128":
                continue
            try:
                ms_graph[name] = round(timed(graphed(fn), iters, device), 4)
            except RuntimeError as e:  # a variant that cannot be captured is reported, not fatal
                ms_graph[name] = f"not capturable: {str(e).splitlines()[0][:200]}"
        extra["ms_graph"] = ms_graph
        for name in ("fused", "fused_rebuild", "fused_planes"):
            if name in ms_graph and all(isinstance(ms_graph[k], float) for k in ("bf16", name)):
                extra[f"{name}_over_bf16_graph"] = round(ms_graph[name] / ms_graph["bf16"], 3)
        if sweep and isinstance(ms_graph["bf16"], float):
            if store_kind == "kivi":
                extra.update(kivi_launch_sweep(lambda **kw: graphed(lambda: fused(**kw)), context, hkv, iters,
                                               device, ms_graph["bf16"]))
            else:
                extra.update(launch_sweep(lambda bc, sp: graphed(lambda: fused(bc, sp)), context, iters, device,
                                          ms_graph["bf16"]))
                extra.update(variant_launch_sweep(lambda **kw: graphed(lambda: fused(**kw)), context, hkv, iters,
                                                  device, ms_graph["bf16"]))
    return {"store": store_kind, "context": context, "bits": bits, "q_heads": hq, "kv_heads": hkv, "head_dim": d,
            "backend": backend,
            "ms": {k2: round(v2, 4) for k2, v2 in ms.items()},
            "fused_over_bf16": round(ms["fused"] / ms["bf16"], 3),
            "fused_block_c_128_over_bf16": round(ms["fused_block_c_128"] / ms["bf16"], 3),
            "read_then_attend_over_bf16": round(ms["read_then_attend"] / ms["bf16"], 3),
            "max_abs_diff_fused_vs_read": diff, **extra}


def launch_sweep(make, context: int, iters: int, device, bf16_ms: float) -> dict:
    """The fused kernel's graph-replayed time over its launch grid: tiles ``block_c`` in {32, 64, 128} times slots
    per program ``split`` from 128 up to 8192 (at most 2048 splits): ``sweep`` maps ``"block_c/split"`` to ms,
    ``sweep_best`` is the fastest and ``sweep_best_over_bf16_graph`` its ratio to the graph-replayed bf16 cache."""
    times = {}
    for block_c in (32, 64, 128):
        split = max(block_c, 128)
        while split <= 8192:
            if context // split <= 2048:
                times[f"{block_c}/{split}"] = round(timed(make(block_c, split), iters, device), 4)
            split *= 2
    best = min(times, key=times.get)
    return {"sweep": times, "sweep_best": best, "sweep_best_over_bf16_graph": round(times[best] / bf16_ms, 3)}


def kivi_launch_sweep(make, context: int, kv_heads: int, iters: int, device, bf16_ms: float,
                      variants=KIVI_SWEEP) -> dict:
    """The KIVI kernels' graph-replayed time over ``variants`` (:data:`KIVI_SWEEP`): ``make(key_path=, block_c=,
    split=, num_warps=, num_stages=)`` returns the callable to time; ``split`` is the default split
    (:func:`~kvlearn.ops.packed_decode.default_split`) times the variant's factor, at least ``block_c``. ``sweep``
    maps ``"key_path/block_c/split/num_warps/num_stages"`` to ms (or the first line of the error of a launch that
    failed), ``sweep_over_bf16_graph`` each ratio to the graph-replayed bf16 cache, ``sweep_best`` the fastest and
    ``sweep_best_over_bf16_graph`` its ratio."""
    times = {}
    for key_path, block_c, warps, stages, factor in variants:
        split = max(block_c, int(default_split(context, kv_heads, block_c, device) * factor))
        name = f"{key_path}/{block_c}/{split}/{warps}/{stages}"
        try:
            times[name] = round(timed(make(key_path=key_path, block_c=block_c, split=split, num_warps=warps,
                                           num_stages=stages), iters, device), 4)
        except Exception as e:  # one launch that fails to compile or run is reported, not fatal
            times[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    ok = {k: v for k, v in times.items() if isinstance(v, float)}
    out = {"sweep": times, "sweep_over_bf16_graph": {k: round(v / bf16_ms, 3) for k, v in ok.items()}}
    if ok:
        best = min(ok, key=ok.get)
        out.update(sweep_best=best, sweep_best_over_bf16_graph=round(ok[best] / bf16_ms, 3))
    return out


def variant_launch_sweep(make, context: int, kv_heads: int, iters: int, device, bf16_ms: float,
                         variants=PACKED_SWEEP) -> dict:
    """The packed kernels' graph-replayed time over ``variants`` (:data:`PACKED_SWEEP`), as
    :func:`kivi_launch_sweep` does for KIVI (``make(variant=, block_c=, split=, num_warps=, num_stages=)``, names
    ``"variant/block_c/split/num_warps/num_stages"``), its keys prefixed ``variant_`` (``variant_sweep``,
    ``variant_sweep_over_bf16_graph``, ``variant_sweep_best``, ``variant_sweep_best_over_bf16_graph``) beside the
    launch grid's."""
    out = kivi_launch_sweep(lambda key_path, **kw: make(variant=key_path, **kw), context, kv_heads, iters, device,
                            bf16_ms, variants)
    return {f"variant_{k}": v for k, v in out.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="16384,32768,65536,131072")
    p.add_argument("--bits", default="4,2")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--graph", action="store_true",
                   help="also time each variant replayed from a CUDA graph (the kernels without host overhead)")
    p.add_argument("--sweep", action="store_true",
                   help="with --graph: also time the fused kernel over its launch grid (block_c x split) and the "
                        "variants of PACKED_SWEEP (--store kivi: of KIVI_SWEEP), the kernel before among them")
    p.add_argument("--store", default="packed", choices=("packed", "kivi"),
                   help="packed: PackedStore and kvlearn.ops.packed_decode; kivi: KIVIStore (G = 32, R = 128) and "
                        "kvlearn.ops.kivi_decode")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, torch backend")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.smoke:
        device, contexts, shape, backend = torch.device("cpu"), [64, 128], (4, 2, 16), "torch"
    else:
        if not torch.cuda.is_available():
            print("packed_decode_speed: error: no CUDA device (use --smoke on the CPU)", file=sys.stderr)
            return 2
        device, shape, backend = torch.device("cuda"), (40, 8, 128), "triton"
        contexts = [int(c) for c in args.contexts.split(",")]
    rows = []
    for c in contexts:
        for b in (int(x) for x in args.bits.split(",")):
            rows.append(row(c, b, *shape, iters=args.iters, device=device, backend=backend,
                            graph=args.graph and device.type == "cuda", sweep=args.sweep, store_kind=args.store))
            print(rows[-1], flush=True)
    if args.out:
        write_results(args.out, make_results("speed", rows, device=str(device)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
