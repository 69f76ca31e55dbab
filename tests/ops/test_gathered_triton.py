"""Fused Triton forward on the interval-gathered layout against a float64 dense masked softmax.

The kernel runs in Triton's CPU interpreter (``TRITON_INTERPRET=1`` must be set before triton is imported, so the
cases run in one subprocess); the ``gpu`` tests run it compiled on CUDA.
"""

import math
import os

import pytest
import torch

from kvlearn.errors import KVLearnError
from kvlearn.ops.gathered_triton import gathered_attention_forward
from kvlearn.ops.fenwick import running_topk_cutoff
from kvlearn.ops.gathered import gathered_layout
from kvlearn.ops.gathered_layout import gathered_capacity
from kvlearn.ops.masks import retention_mask_dense

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_inputs(seed, B, Hkv, G, T, D, sinks, window, topk, block_size, dtype="fp32", device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, T, D, generator=g).to(device, _DTYPES[dtype])
    k = torch.randn(B, Hkv, T, D, generator=g).to(device, _DTYPES[dtype])
    v = torch.randn(B, Hkv, T, D, generator=g).to(device, _DTYPES[dtype])
    priorities = torch.randn(B, Hkv, T, generator=g).to(device)
    ranks, cutoffs = running_topk_cutoff(priorities, sinks, window, topk)
    layout = gathered_layout(ranks, cutoffs, sinks, window, topk=topk, block_size=block_size)
    return q, k, v, ranks, cutoffs, layout


def dense_reference(q, k, v, ranks, cutoffs, sinks, window, scale=None):
    """float64 masked softmax (query head h reads KV head h // G), one KV head at a time; (out, natural-log lse)."""
    Hkv = k.shape[1]
    G = q.shape[1] // Hkv
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    mask = retention_mask_dense(ranks, cutoffs, sinks, window)  # [B, Hkv, T, T]
    outs, lses = [], []
    for h in range(Hkv):
        qh = q[:, h * G:(h + 1) * G].double()
        logits = (qh @ k[:, h:h + 1].double().transpose(-1, -2)) * scale
        logits = logits.masked_fill(~mask[:, h:h + 1], -math.inf)
        lses.append(torch.logsumexp(logits, dim=-1))
        outs.append(torch.softmax(logits, dim=-1) @ v[:, h:h + 1].double())
        del logits
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


# name: (seed, B, Hkv, G, T, D, sinks, window, topk, block_size, dtype, kernel kwargs)
INTERP_CASES = {
    # T not a multiple of the block; budget unsaturated up to q = 23, saturated after; two query blocks' worth of tiles
    "g2_mixed_budget": (0, 2, 2, 2, 75, 16, 4, 8, 12, 16, "fp32", {"block_n": 16}),
    # 4 query heads x 4 queries per program: 4 programs per query block
    "g4_split": (1, 1, 2, 4, 90, 32, 4, 8, 20, 16, "fp32", {"block_m": 16, "block_n": 16}),
    # key tile wider than the query block (the capacity is not a multiple of block_n)
    "g4_wide_tile": (2, 1, 2, 4, 70, 16, 2, 6, 9, 16, "fp32", {"block_m": 64, "block_n": 64}),
    # topk above every eligible count: every causal key, mostly full (unmasked) tiles
    "unsaturated": (3, 1, 2, 2, 60, 16, 4, 8, 500, 16, "fp32", {"block_n": 16}),
    "topk0": (4, 2, 2, 2, 50, 16, 3, 5, 0, 16, "fp32", {"block_n": 16}),
    "window_ge_T": (5, 1, 2, 4, 45, 16, 2, 80, 4, 16, "fp32", {"block_n": 16}),
    "sinks0_window1": (6, 1, 2, 2, 66, 16, 0, 1, 7, 16, "fp32", {"block_n": 16}),
    # G = 3 (padded to 4 rows per query), custom scale, no LSE
    "g3_scale_nolse": (7, 1, 2, 3, 40, 16, 2, 4, 6, 16, "fp32", {"block_n": 16, "scale": 0.7, "return_lse": False}),
    "shorter_than_block": (8, 1, 2, 2, 10, 16, 1, 2, 3, 16, "fp32", {"block_n": 16}),
    # block size not a power of two: rows past the block inside a program are dropped
    "block12": (9, 1, 2, 2, 50, 16, 2, 4, 6, 12, "fp32", {"block_n": 16, "block_m": 32}),
    # q/k/v as [batch, seq, heads, head_dim] memory viewed as [batch, heads, seq, head_dim] (strided heads)
    "seq_major_inputs": (12, 2, 2, 2, 50, 16, 2, 4, 6, 16, "fp32", {"block_n": 16, "seq_major": True}),
    "bf16": (10, 1, 2, 4, 70, 32, 4, 8, 12, 16, "bf16", {"block_n": 16}),
    "fp16": (11, 1, 2, 2, 70, 32, 4, 8, 12, 16, "fp16", {"block_n": 16}),
}
# (out atol/rtol, lse atol/rtol) against float64
TOLERANCES = {"fp32": (1e-4, 1e-4), "bf16": (3e-2, 1e-3), "fp16": (5e-3, 1e-3)}


