"""Decode attention over a packed KV store against the bf16 cache, one layer of a Qwen2.5-14B shape, on the GPU.

    PYTHONPATH=src python benchmarks/packed_decode_speed.py --out results/packed_decode_h200.json

For each context ``C`` and bit-width, one decode step's attention (batch 1, 40 query heads over 8 KV heads of 128,
every slot visible) three ways, timed with CUDA events (median of ``--iters`` after warm-up), in one process:

- ``bf16``: ``scaled_dot_product_attention`` over bf16 K/V ``[1, 8, C, 128]`` (the plain store's read is a view);
- ``read_then_attend``: what the cache does today, ``PackedStore.read()`` (unpack and dequantize every slot into
  a full-size bf16 temporary) then the same SDPA;
- ``fused``: :func:`kvlearn.ops.packed_decode.packed_decode_attention` (codes unpacked in registers, no temporary),
  at its default tile of 64 slots, and ``fused_block_c_128`` at 128 (the choice of the default).

``--store kivi`` measures the KIVI store the same way (``KIVIStore`` with key groups of 32 tokens and a 128-token
bf16 window; ``fused`` is :func:`kvlearn.ops.kivi_decode.kivi_decode_attention`, tiles rebuilt in registers).

Rows: ``ms`` per variant and the ratios ``fused / bf16`` and ``read_then_attend / bf16`` measured in the same run,
``--graph`` adds ``ms_graph``: each variant replayed from a CUDA graph, so the kernels are timed without the host's
Python and launch overhead (what a compiled / graph-captured decode loop pays), and ``fused_over_bf16_graph``;
``--graph --sweep`` adds the fused kernel's graph-replayed time over its launch grid (:func:`launch_sweep`), to
choose :func:`kvlearn.ops.packed_decode.default_split` by measurement;
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
from kvlearn.ops.packed_decode import packed_decode_attention

KIVI_GROUP, KIVI_RESIDUAL = 32, 128  # --store kivi: KIVI's key group and full-precision window (kaizen_memory's)
from kvlearn.results import make_results, write_results


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

    def fused(block_c=64, split=None):
        if store_kind == "kivi":
            return kivi_decode_attention(q[:, :, 0], *store._buffers(), visible, bits, KIVI_GROUP, backend=backend,
                                         block_c=block_c, split=split)
        return packed_decode_attention(q[:, :, 0], store.key_codes, store.key_scales, store.value_codes,
                                       store.value_scales, visible, bits, backend=backend, block_c=block_c,
                                       split=split)

    ms = {name: timed(fn, iters, device) for name, fn in
          (("bf16", bf16), ("read_then_attend", read_then_attend), ("fused", fused),
           ("fused_block_c_128", lambda: fused(128)))}
    diff = (fused().float() - read_then_attend()[:, :, 0].float()).abs().max().item()
    extra = {}
    if graph:  # the same three, each replayed from a CUDA graph: the kernels' own time
        ms_graph = {}
        for name, fn in (("bf16", bf16), ("read_then_attend", read_then_attend), ("fused", fused)):
            try:
                ms_graph[name] = round(timed(graphed(fn), iters, device), 4)
            except RuntimeError as e:  # a variant that cannot be captured is reported, not fatal
                ms_graph[name] = f"not capturable: {str(e).splitlines()[0][:200]}"
        extra = {"ms_graph": ms_graph}
        if all(isinstance(ms_graph[k], float) for k in ("bf16", "fused")):
            extra["fused_over_bf16_graph"] = round(ms_graph["fused"] / ms_graph["bf16"], 3)
        if sweep and isinstance(ms_graph["bf16"], float):
            extra.update(launch_sweep(lambda bc, sp: graphed(lambda: fused(bc, sp)), context, iters, device,
                                      ms_graph["bf16"]))
    return {"store": store_kind, "context": context, "bits": bits, "q_heads": hq, "kv_heads": hkv, "head_dim": d, "backend": backend,
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="16384,32768,65536,131072")
    p.add_argument("--bits", default="4,2")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--graph", action="store_true",
                   help="also time each variant replayed from a CUDA graph (the kernels without host overhead)")
    p.add_argument("--sweep", action="store_true",
                   help="with --graph: also time the fused kernel over its launch grid (block_c x split)")
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
