"""One prefill chunk's attention of the absorbed MLA layer (MQA) at growing context, the ways
:func:`kvlearn.hf.masked_attention` can run it, against the bf16 GQA layer's, on the GPU.

    PYTHONPATH=src python benchmarks/mqa_prefill_attention.py --out results/mqa_prefill_attention_h200.json

The Qwen2.5-14B shape of ``benchmarks/kaizen_memory.py``: 40 query heads; the bf16 cache attends 8 KV heads of 128,
the MLA rank-128 cache one latent head (the absorbed query ``[q̃ ; q_R]`` of 128 + 64 over ``[c ; k_R]``, value
``c`` of 128). For each context ``C`` one chunk of ``--chunk`` queries (the last positions) attends ``C`` keys under
the causal mask as a boolean ``[1, 1, chunk, C]`` tensor (what the cache's ``visibility_mask`` gives), timed with
CUDA events (median of ``--iters``), in one process:

- ``gqa_fold``: the bf16 cache's prefill attention (8 KV heads, each KV head's 5 query heads folded into the query
  axis; the mask repeated 5 times);
- ``mqa_fold``: the MLA layer before the broadcast path: the 40 query heads folded over the one KV head, the mask
  repeated 40 times, so the 512 MiB bias bound allows 40 times fewer query rows per SDPA call;
- ``mqa_broadcast``: ``masked_attention(..., broadcast=True)``: the K/V as stride-0 views over the query heads and
  the mask unrepeated (the CUDA default from :data:`kvlearn.hf.BROADCAST_MIN_QUERIES` queries);
- ``mqa_lower_right``: no mask tensor at all, SDPA under ``torch.nn.attention.bias.causal_lower_right`` over the
  same views: what a prefill that knows its mask is plain causal could reach (not a path of the library yet).

Rows: ``ms`` per variant, ``sdpa_calls`` per variant (from the bias bound), the ratios to ``gqa_fold`` and
``mqa_fold_over_broadcast`` measured in the same run, and each MQA variant's largest difference from
``mqa_fold``. ``--smoke`` runs tiny shapes on the CPU (checks the plumbing, times nothing meaningful).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from kvlearn.hf import MAX_MASK_BYTES, masked_attention, query_rows_per_chunk
from kvlearn.results import make_results, write_results
from packed_decode_speed import timed  # noqa: E402  (benchmarks/: median CUDA-event ms after warm-up)


def lower_right(query, key, value, scaling):
    """SDPA of ``query [1, Hq, q, d]`` over one KV head ``key [1, 1, C, d]`` under the lower-right causal bias (no
    mask tensor) -> ``[1, q, Hq, dv]``."""
    from torch.nn.attention.bias import causal_lower_right

    hq = query.shape[1]
    k, v = key.expand(1, hq, *key.shape[2:]), value.expand(1, hq, *value.shape[2:])
    bias = causal_lower_right(query.shape[2], key.shape[2])
    return F.scaled_dot_product_attention(query, k, v, attn_mask=bias, scale=scaling).transpose(1, 2)


@torch.no_grad()
def row(context: int, chunk: int, shape: dict, iters: int, device, limit: int) -> dict:
    hq, hkv, dh, rank, rope = shape["q_heads"], shape["kv_heads"], shape["head_dim"], shape["rank"], shape["rope"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(context)

    def rand(*s):
        return torch.randn(*s, generator=g).to(device, dtype)

    q_gqa, k_gqa, v_gqa = rand(1, hq, chunk, dh), rand(1, hkv, context, dh), rand(1, hkv, context, dh)
    q_mqa, k_mqa, v_mqa = rand(1, hq, chunk, rank + rope), rand(1, 1, context, rank + rope), rand(1, 1, context, rank)
    pos = torch.arange(context, device=device)
    mask = (pos[None, :] <= (context - chunk + torch.arange(chunk, device=device))[:, None])[None, None]
    s_gqa, s_mqa = dh ** -0.5, (dh + rope) ** -0.5
    variants = {
        "gqa_fold": lambda: masked_attention(q_gqa, k_gqa, v_gqa, mask, s_gqa, max_mask_bytes=limit),
        "mqa_fold": lambda: masked_attention(q_mqa, k_mqa, v_mqa, mask, s_mqa, max_mask_bytes=limit,
                                             broadcast=False),
        "mqa_broadcast": lambda: masked_attention(q_mqa, k_mqa, v_mqa, mask, s_mqa, max_mask_bytes=limit,
                                                  broadcast=True),
        "mqa_lower_right": lambda: lower_right(q_mqa, k_mqa, v_mqa, s_mqa),
    }
    cuda = device.type == "cuda"
    rows_per_call = {"gqa_fold": query_rows_per_chunk(1, hq, hkv, 1, context, limit, cuda),
                     "mqa_fold": query_rows_per_chunk(1, hq, 1, 1, context, limit, cuda),
                     "mqa_broadcast": query_rows_per_chunk(1, hq, hq, 1, context, limit, cuda),
                     "mqa_lower_right": chunk}
    ms, errors = {}, {}
    for name, fn in variants.items():
        try:
            ms[name] = round(timed(fn, iters, device), 4)
        except Exception as e:  # a variant SDPA refuses on this build is reported, not fatal
            errors[name] = f"{type(e).__name__}: {e}"[:300]
    reference = variants["mqa_fold"]().float()
    diffs = {}
    for name in ("mqa_broadcast", "mqa_lower_right"):
        if name in ms:
            diffs[f"max_abs_diff_{name}_vs_fold"] = float((variants[name]().float() - reference).abs().max())
    out = {"context": context, "chunk": chunk, "ms": ms,
           "sdpa_calls": {k: -(-chunk // r) for k, r in rows_per_call.items()},
           **{f"{k}_over_gqa_fold": round(v / ms["gqa_fold"], 4) for k, v in ms.items()
              if k != "gqa_fold" and "gqa_fold" in ms},
           **diffs}
    if "mqa_fold" in ms and "mqa_broadcast" in ms:
        out["mqa_fold_over_broadcast"] = round(ms["mqa_fold"] / ms["mqa_broadcast"], 4)
    if errors:
        out["errors"] = errors
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--contexts", default="16384,32768,65536,131072", help="comma list of key counts")
    p.add_argument("--chunk", type=int, default=4096, help="queries per prefill chunk (kaizen_memory's --chunk)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.smoke:
        device, contexts, chunk = torch.device("cpu"), [96, 192], 64
        shape = {"q_heads": 8, "kv_heads": 2, "head_dim": 16, "rank": 16, "rope": 8}
        limit = 64 * 192 * 4 * 2  # small, so every variant but lower_right takes several calls
    else:
        if not torch.cuda.is_available():
            print("mqa_prefill_attention: error: no CUDA device (use --smoke on the CPU)", file=sys.stderr)
            return 2
        device, chunk, limit = torch.device("cuda"), args.chunk, MAX_MASK_BYTES
        contexts = [int(c) for c in args.contexts.split(",")]
        shape = {"q_heads": 40, "kv_heads": 8, "head_dim": 128, "rank": 128, "rope": 64}
    bad = [c for c in contexts if c < chunk]
    if bad:
        print(f"mqa_prefill_attention: error: contexts {bad} are shorter than --chunk={chunk}", file=sys.stderr)
        return 2
    rows = []
    for c in contexts:
        rows.append(row(c, chunk, shape, args.iters, device, limit))
        print(rows[-1], flush=True)
    if args.out:
        write_results(args.out, make_results("speed", rows, device=str(device), shape=shape,
                                             max_mask_bytes=limit))
    return 0


if __name__ == "__main__":
    sys.exit(main())
