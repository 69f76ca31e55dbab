"""Decode attention over a packed KV store against the bf16 cache, one layer of a Qwen2.5-14B shape, on the GPU.

    PYTHONPATH=src python benchmarks/packed_decode_speed.py --out results/packed_decode_h200.json

For each context ``C`` and bit-width, one decode step's attention (batch 1, 40 query heads over 8 KV heads of 128,
every slot visible) three ways, timed with CUDA events (median of ``--iters`` after warm-up), in one process:

- ``bf16``: ``scaled_dot_product_attention`` over bf16 K/V ``[1, 8, C, 128]`` (the plain store's read is a view);
- ``read_then_attend``: what the cache does without the kernel, ``PackedStore.read()`` (unpack and dequantize every
  slot into a full-size bf16 temporary) then the same SDPA;
- ``fused``: :func:`kvlearn.ops.packed_decode.packed_decode_attention` (the bit-plane kernel: codes unpacked in
  registers, no temporary), at its default tile of 64 slots, and ``fused_block_c_128`` at 128 (the choice of the
  default); with a bf16 / fp16 store at 2 or 4 bits also ``fused_magic``, the same kernel with ``dequant="magic"``
  (the codes OR-ed into the operands' mantissas instead of converted, ``fused_magic_over_bf16`` and, with
  ``--graph``, ``fused_magic_over_bf16_graph``; ``max_abs_diff_fused_magic_vs_fused`` its difference from the
  converting kernel).

``--store kivi`` measures the KIVI store the same way (``KIVIStore`` with key groups of 32 tokens and a 128-token
bf16 window; ``fused`` is :func:`kvlearn.ops.kivi_decode.kivi_decode_attention` at its default launch, a tile of 32
slots, and ``fused_block_c_128`` at 128).

Rows: ``ms`` per variant and the ratios ``fused / bf16``, ``fused_block_c_128 / bf16`` and ``read_then_attend /
bf16`` measured in the same run, and each fused launch's largest difference from ``read_then_attend``
(``max_abs_diff_fused_vs_read``, ``max_abs_diff_fused_block_c_128_vs_read``: same codes, so only float rounding,
chiefly the bf16 probabilities of the value product, as in flash attention). ``--graph`` adds ``ms_graph``: each
variant replayed from a CUDA graph, so the kernels are timed without the host's Python and launch overhead (what a
compiled / graph-captured decode loop pays), and ``fused_over_bf16_graph``. ``--graph --sweep`` adds the fused
kernel's graph-replayed time over a launch grid: for the packed store block_c x split (:func:`launch_sweep`), to
choose :func:`kvlearn.ops.packed_decode.default_split` by measurement (``--sweep-warps`` instead: the launches of
:data:`PACKED_SWEEP`, tile x warps x pipeline stages x split, :func:`packed_launch_sweep`); for KIVI the launches of :data:`KIVI_SWEEP`
(:func:`kivi_launch_sweep`: key path, tile, warps, stages, split); ``--sweep-dequant magic`` sweeps the packed
kernel's ``dequant="magic"`` path instead of the converting one (recorded as ``sweep_dequant``). Every sweep entry also records its largest
difference from ``read_then_attend`` (``sweep_max_abs_diff``); one above :data:`MAX_ABS_DIFF` is listed in
``sweep_wrong`` and never chosen as ``sweep_best``. KV-Kaizen's acceptance asks ``fused / bf16 <= 1`` at 131k
(issue #11 item 9). ``--smoke`` runs tiny shapes on the CPU through the torch backend (checks the plumbing, times
nothing meaningful).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

from kvlearn.cache import KIVIStore, PackedStore
from kvlearn.ops.kivi_decode import kivi_decode_attention
from kvlearn.ops.packed_decode import default_dequant, default_split, packed_decode_attention
from kvlearn.results import make_results, write_results

KIVI_GROUP, KIVI_RESIDUAL = 32, 128  # --store kivi: KIVI's key group and full-precision window (kaizen_memory's)

# --store kivi --graph --sweep: (key_path, block_c, num_warps, num_stages, split as a multiple of the default split);
# the first is the default launch (tiles of 16 are refused on CUDA: kvlearn.ops.kivi_decode.check_cuda_block_c)
KIVI_SWEEP = (
    ("broadcast", 32, 4, 2, 1), ("broadcast", 32, 4, 2, 0.5), ("broadcast", 32, 4, 2, 2),
    ("broadcast", 32, 4, 3, 1), ("broadcast", 32, 8, 2, 1),
    ("broadcast", 64, 4, 2, 1), ("broadcast", 64, 8, 2, 1), ("broadcast", 128, 4, 2, 1), ("broadcast", 128, 8, 2, 1),
    ("gather", 32, 4, 2, 1), ("gather", 64, 8, 2, 1),
)

# --store packed --graph --sweep-warps: (block_c, num_warps, num_stages, split as a multiple of the default split);
# the first is the default launch. The block_c x split grid (launch_sweep) found the default fastest at 131k
# (results/raw/packed_decode_sweep_h200_f23f460.json); this grid asks the warps and the software pipeline.
PACKED_SWEEP = tuple((bc, w, st, f) for bc in (64, 128) for w in (4, 2, 8) for st in (2, 1, 3, 4) for f in (1, 0.5)
                     if not (bc == 128 and f == 0.5))

# a fused launch further than this from read_then_attend (largest absolute difference) is wrong, not merely rounded
# (the kernels measured ~1e-4 at bf16 on the H200; a miscompiled launch 0.19)
MAX_ABS_DIFF = 1e-2


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
        graph: bool = False, sweep: bool = False, store_kind: str = "packed", sweep_dequant: str = "convert") -> dict:
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

    def fused(block_c=None, split=None, dequant="convert", **launch):  # block_c None: the default (packed 64, KIVI 32)
        if store_kind == "kivi":
            return kivi_decode_attention(q[:, :, 0], *store._buffers(), visible, bits, KIVI_GROUP, backend=backend,
                                         block_c=block_c or 32, split=split, **launch)
        return packed_decode_attention(q[:, :, 0], store.key_codes, store.key_scales, store.value_codes,
                                       store.value_scales, visible, bits, backend=backend, block_c=block_c or 64,
                                       split=split, dequant=dequant, **launch)

    reference = read_then_attend()[:, :, 0].float()

    def max_abs_diff(out) -> float:
        """The largest difference of a fused output from read_then_attend's (NaN stays NaN: never <= a tolerance)."""
        return (out.float() - reference).abs().max().item()

    variants = [("bf16", bf16), ("read_then_attend", read_then_attend), ("fused", fused),
                ("fused_block_c_128", lambda: fused(128))]
    magic = store_kind == "packed" and default_dequant(bits, dtype) == "magic"
    if magic:  # the packed kernel with its codes OR-ed into the operands' mantissas (dequant="magic")
        variants.append(("fused_magic", lambda: fused(dequant="magic")))
    ms = {name: timed(fn, iters, device) for name, fn in variants}
    diffs = {"max_abs_diff_fused_vs_read": max_abs_diff(fused()),
             "max_abs_diff_fused_block_c_128_vs_read": max_abs_diff(fused(128))}
    if magic:
        diffs["max_abs_diff_fused_magic_vs_read"] = max_abs_diff(fused(dequant="magic"))
        diffs["max_abs_diff_fused_magic_vs_fused"] = (fused(dequant="magic").float() - fused().float()).abs().max().item()
    extra = {}
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
        if all(isinstance(ms_graph[k], float) for k in ("bf16", "fused")):
            extra["fused_over_bf16_graph"] = round(ms_graph["fused"] / ms_graph["bf16"], 3)
        if magic and all(isinstance(ms_graph[k], float) for k in ("bf16", "fused_magic")):
            extra["fused_magic_over_bf16_graph"] = round(ms_graph["fused_magic"] / ms_graph["bf16"], 3)
        if sweep and isinstance(ms_graph["bf16"], float):
            if store_kind == "packed":  # the packed kernel's dequant path the sweep times (--sweep-dequant)
                extra["sweep_dequant"] = sweep_dequant
                launch_of = {"dequant": sweep_dequant}
            else:
                launch_of = {}

            def make(**launch):  # checked eagerly first (a launch that fails is reported by the sweep), then graphed
                diff = max_abs_diff(fused(**launch_of, **launch))
                return graphed(lambda: fused(**launch_of, **launch)), diff

            if store_kind == "kivi":
                extra.update(kivi_launch_sweep(make, context, hkv, iters, device, ms_graph["bf16"]))
            elif sweep == "warps":
                extra.update(packed_launch_sweep(make, context, hkv, iters, device, ms_graph["bf16"]))
            else:
                extra.update(launch_sweep(lambda bc, sp: make(block_c=bc, split=sp), context, iters, device,
                                          ms_graph["bf16"]))
    return {"store": store_kind, "context": context, "bits": bits, "q_heads": hq, "kv_heads": hkv, "head_dim": d,
            "backend": backend,
            "ms": {k2: round(v2, 4) for k2, v2 in ms.items()},
            "fused_over_bf16": round(ms["fused"] / ms["bf16"], 3),
            "fused_block_c_128_over_bf16": round(ms["fused_block_c_128"] / ms["bf16"], 3),
            "read_then_attend_over_bf16": round(ms["read_then_attend"] / ms["bf16"], 3),
            **({"fused_magic_over_bf16": round(ms["fused_magic"] / ms["bf16"], 3)} if magic else {}),
            **diffs, **extra}