def run_case(name, device="cpu"):
    """Kernel vs float64 reference: (max |out - ref|, out within tolerance, lse within tolerance or None)."""
    seed, B, Hkv, G, T, D, sinks, window, topk, BS, dtype, kwargs = INTERP_CASES[name]
    q, k, v, ranks, cutoffs, layout = make_inputs(seed, B, Hkv, G, T, D, sinks, window, topk, BS, dtype, device)
    kwargs = dict(kwargs)
    if kwargs.pop("seq_major", False):
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
        assert not q.is_contiguous()
    out, lse = gathered_attention_forward(q, k, v, layout, **kwargs)
    ref_out, ref_lse = dense_reference(q, k, v, ranks, cutoffs, sinks, window, kwargs.get("scale"))
    tol_out, tol_lse = TOLERANCES[dtype]
    assert out.shape == q.shape and out.dtype == q.dtype
    out_ok = torch.allclose(out.double(), ref_out, atol=tol_out, rtol=tol_out)
    if kwargs.get("return_lse", True):
        assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
        lse_err = (lse.double() - ref_lse).abs().max().item()
        lse_ok = torch.allclose(lse.double(), ref_lse, atol=tol_lse, rtol=tol_lse)
    else:
        assert lse is None
        lse_err, lse_ok = None, None
    return {"out_err": (out.double() - ref_out).abs().max().item(), "out_ok": out_ok, "lse_err": lse_err,
            "lse_ok": lse_ok}


@pytest.mark.parametrize("name", list(INTERP_CASES))
def test_interpreter_matches_dense_float64(interpreter_results, name):
    res = interpreter_results[name]
    assert res["out_ok"], res
    assert res["lse_ok"] in (True, None), res
    assert (res["lse_ok"] is None) == (INTERP_CASES[name][-1].get("return_lse", True) is False)


def _small():
    return make_inputs(0, 1, 2, 2, 40, 16, 2, 4, 6, 16)


def test_wide_tile_case_reaches_a_ragged_last_key_tile():
    _, _, _, _, T, _, sinks, window, topk, bs, _, kwargs = INTERP_CASES["g4_wide_tile"]
    capacity = gathered_capacity(T, sinks, window, topk, bs)
    assert capacity % kwargs["block_n"] != 0 and kwargs["block_n"] > bs


def test_bad_inputs_raise_one_line_errors():
    q, k, v, ranks, cutoffs, layout = _small()
    other_T = make_inputs(1, 1, 2, 2, 48, 16, 2, 4, 6, 16)[-1]
    other_heads = make_inputs(1, 1, 1, 4, 40, 16, 2, 4, 6, 16)[-1]
    d24 = torch.randn(1, 4, 40, 24)
    d24_kv = torch.randn(1, 2, 40, 24)
    bad = [
        ((q[0], k, v, layout), {}, "4 dims"),
        ((q, k, v[:, :, :30], layout), {}, "expected the key shape"),
        ((q[:, :, :30], k, v, layout), {}, "key shape"),
        ((q[:, :3], k, v, layout), {}, "divisor of the query heads"),
        ((q.double(), k.double(), v.double(), layout), {}, "dtype torch.float64 is invalid for the Triton kernel"),
        ((q, k.half(), v, layout), {}, "query dtype torch.float32"),
        ((d24, d24_kv, d24_kv, layout), {}, "head_dim=24 is invalid for the Triton kernel"),
        ((q, k, v, "layout"), {}, "GatheredLayout"),
        ((q, k, v, other_T), {}, r"\(1, 2, 48\) is invalid: expected \(1, 2, 40\)"),
        ((q, k, v, other_heads), {}, r"\(1, 1, 40\) is invalid: expected \(1, 2, 40\)"),
        ((q, k, v, layout._replace(index=layout.index.long())), {}, "layout.index"),
        ((q, k, v, layout), {"scale": float("nan")}, "scale=nan"),
        ((q, k, v, layout), {"block_m": 24}, "block_m=24"),
        ((q, k, v, layout), {"block_n": 8}, "block_n=8"),
        ((q, k, v, layout), {"num_warps": 3}, "num_warps=3"),
        ((q, k, v, layout), {"num_stages": 0}, "num_stages=0"),
        ((q, k, v, layout), {"fp32_precision": "tf64"}, "fp32_precision='tf64'"),
        ((q.clone().requires_grad_(), k, v, layout), {}, "forward-only"),
    ]
    for args, kwargs, needle in bad:
        with pytest.raises(KVLearnError, match=needle) as info:
            gathered_attention_forward(*args, **kwargs)
        assert "\n" not in str(info.value)
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1":
        for args in ((q, k, v, layout), (q.clone().requires_grad_(), k, v, layout)):
            with torch.no_grad():  # requires_grad is fine without grad mode: the device check comes next
                with pytest.raises(KVLearnError, match="expected a CUDA tensor") as info:
                    gathered_attention_forward(*args)
            assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------------------------
