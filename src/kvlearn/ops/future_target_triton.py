"""Fused Triton kernel of the transposed future-attention pass (KVpop Eq. 31, the ``backend="triton"`` target).

For every query head ``i`` (KV head ``h = i // G``) and original key ``t`` it returns::

    log m̄[b, i, t] = LSE_{d in D_t} ( scale * <q[b, i, d], k[b, h, t]> - lse[b, i, d] )
    D_t = { d : t + w <= d < S }            (lookahead None)
          { d : t + w <= d <= t + w + L }   (lookahead L)

``-inf`` where ``D_t`` is empty. What the FlexAttention version in :mod:`kvlearn.ops.future_target` computes,
without FlexAttention's ``P @ V`` half (only the log-sum-exp is wanted) and without its block mask:

* Grid ``(ceil(S / BLOCK_T), batch * q_heads)``, earliest key blocks first (they have the most future queries).
  A program holds one tile of ``BLOCK_T`` keys of one KV head (loaded once: in the transposed pass the keys are
  the stationary operand) and streams the original queries ``d`` of query head ``i`` in tiles of ``BLOCK_D``,
  from the first tile with ``d >= t0 + w`` to the last one with a ``d`` in any ``D_t`` of the tile.
* Per query tile: ``Q K^T`` with ``tl.dot`` (fp32 accumulate), minus ``lse[d]``, in base 2; an online log-sum-exp
  per key row (running max: the student's sparse ``lse`` does not bound ``<q_d, k_t>`` from above, so a fixed
  offset could overflow). Only the tiles that cut the band's edges evaluate the mask.
* The aggregation over the ``G`` query heads of a KV head, the count normalisation and ``eps`` stay in torch
  (:func:`kvlearn.ops.future_target.future_attention_target`): ``[batch, q_heads, S]`` floats, negligible.

Forward only, no autograd (a supervision target). Runs on CUDA, or on the CPU in Triton's interpreter
(``TRITON_INTERPRET=1`` set before triton is imported; the tests do that in a subprocess).
"""

from __future__ import annotations


import torch
from torch import Tensor

from kvlearn.errors import check
from kvlearn.ops.triton_support import HAS_TRITON as _HAS_TRITON
from kvlearn.ops.triton_support import interpreting as _interpreting
from kvlearn.ops.triton_support import check_kernel_inputs, check_launch
from kvlearn.ops.triton_support import LOG2E, tl, triton

if _HAS_TRITON:
    from kvlearn.ops.triton_support import dot_fp32, finish_lse, online_lse_step

__all__ = ["DEFAULT_CONFIG", "DEFAULT_CONFIG_BAND", "default_config", "future_log_mass_triton"]

# Launch shapes (None arguments take these). Half inputs: the shapes triton.autotune picked among six on the H200 at
# S = 16384 (results/kvpop_ops_h200.json, the rows' `launch`): 128 keys x 64 queries for the full pass, 64 x 64 for a
# lookahead band. Fixed rather than autotuned, so that no training step pays a tuning sweep per new sequence length.
# float32: smaller tiles ("ieee" dots run on FMAs).
DEFAULT_CONFIG = {"block_t": 128, "block_d": 64, "num_warps": 4, "num_stages": 3}
DEFAULT_CONFIG_BAND = {"block_t": 64, "block_d": 64, "num_warps": 4, "num_stages": 3}
DEFAULT_CONFIG_FP32 = {"block_t": 32, "block_d": 32, "num_warps": 4, "num_stages": 2}