def _sweep_summary(times: dict, diffs: dict, bf16_ms: float) -> dict:
    """A sweep's keys from ``times`` (name -> ms, or a string: the launch failed) and ``diffs`` (name -> largest
    difference from read_then_attend): ``sweep``, ``sweep_max_abs_diff``, ``sweep_wrong`` (the launches further
    than :data:`MAX_ABS_DIFF`, or NaN), ``sweep_over_bf16_graph`` (every timed launch), and ``sweep_best`` with
    ``sweep_best_over_bf16_graph``: the fastest launch that is right (absent when none is)."""
    timed_ok = {k: v for k, v in times.items() if isinstance(v, float)}
    wrong = [k for k in timed_ok if not diffs[k] <= MAX_ABS_DIFF]
    out = {"sweep": times, "sweep_max_abs_diff": diffs, "sweep_wrong": wrong,
           "sweep_over_bf16_graph": {k: round(v / bf16_ms, 3) for k, v in timed_ok.items()}}
    right = {k: v for k, v in timed_ok.items() if k not in wrong}
    if right:
        best = min(right, key=right.get)
        out.update(sweep_best=best, sweep_best_over_bf16_graph=round(right[best] / bf16_ms, 3))
    return out


def launch_sweep(make, context: int, iters: int, device, bf16_ms: float) -> dict:
    """The fused kernel's graph-replayed time over its launch grid: tiles ``block_c`` in {32, 64, 128} times slots
    per program ``split`` from 128 up to 8192 (at most 2048 splits). ``make(block_c, split)`` returns the callable to
    time and the launch's largest difference from read_then_attend. ``sweep`` maps ``"block_c/split"`` to ms, the
    rest as :func:`_sweep_summary` says (``sweep_best``: the fastest right launch)."""
    times, diffs = {}, {}
    for block_c in (32, 64, 128):
        split = max(block_c, 128)
        while split <= 8192:
            if context // split <= 2048:
                name = f"{block_c}/{split}"
                fn, diffs[name] = make(block_c, split)
                times[name] = round(timed(fn, iters, device), 4)
            split *= 2
    return _sweep_summary(times, diffs, bf16_ms)