# CUDA (the device machine: pytest -m gpu)
# ------------------------------------------------------------------------------------------------------------

_GPU_CONFIGS = [
    {},
    {"block_n": 128, "num_stages": 3},
    {"block_m": 64, "num_warps": 4},
    {"block_m": 64, "num_warps": 4, "num_stages": 3},
]


@pytest.mark.gpu
@pytest.mark.parametrize("config", _GPU_CONFIGS, ids=[str(c) or "default" for c in _GPU_CONFIGS])
@pytest.mark.parametrize("T,dtype", [(4096, "bf16"), (4000, "bf16"), (4096, "fp16")])
def test_cuda_matches_dense_float64(T, dtype, config):
    pytest.importorskip("triton")
    from kvlearn.ops.retention_attention import sparse_retention_attention

    sinks, window, topk = 4, 256, 1000
    q, k, v, ranks, cutoffs, layout = make_inputs(T, 1, 8, 4, T, 128, sinks, window, topk, 128, dtype, "cuda")
    with torch.no_grad():
        out, lse = gathered_attention_forward(q, k, v, layout, **config)
        flex_out, flex_lse = sparse_retention_attention(q, k, v, ranks, cutoffs, sinks, window, topk=topk)
    ref_out, ref_lse = dense_reference(q, k, v, ranks, cutoffs, sinks, window)
    tol_out, tol_lse = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), ref_out, atol=tol_out, rtol=tol_out)
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol_lse, rtol=tol_lse)
    # the flex path on the same layout agrees to within the same tolerance
    torch.testing.assert_close(out.float(), flex_out.float(), atol=tol_out, rtol=tol_out)
    torch.testing.assert_close(lse, flex_lse, atol=tol_lse, rtol=tol_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [{}, {"fp32_precision": "tf32", "block_m": 64, "block_n": 32}],
                         ids=["ieee", "tf32"])
def test_cuda_float32(config):
    pytest.importorskip("triton")
    sinks, window, topk = 4, 64, 200
    q, k, v, ranks, cutoffs, layout = make_inputs(7, 2, 2, 4, 1000, 64, sinks, window, topk, 128, "fp32", "cuda")
    with torch.no_grad():
        out, lse = gathered_attention_forward(q, k, v, layout, **config)
    ref_out, ref_lse = dense_reference(q, k, v, ranks, cutoffs, sinks, window)
    tol = 1e-4 if not config else 5e-3  # tf32 dots round the inputs to 10 mantissa bits
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, atol=tol, rtol=tol)


@pytest.mark.gpu
def test_cuda_speed_report():
    """Prints the fused forward against the flex gathered forward and dense causal SDPA (no assertion on speed)."""
    triton = pytest.importorskip("triton")
    import torch.nn.functional as F

    from kvlearn.ops.retention_attention import gathered_plan, sparse_retention_attention

    T, sinks, window, topk = 16384, 4, 256, 1792
    q, k, v, ranks, cutoffs, layout = make_inputs(0, 1, 8, 4, T, 128, sinks, window, topk, 128, "bf16", "cuda")
    plan = gathered_plan(ranks, cutoffs, sinks, window, 4, topk=topk)
    with torch.no_grad():
        fused = triton.testing.do_bench(lambda: gathered_attention_forward(q, k, v, plan.layout))
        flex = triton.testing.do_bench(lambda: sparse_retention_attention(q, k, v, ranks, cutoffs, sinks, window,
                                                                          plan=plan))
        dense = triton.testing.do_bench(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                               enable_gqa=True))
        out, lse = gathered_attention_forward(q, k, v, plan.layout)
        flex_out, flex_lse = sparse_retention_attention(q, k, v, ranks, cutoffs, sinks, window, plan=plan)
    print(f"fused {fused:.3f} ms, flex gathered {flex:.3f} ms, dense causal SDPA {dense:.3f} ms")
    torch.testing.assert_close(out.float(), flex_out.float(), atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(lse, flex_lse, atol=1e-3, rtol=1e-3)
