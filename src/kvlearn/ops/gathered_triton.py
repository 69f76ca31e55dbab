"""Fused Triton forward of sparse retention attention on the interval-gathered layout (inference / no-grad path).

:func:`gathered_attention_forward` computes what FlexAttention with :func:`kvlearn.ops.gathered.gathered_block_mask`
computes on the gathered keys (``kvlearn.ops.retention_attention.sparse_retention_attention(..., layout="gathered")``),
without materialising the gathered keys and values and with one key tile serving every query head of a GQA group:

* Grid ``(num_blocks * split, batch * kv_heads)``. A program owns ``BLOCK_M = G_P2 * QPP`` rows: the ``G`` query
  heads of one KV head (``G_P2 = next_pow2(G)``, the extra rows are masked) times ``QPP`` consecutive queries of
  one query block (``split = ceil(block_size / QPP)`` programs per block, adjacent in launch order so they share
  the block's key rows in L2). Rows are head-major: row ``r`` is head ``r // QPP``, query ``r % QPP``.
* The program loops over the block's slots in tiles of ``BLOCK_N``: it loads the tile's slot indices and gathers
  the K/V rows through them (a pointer gather: nothing is copied), computes ``Q K^T`` in fp32 with ``tl.dot``,
  and runs the online softmax in base 2 (``scale * log2(e)`` folded into the logits). Tiles entirely inside
  ``[0, num_full)`` (keys visible to every query of the block) run without any mask; the tiles from there up to
  ``ceil(num_used / BLOCK_N)`` apply the visibility interval ``key_pos <= q < key_end``; nothing past them runs.
* Out (query dtype) and the natural-log LSE (float32) are written for the real rows only (padded query rows of
  the last block and the padding heads of ``G_P2 > G`` are computed and dropped).

Forward only: under grad mode with an input that requires grad it raises (training keeps the FlexAttention
path, whose backward exists). Runs on CUDA, or on the CPU in Triton's interpreter (``TRITON_INTERPRET=1``, set
before triton is imported; the tests do that in a subprocess).

Tunables (keyword arguments, for sweeps on the GPU): ``block_m`` (rows per program, ``G_P2 * QPP``), ``block_n``
(slots per tile), ``num_warps``, ``num_stages`` (software pipelining depth of the two tile loops), and
``fp32_precision`` (``tl.dot`` input precision for float32 inputs: ``"ieee"`` or ``"tf32"``). ``None`` takes
:data:`DEFAULT_CONFIGS` for the input dtype.
"""

from __future__ import annotations

import math

import torch

from kvlearn.errors import check
from kvlearn.ops.triton_support import HAS_TRITON as _HAS_TRITON
from kvlearn.ops.triton_support import interpreting as _interpreting
from kvlearn.ops.triton_support import LOG2E
from kvlearn.ops.triton_support import dot_fp32 as _dot
from kvlearn.ops.triton_support import check_kernel_inputs, check_launch
from kvlearn.ops.triton_support import tl, triton

if _HAS_TRITON:
    from kvlearn.ops.triton_support import finish_lse, online_lse_step
from kvlearn.ops.flex import check_qkv
from kvlearn.ops.gathered_layout import GatheredLayout


# Launch defaults per input dtype (None arguments take these). Half: the fastest of the H200 sweep
# (results/raw/kvpop_attention_sweep_h200_728ccb0.json: 128 x 128 tiles, 8 warps, 2 stages, fastest at k = 1792 and
# 2016 and at query blocks of 64 and 128). float32 with "ieee" dots runs on FMAs and spills at the half shape:
# smaller tiles.
DEFAULT_CONFIGS = {
    "half": {"block_m": 128, "block_n": 128, "num_warps": 8, "num_stages": 2},
    "float32": {"block_m": 32, "block_n": 32, "num_warps": 4, "num_stages": 2},
}


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


