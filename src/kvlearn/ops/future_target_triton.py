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

import math

import torch
from torch import Tensor

from kvlearn.errors import check
from kvlearn.ops.triton_support import HAS_TRITON as _HAS_TRITON
from kvlearn.ops.triton_support import interpreting as _interpreting
from kvlearn.ops.triton_support import is_pow2 as _is_pow2
from kvlearn.ops.triton_support import tl, triton

if _HAS_TRITON:
    from kvlearn.ops.triton_support import dot_fp32

__all__ = ["AUTOTUNE_CONFIGS", "DEFAULT_CONFIG", "DTYPES", "autotuned_config", "future_log_mass_triton", "supports"]

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Launch shapes. On CUDA with every tunable left None and half inputs, the kernel is autotuned over
# AUTOTUNE_CONFIGS once per (S, head_dim, G, lookahead or not) and process (triton.autotune: each candidate is timed
# on the first call); otherwise None arguments take DEFAULT_CONFIG (float32: DEFAULT_CONFIG_FP32, smaller tiles:
# "ieee" dots run on FMAs).
DEFAULT_CONFIG = {"block_t": 128, "block_d": 64, "num_warps": 4, "num_stages": 3}
DEFAULT_CONFIG_FP32 = {"block_t": 32, "block_d": 32, "num_warps": 4, "num_stages": 2}
AUTOTUNE_CONFIGS = (
    {"block_t": 128, "block_d": 64, "num_warps": 4, "num_stages": 3},
    {"block_t": 128, "block_d": 64, "num_warps": 8, "num_stages": 3},
    {"block_t": 128, "block_d": 128, "num_warps": 8, "num_stages": 2},
    {"block_t": 128, "block_d": 32, "num_warps": 4, "num_stages": 4},
    {"block_t": 64, "block_d": 64, "num_warps": 4, "num_stages": 3},
    {"block_t": 64, "block_d": 128, "num_warps": 4, "num_stages": 2},
)
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453


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
    ):
        """One query tile ``d0 .. d0 + BLOCK_D - 1`` of the online log-sum-exp over ``D_t`` (base 2)."""
        d_pos = d0 + offs_d
        if MASKED:
            live = d_pos < S
            q = tl.load(q_base + d_pos[:, None] * stride_qt + offs_h[None, :], mask=live[:, None], other=0.0)
            norm = tl.load(lse_base + d_pos, mask=live, other=0.0)
        else:
            q = tl.load(q_base + d_pos[:, None] * stride_qt + offs_h[None, :])
            norm = tl.load(lse_base + d_pos)
        qk = dot_fp32(k, tl.trans(q), None, DOT_PRECISION, DOT_UPCAST)
        s = qk * qk_scale - (norm * 1.4426950408889634)[None, :]  # log2 domain
        if MASKED:
            keep = (d_pos[None, :] >= t_pos[:, None] + window) & (d_pos[None, :] < S)
            if HAS_LOOKAHEAD:
                keep = keep & (d_pos[None, :] <= t_pos[:, None] + window + lookahead)
            s = tl.where(keep, s, float("-inf"))
        # m_i starts finite (-1e30): a row with nothing kept yet keeps alpha = 1 and p = 0 (no NaN)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        l_i = l_i * tl.math.exp2(m_i - m_new) + tl.sum(tl.math.exp2(s - m_new[:, None]), 1)
        return m_new, l_i

    @triton.jit
    def _future_log_mass_kernel(
        q_ptr,  # [B, Hq, S, D]
        k_ptr,  # [B, Hkv, S, D]
        lse_ptr,  # float32 [B, Hq, S], contiguous
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
                                        qk_scale, offs_d, offs_h, True, HAS_LOOKAHEAD, DOT_PRECISION, DOT_UPCAST)
                d0 += BLOCK_D
            while d0 < full_hi:
                m_i, l_i = _future_tile(m_i, l_i, k, t_pos, d0, q_base, lse_base, stride_qt, S, window, lookahead,
                                        qk_scale, offs_d, offs_h, False, HAS_LOOKAHEAD, DOT_PRECISION, DOT_UPCAST)
                d0 += BLOCK_D
            while d0 < d_hi:
                m_i, l_i = _future_tile(m_i, l_i, k, t_pos, d0, q_base, lse_base, stride_qt, S, window, lookahead,
                                        qk_scale, offs_d, offs_h, True, HAS_LOOKAHEAD, DOT_PRECISION, DOT_UPCAST)
                d0 += BLOCK_D
        else:
            for d0 in range(d_lo, full_lo, BLOCK_D):
                m_i, l_i = _future_tile(m_i, l_i, k, t_pos, d0, q_base, lse_base, stride_qt, S, window, lookahead,
                                        qk_scale, offs_d, offs_h, True, HAS_LOOKAHEAD, DOT_PRECISION, DOT_UPCAST)
            for d0 in range(full_lo, full_hi, BLOCK_D):
                m_i, l_i = _future_tile(m_i, l_i, k, t_pos, d0, q_base, lse_base, stride_qt, S, window, lookahead,
                                        qk_scale, offs_d, offs_h, False, HAS_LOOKAHEAD, DOT_PRECISION, DOT_UPCAST)
            for d0 in range(full_hi, d_hi, BLOCK_D):
                m_i, l_i = _future_tile(m_i, l_i, k, t_pos, d0, q_base, lse_base, stride_qt, S, window, lookahead,
                                        qk_scale, offs_d, offs_h, True, HAS_LOOKAHEAD, DOT_PRECISION, DOT_UPCAST)

        seen = l_i > 0.0
        out = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(out_ptr + (b * HQ + i) * S + t_pos, out, mask=t_pos < S)

    _future_log_mass_autotuned = triton.autotune(
        configs=[triton.Config({"BLOCK_T": c["block_t"], "BLOCK_D": c["block_d"]}, num_warps=c["num_warps"],
                               num_stages=c["num_stages"]) for c in AUTOTUNE_CONFIGS],
        key=["S", "HEAD_DIM", "G", "HAS_LOOKAHEAD"],
    )(_future_log_mass_kernel)


def supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel takes inputs of this dtype and head_dim (``backend="auto"`` falls back to flex otherwise)."""
    return dtype in DTYPES and _is_pow2(head_dim) and 16 <= head_dim <= 256


def _check_tunables(block_t, block_d, num_warps, num_stages, fp32_precision) -> None:
    check(_is_pow2(block_t) and block_t >= 16, f"block_t={block_t!r} is invalid: expected a power of two >= 16")
    check(_is_pow2(block_d) and block_d >= 16, f"block_d={block_d!r} is invalid: expected a power of two >= 16")
    check(_is_pow2(num_warps) and num_warps <= 32, f"num_warps={num_warps!r} is invalid: expected a power of two <= 32")
    check(isinstance(num_stages, int) and not isinstance(num_stages, bool) and num_stages >= 1,
          f"num_stages={num_stages!r} is invalid: expected an integer >= 1")
    check(fp32_precision in ("ieee", "tf32"),
          f"fp32_precision={fp32_precision!r} is invalid: expected one of ('ieee', 'tf32')")


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
) -> Tensor:
    """``log m̄`` per query head by the fused transposed pass (see the module docstring).

    The shape checks on ``query``/``key``/``lse``/``window``/``scale``/``lookahead`` are those of
    :func:`kvlearn.ops.future_target.future_attention_target`, which calls this with ``backend="triton"``
    (or ``"auto"`` on CUDA); the checks here are those only the kernel needs.

    Args:
        query: ``[batch, q_heads, S, head_dim]`` bfloat16 / float16 / float32, head_dim a power of two in [16, 256].
        key: ``[batch, kv_heads, S, head_dim]`` same dtype and device; ``q_heads = G * kv_heads``.
        lse: float32 ``[batch, q_heads, S]``, the original queries' normalisers.
        window: ``w >= 1``. scale: the logit scale. lookahead: None or ``L >= 0``.
        block_t, block_d: keys per program and queries per tile (powers of two >= 16). num_warps, num_stages:
            the launch's. All four None with half inputs on CUDA: autotuned over :data:`AUTOTUNE_CONFIGS`;
            otherwise None takes :data:`DEFAULT_CONFIG` (float32 inputs: ``DEFAULT_CONFIG_FP32``).
        fp32_precision: ``tl.dot`` input precision for float32 inputs (``"ieee"`` exact, ``"tf32"`` faster).

    Returns:
        float32 ``[batch, q_heads, S]``, natural log; ``-inf`` for keys with no query in their band.
    """
    check(_HAS_TRITON, "backend='triton' is unavailable: triton is not installed (use backend='flex' or 'torch')")
    check(query.is_cuda or _interpreting(),
          f"device {query.device} is invalid for backend='triton': expected a CUDA tensor "
          "(or TRITON_INTERPRET=1 to run the kernel on the CPU)")
    check(query.dtype in DTYPES and key.dtype == query.dtype,
          f"query/key dtype={query.dtype}/{key.dtype} is invalid for backend='triton': expected one of "
          "bfloat16, float16, float32, the same for both")
    B, Hq, S, D = query.shape
    Hkv = key.shape[1]
    check(_is_pow2(D) and 16 <= D <= 256,
          f"head_dim={D} is invalid for backend='triton': expected a power of two in [16, 256]")
    autotune = (query.is_cuda and not _interpreting() and query.dtype != torch.float32
                and all(x is None for x in (block_t, block_d, num_warps, num_stages)))
    defaults = DEFAULT_CONFIG_FP32 if query.dtype == torch.float32 else DEFAULT_CONFIG
    block_t = defaults["block_t"] if block_t is None else block_t
    block_d = defaults["block_d"] if block_d is None else block_d
    num_warps = defaults["num_warps"] if num_warps is None else num_warps
    num_stages = defaults["num_stages"] if num_stages is None else num_stages
    _check_tunables(block_t, block_d, num_warps, num_stages, fp32_precision)
    q, k = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key))
    for name, x in (("query", q), ("key", k)):
        check(S * x.stride(2) + D < 2**31,
              f"{name} with seq stride {x.stride(2)} x S={S} is invalid: expected per-head offsets below 2^31")
    lse32 = lse.float().contiguous()
    out = torch.empty((B, Hq, S), dtype=torch.float32, device=query.device)
    if out.numel() == 0:
        return out
    args = (q, k, lse32, out, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            S, window, 0 if lookahead is None else lookahead, float(scale) * _LOG2E)
    meta = dict(HQ=Hq, G=Hq // Hkv, HEAD_DIM=D, HAS_LOOKAHEAD=lookahead is not None,
                DOT_PRECISION=fp32_precision if query.dtype == torch.float32 else "tf32",
                DOT_UPCAST=_interpreting() and query.dtype == torch.bfloat16, INTERPRET=_interpreting())
    if autotune:
        _future_log_mass_autotuned[lambda m: (triton.cdiv(S, m["BLOCK_T"]), B * Hq)](*args, **meta)
    else:
        _future_log_mass_kernel[(triton.cdiv(S, block_t), B * Hq)](
            *args, BLOCK_T=block_t, BLOCK_D=block_d, **meta, num_warps=num_warps, num_stages=num_stages)
    return out


def autotuned_config(seq_len: int, head_dim: int, query_heads_per_kv: int, lookahead: bool) -> dict | None:
    """The launch shape the autotuner picked for these keys in this process (None before the first call)."""
    if not _HAS_TRITON:
        return None
    for key, cfg in _future_log_mass_autotuned.cache.items():
        if tuple(key[:4]) == (seq_len, head_dim, query_heads_per_kv, lookahead):
            return {"block_t": cfg.kwargs["BLOCK_T"], "block_d": cfg.kwargs["BLOCK_D"], "num_warps": cfg.num_warps,
                    "num_stages": cfg.num_stages}
    return None