def packed_launch_sweep(make, context: int, kv_heads: int, iters: int, device, bf16_ms: float,
                        variants=PACKED_SWEEP) -> dict:
    """The packed kernel's graph-replayed time over ``variants`` (:data:`PACKED_SWEEP`: tile, warps, pipeline
    stages, split as a multiple of the default): ``make(block_c=, split=, num_warps=, num_stages=)`` returns the
    callable to time and the launch's largest difference from read_then_attend. ``sweep`` maps
    ``"block_c/split/num_warps/num_stages"`` to ms (or the first line of the error of a launch that failed), the
    rest as :func:`_sweep_summary` says (``sweep_best``: the fastest right launch)."""
    times, diffs = {}, {}
    for block_c, warps, stages, factor in variants:
        split = max(block_c, int(default_split(context, kv_heads, block_c, device) * factor))
        name = f"{block_c}/{split}/{warps}/{stages}"
        try:
            fn, diff = make(block_c=block_c, split=split, num_warps=warps, num_stages=stages)
            times[name] = round(timed(fn, iters, device), 4)
            diffs[name] = diff
        except Exception as e:  # one launch that fails to compile or run is reported, not fatal
            times[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return _sweep_summary(times, diffs, bf16_ms)


def kivi_launch_sweep(make, context: int, kv_heads: int, iters: int, device, bf16_ms: float,
                      variants=KIVI_SWEEP) -> dict:
    """The KIVI kernel's graph-replayed time over ``variants`` (:data:`KIVI_SWEEP`): ``make(key_path=, block_c=,
    split=, num_warps=, num_stages=)`` returns the callable to time and the launch's largest difference from
    read_then_attend; ``split`` is the default split (:func:`~kvlearn.ops.packed_decode.default_split`) times the
    variant's factor, at least ``block_c``. ``sweep`` maps ``"key_path/block_c/split/num_warps/num_stages"`` to ms
    (or the first line of the error of a launch that failed, which has no ``sweep_max_abs_diff``), the rest as
    :func:`_sweep_summary` says (``sweep_best``: the fastest right launch)."""
    times, diffs = {}, {}
    for key_path, block_c, warps, stages, factor in variants:
        split = max(block_c, int(default_split(context, kv_heads, block_c, device) * factor))
        name = f"{key_path}/{block_c}/{split}/{warps}/{stages}"
        try:
            fn, diff = make(key_path=key_path, block_c=block_c, split=split, num_warps=warps, num_stages=stages)
            times[name] = round(timed(fn, iters, device), 4)
            diffs[name] = diff
        except Exception as e:  # one launch that fails to compile or run is reported, not fatal
            times[name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    return _sweep_summary(times, diffs, bf16_ms)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="16384,32768,65536,131072")
    p.add_argument("--bits", default="4,2")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--graph", action="store_true",
                   help="also time each variant replayed from a CUDA graph (the kernels without host overhead)")
    p.add_argument("--sweep", action="store_true",
                   help="with --graph: also time the fused kernel over its launch grid (block_c x split; --store kivi: "
                        "the launches of KIVI_SWEEP), each checked against read_then_attend")
    p.add_argument("--sweep-warps", action="store_true",
                   help="with --graph --store packed: sweep PACKED_SWEEP (tile x warps x pipeline stages x split) "
                        "instead of the block_c x split grid")
    p.add_argument("--sweep-dequant", default="convert", choices=("convert", "magic"),
                   help="with --sweep / --sweep-warps on the packed store: the kernel's dequant path the sweep times "
                        "(magic: bf16 / fp16 stores at 2 or 4 bits)")
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
                            graph=args.graph and device.type == "cuda",
                            sweep="warps" if args.sweep_warps else args.sweep, store_kind=args.store,
                            sweep_dequant=args.sweep_dequant))
            print(rows[-1], flush=True)
    if args.out:
        write_results(args.out, make_results("speed", rows, device=str(device), **summarize(rows)))
    return 0


def summarize(rows: list[dict], context: int = 131072) -> dict:
    """The issue's bar from graph-replayed rows: at ``context``, per store and bit-width, the default decode path's
    time over the bf16 cache's (the packed store's default is ``dequant="auto"``: ``fused_magic`` where the row has
    it, else ``fused``), and whether none is slower. ``{}`` where no graph-replayed row at ``context`` exists."""
    ratios = {}
    for r in rows:
        graph = r.get("ms_graph", {})
        path = "fused_magic" if "fused_magic" in graph else "fused"
        if r["context"] == context and all(isinstance(graph.get(k), float) for k in ("bf16", path)):
            ratios[f"{r['store']}_{r['bits']}bit_{path}_over_bf16_graph_at_{context}"] = round(
                graph[path] / graph["bf16"], 3)
    if not ratios:
        return {}
    return {"summary": ratios,
            "acceptance": {f"default_decode_not_slower_than_bf16_at_{context}": all(v <= 1.0 for v in ratios.values())}}


if __name__ == "__main__":
    sys.exit(main())