if _HAS_TRITON:

    @triton.jit
    def _future_tile(
        m_i,
        l_i,
        k,
        t_pos,
        d0,
        q_base,
        lse_base,
        stride_qt,
        S,
        window,
        lookahead,
        qk_scale,
        offs_d,
        offs_h,
        MASKED: tl.constexpr,
        HAS_LOOKAHEAD: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        DOT_UPCAST: tl.constexpr,
        PEAK: tl.constexpr,
    ):
        """One query tile ``d0 .. d0 + BLOCK_D - 1`` of the online log-sum-exp over ``D_t`` (base 2); with ``PEAK``
        the running maximum alone (``l_i`` passes through: a row saw a kept score iff its maximum rose above the
        initial ``-1e30``, which every finite score does)."""
        d_pos = d0 + offs_d
        if MASKED:
            live = d_pos < S
            q = tl.load(q_base + d_pos[:, None] * stride_qt + offs_h[None, :], mask=live[:, None], other=0.0)
            norm = tl.load(lse_base + d_pos, mask=live, other=0.0)
        else:
            q = tl.load(q_base + d_pos[:, None] * stride_qt + offs_h[None, :])
            norm = tl.load(lse_base + d_pos)
        qk = dot_fp32(k, tl.trans(q), None, DOT_PRECISION, DOT_UPCAST)
        s = qk * qk_scale - norm[None, :]  # log2 domain (the normaliser comes pre-scaled by log2 e)
        if MASKED:
            keep = (d_pos[None, :] >= t_pos[:, None] + window) & (d_pos[None, :] < S)
            if HAS_LOOKAHEAD:
                keep = keep & (d_pos[None, :] <= t_pos[:, None] + window + lookahead)
            s = tl.where(keep, s, float("-inf"))
        if PEAK:  # no exp and no count: one max per element
            m_new = tl.maximum(m_i, tl.max(s, 1))
            l_new = l_i
        else:
            m_new, l_new, _, _ = online_lse_step(m_i, l_i, s)
        return m_new, l_new

    @triton.jit
    def _future_log_mass_kernel(
        q_ptr,  # [B, Hq, S, D]
        k_ptr,  # [B, Hkv, S, D]
        lse_ptr,  # float32 [B, Hq, S], contiguous: the normalisers times log2(e)
        out_ptr,  # float32 [B, Hq, S], contiguous
        stride_qb,
        stride_qh,
        stride_qt,
        stride_kb,
        stride_kh,
        stride_kt,
        S,
        window,
        lookahead,  # the band's L (ignored unless HAS_LOOKAHEAD)
        qk_scale,  # scale * log2(e)
        HQ: tl.constexpr,
        G: tl.constexpr,
        BLOCK_T: tl.constexpr,
        BLOCK_D: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HAS_LOOKAHEAD: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        DOT_UPCAST: tl.constexpr,
        INTERPRET: tl.constexpr,  # `while` loops (the CPU interpreter cannot take runtime `range` bounds)
        PEAK: tl.constexpr,  # the largest score of D_t instead of its log-sum-exp
    ):
        t0 = tl.program_id(0) * BLOCK_T  # earliest key blocks (the longest) are launched first
        bi = tl.program_id(1)
        b = (bi // HQ).to(tl.int64)
        i = bi % HQ
        h = i // G

        offs_t = tl.arange(0, BLOCK_T)
        offs_d = tl.arange(0, BLOCK_D)
        offs_h = tl.arange(0, HEAD_DIM)
        t_pos = t0 + offs_t
        k_rows = k_ptr + b * stride_kb + h.to(tl.int64) * stride_kh + t_pos.to(tl.int64) * stride_kt
        k = tl.load(k_rows[:, None] + offs_h[None, :], mask=(t_pos < S)[:, None], other=0.0)
        q_base = q_ptr + b * stride_qb + i.to(tl.int64) * stride_qh
        lse_base = lse_ptr + (b * HQ + i) * S

        # query tiles [d_lo, d_hi): from the first d of the first row's band to the last d of the last row's band
        d_lo = ((t0 + window) // BLOCK_D) * BLOCK_D
        if HAS_LOOKAHEAD:
            d_hi = tl.minimum(S, t0 + BLOCK_T - 1 + window + lookahead + 1)
            full_lo = tl.minimum(((t0 + BLOCK_T - 1 + window + BLOCK_D - 1) // BLOCK_D) * BLOCK_D, d_hi)
            full_hi = tl.maximum(full_lo, tl.minimum(((t0 + window + lookahead + 1) // BLOCK_D) * BLOCK_D,
                                                     (S // BLOCK_D) * BLOCK_D))
        else:
            d_hi = S
            full_lo = tl.minimum(((t0 + BLOCK_T - 1 + window + BLOCK_D - 1) // BLOCK_D) * BLOCK_D, d_hi)
            full_hi = tl.maximum(full_lo, (S // BLOCK_D) * BLOCK_D)
        # [d_lo, full_lo): tiles cutting the band's start; [full_lo, full_hi): every (t, d) kept; [full_hi, d_hi): end

        m_i = tl.full([BLOCK_T], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_T], dtype=tl.float32)
        if INTERPRET:
            d0 = d_lo
            while d0 < full_lo:
                m_i, l_i = _future_tile(m_i, l_i, k, t_pos, d0, q_base, lse_base, stride_qt, S, window, lookahead,
                                        qk_scale, offs_d, offs_h, True, HAS_LOOKAHEAD, DOT_PRECISION, DOT_UPCAST, PEAK)
                d0 += BLOCK_D
            while d0 < full_hi:
                m_i, l_i = _future_tile(m_i, l_i, k, t_pos, d0, q_base, lse_base, stride_qt, S, window, lookahead,
                                        qk_scale, offs_d, offs_h, False, HAS_LOOKAHEAD, DOT_PRECISION, DOT_UPCAST, PEAK)
                d0 += BLOCK_D
            while d0 < d_hi:
                m_i, l_i = _future_tile(m_i, l_i, k, t_pos, d0, q_base, lse_base, stride_qt, S, window, lookahead,
                                        qk_scale, offs_d, offs_h, True, HAS_LOOKAHEAD, DOT_PRECISION, DOT_UPCAST, PEAK)
                d0 += BLOCK_D
        else:
            for d0 in range(d_lo, full_lo, BLOCK_D):
                m_i, l_i = _future_tile(m_i, l_i, k, t_pos, d0, q_base, lse_base, stride_qt, S, window, lookahead,
                                        qk_scale, offs_d, offs_h, True, HAS_LOOKAHEAD, DOT_PRECISION, DOT_UPCAST, PEAK)
            for d0 in range(full_lo, full_hi, BLOCK_D):
                m_i, l_i = _future_tile(m_i, l_i, k, t_pos, d0, q_base, lse_base, stride_qt, S, window, lookahead,
                                        qk_scale, offs_d, offs_h, False, HAS_LOOKAHEAD, DOT_PRECISION, DOT_UPCAST, PEAK)
            for d0 in range(full_hi, d_hi, BLOCK_D):
                m_i, l_i = _future_tile(m_i, l_i, k, t_pos, d0, q_base, lse_base, stride_qt, S, window, lookahead,
                                        qk_scale, offs_d, offs_h, True, HAS_LOOKAHEAD, DOT_PRECISION, DOT_UPCAST, PEAK)

        if PEAK:  # empty D_t: the maximum stayed at its initial -1e30 (masked scores are -inf)
            result = tl.where(m_i > -1.0e29, m_i * 0.6931471805599453, float("-inf"))  # base 2 -> natural log
        else:
            result = finish_lse(m_i, l_i)
        tl.store(out_ptr + (b * HQ + i) * S + t_pos, result, mask=t_pos < S)


def default_config(dtype: torch.dtype, lookahead: bool) -> dict:
    """The launch shape used when the tunables are None (a copy)."""
    if dtype == torch.float32:
        return dict(DEFAULT_CONFIG_FP32)
    return dict(DEFAULT_CONFIG_BAND if lookahead else DEFAULT_CONFIG)


def future_log_mass_triton(
    query: Tensor,
    key: Tensor,
    lse: Tensor,
    window: int,
    scale: float,
    lookahead: int | None = None,
    *,
    block_t: int | None = None,
    block_d: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fp32_precision: str = "ieee",
    peak: bool = False,
) -> Tensor:
    """``log m̄`` per query head by the fused transposed pass (see the module docstring); with ``peak`` the log of
    the largest single probability instead, ``max_{d in D_t} (scale * <q_d, k_t> - lse_d)``.

    The shape checks on ``query``/``key``/``lse``/``window``/``scale``/``lookahead`` are those of
    :func:`kvlearn.ops.future_target.future_attention_target`, which calls this with ``backend="triton"``
    (or ``"auto"`` on CUDA); the checks here are those only the kernel needs.

    Args:
        query: ``[batch, q_heads, S, head_dim]`` bfloat16 / float16 / float32, head_dim a power of two in [16, 256].
        key: ``[batch, kv_heads, S, head_dim]`` same dtype and device; ``q_heads = G * kv_heads``.
        lse: float32 ``[batch, q_heads, S]``, the original queries' normalisers.
        window: ``w >= 1``. scale: the logit scale. lookahead: None or ``L >= 0``.
        block_t, block_d: keys per program and queries per tile (powers of two >= 16). num_warps, num_stages:
            the launch's. None takes :func:`default_config`.
        fp32_precision: ``tl.dot`` input precision for float32 inputs (``"ieee"`` exact, ``"tf32"`` faster).

    Returns:
        float32 ``[batch, q_heads, S]``, natural log; ``-inf`` for keys with no query in their band.
    """
    check(isinstance(peak, bool), f"peak={peak!r} is invalid: expected True or False")
    check(_HAS_TRITON, "backend='triton' is unavailable: triton is not installed (use backend='flex' or 'torch')")
    check(query.is_cuda or _interpreting(),
          f"device {query.device} is invalid for backend='triton': expected a CUDA tensor "
          "(or TRITON_INTERPRET=1 to run the kernel on the CPU)")
    check(key.dtype == query.dtype, f"query/key dtype={query.dtype}/{key.dtype} is invalid for backend='triton': "
                                    "expected the same dtype")
    B, Hq, S, D = query.shape
    Hkv = key.shape[1]
    check_kernel_inputs(query.dtype, D)
    defaults = default_config(query.dtype, lookahead is not None)
    block_t = defaults["block_t"] if block_t is None else block_t
    block_d = defaults["block_d"] if block_d is None else block_d
    num_warps = defaults["num_warps"] if num_warps is None else num_warps
    num_stages = defaults["num_stages"] if num_stages is None else num_stages
    check_launch(num_warps, num_stages, fp32_precision, block_t=block_t, block_d=block_d)
    q, k = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key))
    for name, x in (("query", q), ("key", k)):
        check(S * x.stride(2) + D < 2**31,
              f"{name} with seq stride {x.stride(2)} x S={S} is invalid: expected per-head offsets below 2^31")
    lse2 = (lse.float() * LOG2E).contiguous()  # base 2, pre-scaled once here instead of per tile; rows of S
    out = torch.empty((B, Hq, S), dtype=torch.float32, device=query.device)
    if out.numel() == 0:
        return out
    args = (q, k, lse2, out, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            S, window, 0 if lookahead is None else lookahead, float(scale) * LOG2E)
    meta = dict(HQ=Hq, G=Hq // Hkv, HEAD_DIM=D, HAS_LOOKAHEAD=lookahead is not None,
                DOT_PRECISION=fp32_precision if query.dtype == torch.float32 else "tf32",
                DOT_UPCAST=_interpreting() and query.dtype == torch.bfloat16, INTERPRET=_interpreting(), PEAK=bool(peak))
    _future_log_mass_kernel[(triton.cdiv(S, block_t), B * Hq)](
        *args, BLOCK_T=block_t, BLOCK_D=block_d, **meta, num_warps=num_warps, num_stages=num_stages)
    return out
