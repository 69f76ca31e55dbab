"""How far the packed decode kernel's ``dequant="magic"`` path can drift from its converting path: a CPU model of the
offset's removal (:mod:`kvlearn.ops.packed_decode`, docs/DESIGN.md section 7, "Magic-number operands").

    PYTHONPATH=src python benchmarks/packed_decode_offset_error.py --out results/raw/packed_decode_offset_error_cpu.json

The magic path multiplies ``OFF + u`` (``u`` the unsigned code, ``OFF`` 128 for bf16, 1024 for fp16) and takes
``(OFF + 2^(b-1))`` times the query sum off the logits and, per tile of ``--block-c`` slots, times the tile's weight sum
off the values; the converting path multiplies the signed codes ``u - 2^(b-1)``. In exact arithmetic the two agree.
Here both are computed with every product exact and the sums accumulated one term at a time in ``--accumulate``
(float32: the worst order for the large ``OFF`` terms; float64: the identity's check), the probability-times-scale
weights rounded to the query's dtype as the kernel does, for one KV head's ``--group`` query heads over ``--context``
slots of random codes and scales. Rows: per bits, dtype and seed, the largest difference of the base-2 logits and of
the attention outputs, and the outputs' largest magnitude.
"""

from __future__ import annotations

import argparse
import sys

import torch

from kvlearn.errors import KVLearnError, check
from kvlearn.results import make_results, write_results

OFFSETS = {"bfloat16": 128.0, "float16": 1024.0}
LOG2E = 1.4426950408889634


def sequential_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a [M, K] @ b [K, N]`` with exact products, summed over ``K`` one term at a time in ``a``'s dtype."""
    acc = torch.zeros(a.shape[0], b.shape[1], dtype=a.dtype)
    for k in range(a.shape[1]):
        acc = acc + a[:, k:k + 1] * b[k:k + 1, :]
    return acc


def offset_error(context: int, head_dim: int, group: int, bits: int, dtype: str, seed: int, block_c: int,
                 accumulate: torch.dtype) -> dict:
    """One row: magic against converting path on the same random codes (see the module docstring)."""
    g = torch.Generator().manual_seed(seed)
    low = getattr(torch, dtype)
    bias, off = 1 << (bits - 1), OFFSETS[dtype]
    q = torch.randn(group, head_dim, generator=g).to(low).to(accumulate)
    ku = torch.randint(0, 1 << bits, (context, head_dim), generator=g).to(accumulate)
    vu = torch.randint(0, 1 << bits, (context, head_dim), generator=g).to(accumulate)
    k_scale = (torch.rand(context, generator=g) * 0.3 + 0.3).to(low).to(accumulate)
    v_scale = (torch.rand(context, generator=g) * 0.3 + 0.3).to(low).to(accumulate)
    qk_scale = head_dim ** -0.5 * LOG2E
    s_convert = sequential_dot(q, (ku - bias).T) * k_scale[None] * qk_scale
    s_magic = (sequential_dot(q, (ku + off).T) - (off + bias) * q.sum(1, keepdim=True)) * k_scale[None] * qk_scale

    def attend(s: torch.Tensor, magic: bool) -> torch.Tensor:
        p = torch.softmax(s / LOG2E, dim=1)
        acc = torch.zeros(group, head_dim, dtype=accumulate)
        for c0 in range(0, context, block_c):
            w = (p[:, c0:c0 + block_c] * v_scale[None, c0:c0 + block_c]).to(low).to(accumulate)  # rounded weights
            codes = vu[c0:c0 + block_c]
            if magic:
                acc = acc + sequential_dot(w, codes + off) - (off + bias) * w.sum(1, keepdim=True)
            else:
                acc = acc + sequential_dot(w, codes - bias)
        return acc

    out_convert, out_magic = attend(s_convert, False), attend(s_magic, True)
    return {"context": context, "head_dim": head_dim, "group": group, "bits": bits, "dtype": dtype, "seed": seed,
            "block_c": block_c, "accumulate": str(accumulate).replace("torch.", ""),
            "logit_max_abs_diff": (s_convert - s_magic).abs().max().item(),
            "out_max_abs_diff": (out_convert - out_magic).abs().max().item(),
            "out_max_abs": out_convert.abs().max().item()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096, help="slots (default 4096)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--group", type=int, default=5, help="query heads per KV head (default 5, the 14B shape's)")
    ap.add_argument("--bits", default="2,4", help="comma list of 2 and 4 (the magic path's widths)")
    ap.add_argument("--dtypes", default="bfloat16,float16")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--block-c", type=int, default=64, help="slots per tile (the kernel's default 64)")
    ap.add_argument("--accumulate", default="float32", choices=("float32", "float64"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        bits = [int(b) for b in args.bits.split(",")]
        check(all(b in (2, 4) for b in bits), f"--bits {args.bits!r} is invalid: expected a comma list of 2 and 4")
        dtypes = args.dtypes.split(",")
        check(all(d in OFFSETS for d in dtypes), f"--dtypes {args.dtypes!r} is invalid: expected bfloat16 and/or float16")
        for name in ("context", "head_dim", "group", "seeds", "block_c"):
            check(getattr(args, name) >= 1, f"--{name.replace('_', '-')}={getattr(args, name)} is invalid: expected >= 1")
    except (KVLearnError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    acc = getattr(torch, args.accumulate)
    rows = [offset_error(args.context, args.head_dim, args.group, b, d, s, args.block_c, acc)
            for b in bits for d in dtypes for s in range(args.seeds)]
    for r in rows:
        print(f"{r['bits']}-bit {r['dtype']:<8} seed {r['seed']}: logits {r['logit_max_abs_diff']:.2e}, "
              f"outputs {r['out_max_abs_diff']:.2e} (outputs up to {r['out_max_abs']:.2f})")
    if args.out:
        write_results(args.out, make_results("analysis", rows, device="cpu"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