if _HAS_TRITON:

    @triton.jit
    def _gathered_tile(
        acc,
        l_i,
        m_i,
        q,
        q_pos,
        start,
        slot_idx_ptr,  # int32 [C] slot -> key position, this (batch, kv head, block)
        slot_pos_ptr,  # int32 [C] key_pos
        slot_end_ptr,  # int32 [C] key_end
        k_base,
        v_base,
        stride_kt,
        stride_vt,
        n_used,
        qk_scale,
        offs_n,
        offs_d,
        MASKED: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        DOT_UPCAST: tl.constexpr,
    ):
        """One slot tile of the online softmax; ``MASKED`` applies the visibility intervals and ``num_used``."""
        slots = start + offs_n
        if MASKED:
            live = slots < n_used
            idx = tl.load(slot_idx_ptr + slots, mask=live, other=0)
            kpos = tl.load(slot_pos_ptr + slots, mask=live, other=0)
            kend = tl.load(slot_end_ptr + slots, mask=live, other=0)  # key_end 0: never visible
            k = tl.load(k_base + idx[:, None] * stride_kt + offs_d[None, :], mask=live[:, None], other=0.0)
            v = tl.load(v_base + idx[:, None] * stride_vt + offs_d[None, :], mask=live[:, None], other=0.0)
        else:
            idx = tl.load(slot_idx_ptr + slots)
            k = tl.load(k_base + idx[:, None] * stride_kt + offs_d[None, :])
            v = tl.load(v_base + idx[:, None] * stride_vt + offs_d[None, :])
        qk = _dot(q, tl.trans(k), None, DOT_PRECISION, DOT_UPCAST)
        qk = qk * qk_scale  # log2 domain, fp32
        if MASKED:
            visible = (kpos[None, :] <= q_pos[:, None]) & (q_pos[:, None] < kend[None, :])
            qk = tl.where(visible, qk, float("-inf"))
        m_new, l_i, alpha, p = online_lse_step(m_i, l_i, qk)
        acc = acc * alpha[:, None]
        acc = _dot(p.to(v.dtype), v, acc, DOT_PRECISION, DOT_UPCAST)
        return acc, l_i, m_new

    @triton.jit
    def _gathered_fwd_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        out_ptr,
        lse_ptr,  # float32 [B, Hq, T] (unused unless STORE_LSE)
        index_ptr,  # int32 [B, Hkv, nQ, C]
        key_pos_ptr,
        key_end_ptr,
        num_full_ptr,  # int32 [B, Hkv, nQ]
        num_used_ptr,
        stride_qb,
        stride_qh,
        stride_qt,
        stride_kb,
        stride_kh,
        stride_kt,
        stride_vb,
        stride_vh,
        stride_vt,
        stride_ob,
        stride_oh,
        stride_ot,
        T,
        n_blocks,
        capacity,
        qk_scale,  # scale * log2(e)
        HKV: tl.constexpr,
        G: tl.constexpr,
        BS: tl.constexpr,  # the layout's query block size
        SPLIT: tl.constexpr,  # programs per query block
        QPP: tl.constexpr,  # queries per program (power of two)
        BLOCK_M: tl.constexpr,  # G_P2 * QPP
        BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        STORE_LSE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        DOT_UPCAST: tl.constexpr,  # interpreter + bfloat16 only (see _dot)
        INTERPRET: tl.constexpr,  # `while` loops (the CPU interpreter cannot take runtime `range` bounds)
    ):
        pid = tl.program_id(0)
        # latest query blocks first: they hold the most slots, the short early blocks fill the tail
        blk = n_blocks - 1 - pid // SPLIT
        sub = pid % SPLIT
        bh = tl.program_id(1)
        b = (bh // HKV).to(tl.int64)
        h = bh % HKV

        rows = tl.arange(0, BLOCK_M)
        g = rows // QPP  # query head within the group
        local = sub * QPP + rows % QPP  # query offset within the block
        q_pos = blk * BS + local  # absolute query position
        row_ok = (g < G) & (local < BS) & (q_pos < T)
        head = (h * G + g).to(tl.int64)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_n = tl.arange(0, BLOCK_N)

        q_rows = q_ptr + b * stride_qb + head * stride_qh + q_pos * stride_qt
        q = tl.load(q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)

        k_base = k_ptr + b * stride_kb + h.to(tl.int64) * stride_kh
        v_base = v_ptr + b * stride_vb + h.to(tl.int64) * stride_vh
        lay = (bh.to(tl.int64) * n_blocks + blk) * capacity  # (b, h) flattened = bh: layout is [B, Hkv, nQ, C]
        slot_idx_ptr = index_ptr + lay
        slot_pos_ptr = key_pos_ptr + lay
        slot_end_ptr = key_end_ptr + lay
        cnt = bh.to(tl.int64) * n_blocks + blk
        n_full = tl.load(num_full_ptr + cnt)
        n_used = tl.load(num_used_ptr + cnt)
        full_end = (n_full // BLOCK_N) * BLOCK_N  # tiles below this are visible to every query: no mask

        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

        if INTERPRET:
            start = full_end * 0
            while start < full_end:
                acc, l_i, m_i = _gathered_tile(acc, l_i, m_i, q, q_pos, start, slot_idx_ptr, slot_pos_ptr,
                                               slot_end_ptr, k_base, v_base, stride_kt, stride_vt, n_used, qk_scale,
                                               offs_n, offs_d, False, DOT_PRECISION, DOT_UPCAST)
                start += BLOCK_N
            while start < n_used:
                acc, l_i, m_i = _gathered_tile(acc, l_i, m_i, q, q_pos, start, slot_idx_ptr, slot_pos_ptr,
                                               slot_end_ptr, k_base, v_base, stride_kt, stride_vt, n_used, qk_scale,
                                               offs_n, offs_d, True, DOT_PRECISION, DOT_UPCAST)
                start += BLOCK_N
        else:
            for start in range(0, full_end, BLOCK_N):
                acc, l_i, m_i = _gathered_tile(acc, l_i, m_i, q, q_pos, start, slot_idx_ptr, slot_pos_ptr,
                                               slot_end_ptr, k_base, v_base, stride_kt, stride_vt, n_used, qk_scale,
                                               offs_n, offs_d, False, DOT_PRECISION, DOT_UPCAST)
            for start in range(full_end, n_used, BLOCK_N):
                acc, l_i, m_i = _gathered_tile(acc, l_i, m_i, q, q_pos, start, slot_idx_ptr, slot_pos_ptr,
                                               slot_end_ptr, k_base, v_base, stride_kt, stride_vt, n_used, qk_scale,
                                               offs_n, offs_d, True, DOT_PRECISION, DOT_UPCAST)

        seen = l_i > 0.0  # every real row sees at least itself
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        o_rows = out_ptr + b * stride_ob + head * stride_oh + q_pos * stride_ot
        tl.store(o_rows[:, None] + offs_d[None, :], out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        if STORE_LSE:
            lse = finish_lse(m_i, l_i)
            tl.store(lse_ptr + (b * (HKV * G) + head) * T + q_pos, lse, mask=row_ok)


def _check_inputs(query, key, value, layout, scale, block_m, block_n, num_warps, num_stages, fp32_precision) -> None:
    B, _, Hkv, T, D = check_qkv(query, key, value)
    check_kernel_inputs(query.dtype, D)
    check(isinstance(layout, GatheredLayout),
          f"layout of type {type(layout).__name__} is invalid: expected a GatheredLayout")
    Bl, Hl, nQ, C = layout.index.shape
    BS = layout.block_size
    check((Bl, Hl, layout.seq_len) == (B, Hkv, T),
          f"layout for (batch, kv_heads, seq)={(Bl, Hl, layout.seq_len)} is invalid: expected {(B, Hkv, T)}")
    check(nQ == -(-T // BS) and C == layout.capacity,
          f"layout with {nQ} blocks x {C} slots is invalid: expected ceil(T / block_size)={-(-T // BS)} blocks x "
          f"capacity={layout.capacity} slots")
    for name in ("index", "key_pos", "key_end", "num_full", "num_used"):
        x = getattr(layout, name)
        want = (B, Hkv, nQ, C) if name in ("index", "key_pos", "key_end") else (B, Hkv, nQ)
        check(x.dtype == torch.int32 and tuple(x.shape) == want and x.device == query.device,
              f"layout.{name} ({x.dtype}, {tuple(x.shape)}, {x.device}) is invalid: "
              f"expected int32 {want} on {query.device}")
    check(isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale),
          f"scale={scale!r} is invalid: expected a finite number")
    check_launch(num_warps, num_stages, fp32_precision, block_m=block_m, block_n=block_n)
    limit = 2**31
    for name, x in (("query", query), ("key", key), ("value", value)):
        check(T * x.stride(2) + D < limit,
              f"{name} with seq stride {x.stride(2)} x T={T} is invalid: expected per-head offsets below 2^31")
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value))
    check(not needs_grad, "inputs that require grad are invalid: gathered_attention_forward is forward-only "
                          "(use torch.no_grad() / inference_mode, or sparse_retention_attention for training)")
    check(_HAS_TRITON, "gathered_attention_forward is unavailable: triton is not installed")
    check(query.is_cuda or _interpreting(),
          f"device {query.device} is invalid: expected a CUDA tensor (or TRITON_INTERPRET=1 to run on the CPU)")


def gathered_attention_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: GatheredLayout,
    scale: float | None = None,
    return_lse: bool = True,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fp32_precision: str = "ieee",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sparse attention on the interval-gathered layout, fused (gather through the slot index, GQA-packed rows).

    Args:
        query: ``[batch, q_heads, T, head_dim]``, bfloat16 / float16 / float32, head_dim a power of two in [16, 256].
        key, value: ``[batch, kv_heads, T, head_dim]``, same dtype/device; ``q_heads = G * kv_heads``.
        layout: :func:`kvlearn.ops.gathered.gathered_layout` for these ``(batch, kv_heads, T)`` (any block size).
        scale: logit scale, default ``1 / sqrt(head_dim)``.
        return_lse: also return the natural-log LSE.
        block_m: rows per program, a power of two >= 16: ``next_pow2(G) x QPP`` with ``QPP = block_m //
            next_pow2(G)`` queries of one block (capped at ``next_pow2(block_size)``; raised so that ``BLOCK_M >=
            16``, so at least ``next_pow2(G)`` rows); ``ceil(block_size / QPP)`` programs per query block.
        block_n: slots per key tile (power of two >= 16). num_warps, num_stages: the launch's.
            None (any of the four): :data:`DEFAULT_CONFIGS` for the input dtype.
        fp32_precision: ``tl.dot`` input precision for float32 inputs (``"ieee"`` exact, ``"tf32"`` faster).

    Returns:
        ``(out [batch, q_heads, T, head_dim] in the query dtype, lse float32 [batch, q_heads, T] or None)``.
        Inputs must not require grad under grad mode (forward only).
    """
    if isinstance(query, torch.Tensor) and query.dim() == 4:
        if scale is None:
            scale = query.shape[-1] ** -0.5
        defaults = DEFAULT_CONFIGS["float32" if query.dtype == torch.float32 else "half"]
        block_m = defaults["block_m"] if block_m is None else block_m
        block_n = defaults["block_n"] if block_n is None else block_n
        num_warps = defaults["num_warps"] if num_warps is None else num_warps
        num_stages = defaults["num_stages"] if num_stages is None else num_stages
    _check_inputs(query, key, value, layout, scale, block_m, block_n, num_warps, num_stages, fp32_precision)
    B, Hq, T, D = query.shape
    Hkv = key.shape[1]
    G = Hq // Hkv
    BS, nQ, C = layout.block_size, layout.num_blocks, layout.capacity
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value))
    out = torch.empty((B, Hq, T, D), dtype=query.dtype, device=query.device)
    lse = torch.empty((B, Hq, T), dtype=torch.float32, device=query.device) if return_lse else out
    if out.numel() == 0:
        return out, (lse if return_lse else None)
    g_p2 = _next_pow2(G)
    qpp = min(max(1, block_m // g_p2), _next_pow2(BS))
    qpp = max(qpp, max(1, 16 // g_p2))  # tl.dot needs M >= 16
    split = -(-BS // qpp)
    lay = [x.contiguous() for x in (layout.index, layout.key_pos, layout.key_end, layout.num_full, layout.num_used)]
    grid = (nQ * split, B * Hkv)
    _gathered_fwd_kernel[grid](
        q, k, v, out, lse, *lay,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        T, nQ, C, float(scale) * LOG2E,
        HKV=Hkv, G=G, BS=BS, SPLIT=split, QPP=qpp, BLOCK_M=g_p2 * qpp, BLOCK_N=block_n, HEAD_DIM=D,
        STORE_LSE=return_lse,
        DOT_PRECISION=fp32_precision if query.dtype == torch.float32 else "tf32",  # "tf32": the default (half inputs)
        DOT_UPCAST=_interpreting() and query.dtype == torch.bfloat16,
        INTERPRET=_interpreting(),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out, (lse if return_lse else None)


__all__ = ["DEFAULT_CONFIGS", "gathered_attention_forward"]
