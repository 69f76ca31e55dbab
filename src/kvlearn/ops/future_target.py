"""Future-attention target of KVpop by a transposed attention pass (paper Sec. 3.2, Eq. 2-3, 8-9; appendix D).

For KV head ``h``, query head ``g`` of its group and token ``t`` the target is built from the mean future attention
mass that ``t`` receives once it has left the protected window of ``w`` recent tokens::

    log m̄[h,g,t] = LSE_{d : t + w <= d < S} ( ℓ[h,g](d, t) - LSE[h,g,d] )          (Eq. 31)
    m[h,g,t]     = m̄[h,g,t] / N_t,   N_t = max(1, S - (t + w))                        (Eq. 2 / 16)
    r[h,t]       = log(eps + Agg_g m[h,g,t])                                          (Eq. 3, 14, 15)

where ``ℓ(d, t) = scale * <q_d, k_t>`` and ``LSE[h,g,d]`` is the log-normaliser of original query ``d`` (the dense
causal one of Eq. 28 from :func:`causal_lse` gives the exact target; the sparse one of Eq. 9 returned by the
student's sparse attention pass gives the approximate target of appendix D.3).

The column-wise reduction of Eq. 31 is computed as attention with the roles swapped: the original keys are the
queries, the original queries are the keys, ``LSE[h,g,d]`` is subtracted from each score and only ``d >= t + w``
is kept; the pass's log-sum-exp is ``log m̄``. Three backends compute it; the ``S x S`` probability matrix is never
stored on the GPU paths:

* ``"triton"`` (default on CUDA): the fused kernel of :mod:`kvlearn.ops.future_target_triton` (one ``Q K^T`` and
  an online log-sum-exp per tile; no ``P @ V``, no block mask).
* ``"flex"``: compiled FlexAttention with a ``score_mod`` and a block mask (eager on the CPU).
* ``"torch"`` (default on the CPU): chunked float32 matmuls.
"""

from __future__ import annotations

import math
from collections import OrderedDict

import torch
from torch import Tensor

from kvlearn.errors import check, check_int, is_int
from kvlearn.ops.flex import check_kernel_options, flex_attention_lse
from kvlearn.ops.future_target_triton import future_log_mass_triton
from kvlearn.ops.triton_support import HAS_TRITON, check_triton_options, kernel_supports

__all__ = ["causal_lse", "future_attention_target", "flex_lse", "BACKENDS", "AGGREGATIONS", "REDUCTIONS",
           "TRITON_OPTION_KEYS"]

BACKENDS = ("auto", "triton", "flex", "torch")
TRITON_OPTION_KEYS = ("block_t", "block_d", "num_warps", "num_stages", "fp32_precision")
AGGREGATIONS = ("max", "mean")
# over the future queries of a token: "mass" sums their probabilities (the paper's Eq. 2, log-sum-exp in the log
# domain), "peak" keeps the largest one (a what-if of this project, docs/DESIGN.md section 4.1)
REDUCTIONS = ("mass", "peak")

# Bytes of float32 scores one chunk of the torch backend may hold at a time.
_CHUNK_BYTES = 1 << 26

_block_mask_cache: "OrderedDict[tuple, object]" = OrderedDict()
_BLOCK_MASK_CACHE_SIZE = 8


# ----------------------------------------------------------------------------------------------------------------
# FlexAttention plumbing
# ----------------------------------------------------------------------------------------------------------------


def flex_lse(query: Tensor, key: Tensor, *, score_mod=None, block_mask=None, scale=None,
             enable_gqa: bool = False, kernel_options: dict | None = None) -> Tensor:
    """Natural-log log-sum-exp of a FlexAttention call, float32 ``[batch, q_heads, q_len]`` (``-inf`` for rows
    with no unmasked key); see :func:`kvlearn.ops.flex.flex_attention_lse`. Only the LSE is wanted, so the value
    is the first 16 channels of the keys: the ``P @ V`` half of the kernel shrinks from ``head_dim`` to 16."""
    value = key[..., : min(key.shape[-1], 16)].contiguous()
    return flex_attention_lse(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale,
                              enable_gqa=enable_gqa, kernel_options=kernel_options)[1]


def _block_mask(kind: str, seq_len: int, window: int, device: torch.device, lookahead: int | None = None):
    """The (batch- and head-independent) BlockMask of the causal pass or of the transposed pass, cached."""
    from torch.nn.attention.flex_attention import create_block_mask

    key = (kind, seq_len, window, str(device), lookahead)
    if key in _block_mask_cache:
        _block_mask_cache.move_to_end(key)
        return _block_mask_cache[key]
    if kind == "causal":

        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx

    else:  # transposed pass: transposed query t (original key) sees transposed key d (original query) iff d >= t + w

        def mask_mod(b, h, q_idx, kv_idx):
            future = kv_idx >= q_idx + window
            if lookahead is None:
                return future
            return future & (kv_idx <= q_idx + window + lookahead)

    mask = create_block_mask(mask_mod, None, None, seq_len, seq_len, device=device)
    _block_mask_cache[key] = mask
    while len(_block_mask_cache) > _BLOCK_MASK_CACHE_SIZE:
        _block_mask_cache.popitem(last=False)
    return mask


# ----------------------------------------------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------------------------------------------


def resolve_backend(backend: str, device: torch.device, *, triton_ok: bool = False) -> str:
    """The backend a call runs: ``backend`` itself unless ``"auto"``, which takes the Triton kernel on CUDA where
    it applies (``triton_ok``: the caller's :func:`kvlearn.ops.triton_support.kernel_supports` verdict), else
    compiled flex on CUDA, torch elsewhere. One-line error for a backend not in :data:`BACKENDS`."""
    check(backend in BACKENDS, f"backend={backend!r} is unknown: expected one of {', '.join(BACKENDS)}")
    if backend == "auto":
        if device.type != "cuda":
            return "torch"
        return "triton" if triton_ok and HAS_TRITON else "flex"
    return backend


def _check_qk(query, key) -> tuple[int, int, int, int, int]:
    check(isinstance(query, Tensor) and query.dim() == 4,
          f"query shape={tuple(getattr(query, 'shape', ()))} is invalid: expected [batch, q_heads, seq, head_dim]")
    check(isinstance(key, Tensor) and key.dim() == 4,
          f"key shape={tuple(getattr(key, 'shape', ()))} is invalid: expected [batch, kv_heads, seq, head_dim]")
    check(query.is_floating_point() and key.is_floating_point(),
          f"query/key dtype={query.dtype}/{key.dtype} is invalid: expected floating point tensors")
    check(query.device == key.device, f"key device={key.device} differs from query device={query.device}")
    b, hq, s, d = query.shape
    check(key.shape[0] == b and key.shape[2] == s and key.shape[3] == d,
          f"key shape={tuple(key.shape)} does not match query shape={tuple(query.shape)}: "
          "expected the same batch, seq and head_dim")
    hkv = key.shape[1]
    check(hkv >= 1 and hq % hkv == 0,
          f"q_heads={hq} is invalid for kv_heads={hkv}: expected a multiple of kv_heads (grouped-query attention)")
    check(s >= 1, f"seq={s} is invalid: expected >= 1")
    return b, hq, hkv, s, d


def _check_scale(scale, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    check(isinstance(scale, (int, float)) and not isinstance(scale, bool) and math.isfinite(scale) and scale > 0,
          f"scale={scale!r} is invalid: expected a finite float > 0 (or None for 1/sqrt(head_dim))")
    return float(scale)


def _work_dtype(x: Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _chunk(batch: int, heads: int, seq: int) -> int:
    return max(1, _CHUNK_BYTES // (4 * batch * heads * seq))


# ----------------------------------------------------------------------------------------------------------------
# Causal LSE (Eq. 28)
# ----------------------------------------------------------------------------------------------------------------


def causal_lse(query: Tensor, key: Tensor, scale: float | None = None, *, backend: str = "auto") -> Tensor:
    """Exact dense causal log-normaliser ``LSE[b, i, d] = log sum_{t <= d} exp(scale * <q_d, k_t>)`` (Eq. 28).

    Args:
        query: ``[batch, q_heads, seq, head_dim]`` (post-RoPE, as used by attention).
        key: ``[batch, kv_heads, seq, head_dim]``; query head ``i`` uses kv head ``i // (q_heads // kv_heads)``.
        scale: logit scale, default ``1 / sqrt(head_dim)``.
        backend: ``"auto"`` (compiled FlexAttention on CUDA, chunked matmul elsewhere), ``"flex"`` or ``"torch"``.

    Returns:
        ``[batch, q_heads, seq]`` float32, natural log. Computed without autograd.
    """
    b, hq, hkv, s, d = _check_qk(query, key)
    scale = _check_scale(scale, d)
    backend = resolve_backend(backend, query.device)
    check(backend != "triton", "backend='triton' is invalid for causal_lse: expected 'auto', 'flex' or 'torch' "
                               "(the Triton kernel computes the transposed target pass only)")
    with torch.no_grad():
        if backend == "flex":
            mask = _block_mask("causal", s, 0, query.device)
            return flex_lse(query, key, block_mask=mask, scale=scale, enable_gqa=hkv != hq)
        g = hq // hkv
        dt = _work_dtype(query)
        q = query.to(dt).reshape(b, hkv, g, s, d)
        k = key.to(dt)
        out = torch.empty(b, hkv, g, s, dtype=torch.float32, device=query.device)
        pos = torch.arange(s, device=query.device)
        step = _chunk(b, hq, s)
        for lo in range(0, s, step):
            hi = min(s, lo + step)
            logits = torch.einsum("bhgcd,bhtd->bhgct", q[:, :, :, lo:hi], k[:, :, :hi]) * scale
            keep = pos[:hi][None, :] <= pos[lo:hi][:, None]  # [chunk, hi]
            logits = logits.masked_fill(~keep, -math.inf)
            out[..., lo:hi] = torch.logsumexp(logits, dim=-1).float()
        return out.reshape(b, hq, s)


# ----------------------------------------------------------------------------------------------------------------
# Future-attention target (Eq. 2-3, 8, 13-17, 31-33)
# ----------------------------------------------------------------------------------------------------------------


def _future_log_mass_flex(query: Tensor, key: Tensor, lse: Tensor, window: int, scale: float,
                          lookahead: int | None = None, kernel_options: dict | None = None) -> Tensor:
    """``log m̄`` per query head by the transposed FlexAttention pass, ``[batch, q_heads, seq]`` float32."""
    b, hq, s, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    # Transposed queries: the original keys, one copy per query head of the group (head i <- kv head i // g).
    t_query = key.unsqueeze(2).expand(b, hkv, g, s, d).reshape(b, hq, s, d)
    t_key = query.contiguous()
    lse32 = lse.contiguous()

    def score_mod(score, bi, hi, q_idx, kv_idx):
        # score = scale * <k_t, q_d> = ℓ(d, t); subtract the original query's normaliser (Eq. 33)
        return score - lse32[bi, hi, kv_idx]

    mask = _block_mask("future", s, window, query.device, lookahead)
    return flex_lse(t_query, t_key, score_mod=score_mod, block_mask=mask, scale=scale, kernel_options=kernel_options)


def _future_log_mass_torch(query: Tensor, key: Tensor, lse: Tensor, window: int, scale: float,
                           lookahead: int | None = None, peak: bool = False) -> Tensor:
    """Same as :func:`_future_log_mass_flex` by chunked matmuls over original keys (memory ``O(chunk * S)``);
    ``peak``: the largest term instead of the log-sum-exp."""
    b, hq, s, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    dt = _work_dtype(query)
    q = query.to(dt).reshape(b, hkv, g, s, d)
    k = key.to(dt)
    norm = lse.to(dt).reshape(b, hkv, g, 1, s)
    out = torch.full((b, hkv, g, s), -math.inf, dtype=torch.float32, device=query.device)
    pos = torch.arange(s, device=query.device)
    last = s - window  # tokens t >= last have no future query d >= t + w
    step = _chunk(b, hq, s)
    for lo in range(0, max(last, 0), step):
        hi = min(last, lo + step)
        logits = torch.einsum("bhtd,bhgsd->bhgts", k[:, :, lo:hi], q) * scale - norm  # [b, hkv, g, chunk, S]
        keep = pos[None, :] >= pos[lo:hi, None] + window
        if lookahead is not None:
            keep = keep & (pos[None, :] <= pos[lo:hi, None] + window + lookahead)
        logits = logits.masked_fill(~keep, -math.inf)
        out[..., lo:hi] = (logits.amax(dim=-1) if peak else torch.logsumexp(logits, dim=-1)).float()
    return out.reshape(b, hq, s)


def future_attention_target(
    query: Tensor,
    key: Tensor,
    lse: Tensor,
    window: int,
    eps: float = 1e-6,
    aggregation: str = "max",
    count_normalize: bool = True,
    scale: float | None = None,
    *,
    reduction: str = "mass",
    backend: str = "auto",
    lookahead: int | None = None,
    kernel_options: dict | None = None,
) -> Tensor:
    """KVpop future-attention target ``r[b, h, t] = log(eps + Agg_g m[b, h, g, t])`` (Eq. 2-3, appendix B/D).

    Args:
        query: ``[batch, q_heads, seq, head_dim]`` the attention queries (post-RoPE), any float dtype (bf16 on GPU).
        key: ``[batch, kv_heads, seq, head_dim]`` the attention keys; query head ``i`` belongs to kv head
            ``i // (q_heads // kv_heads)``.
        lse: ``[batch, q_heads, seq]`` float32 natural-log normaliser of each original query: the dense causal one
            (:func:`causal_lse`, exact target) or the sparse one of the student's attention pass (Eq. 9/34,
            approximate target). Every entry must be finite.
        window: protected window ``w >= 1``: token ``t`` is counted from query ``d = t + w`` on.
        eps: ``> 0``, added inside the log after count normalisation and aggregation.
        aggregation: ``"max"`` (Eq. 14, paper default) or ``"mean"`` (probability-space mean, Eq. 15) over the
            ``G = q_heads // kv_heads`` query heads sharing a KV head.
        count_normalize: divide the mass by ``N_t = max(1, S - (t + w))`` (appendix B.2); ignored with
            ``reduction="peak"``.
        reduction: over the future queries of a token: ``"mass"`` (default, the paper's Eq. 2: the sum of their
            attention probabilities) or ``"peak"`` (the largest one, ``max_d p(d, t)``: a token that one future
            query attends strongly ranks high however few queries attend it; torch and Triton backends only).
        scale: logit scale, default ``1 / sqrt(head_dim)`` (pass the model's attention scaling).
        lookahead: ``None`` (default: every future query, as in the paper's main experiments) or ``L >= 0``:
            only queries ``t + w <= d <= t + w + L`` count and ``N_t`` is clipped to ``L + 1`` (appendix B.2).
            The transposed pass is then a band, so its cost grows with ``L`` instead of ``S``.
        backend: ``"auto"`` (the Triton kernel on CUDA when triton is installed and takes the inputs: bf16 / fp16 /
            fp32, head_dim a power of two in [16, 256], no flex ``kernel_options``; else compiled FlexAttention;
            chunked matmul elsewhere), ``"triton"`` (CUDA, or the CPU under ``TRITON_INTERPRET=1``), ``"flex"``
            (compiled on CUDA, eager on CPU) or ``"torch"`` (chunked matmul on any device).
        kernel_options: launch options of the transposed pass, None for the defaults. Triton backend: keys of
            :data:`TRITON_OPTION_KEYS` (see :func:`kvlearn.ops.future_target_triton.future_log_mass_triton`);
            flex backend: FlexAttention kernel options (see :func:`kvlearn.ops.flex.check_kernel_options`).

    Returns:
        ``[batch, kv_heads, seq]`` float32, detached (a supervision target). Tokens with no future query
        (``t > S - 1 - w``) get ``log(eps)``. Positions are ``0 .. seq-1`` of one (possibly packed) sequence.
    """
    b, hq, hkv, s, d = _check_qk(query, key)
    check_int("window", window, 1)
    check(isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isfinite(eps) and eps > 0,
          f"eps={eps!r} is invalid: expected a finite float > 0")
    check(aggregation in AGGREGATIONS, f"aggregation={aggregation!r} is unknown: expected one of {', '.join(AGGREGATIONS)}")
    check(reduction in REDUCTIONS, f"reduction={reduction!r} is unknown: expected one of {', '.join(REDUCTIONS)}")
    check(isinstance(lse, Tensor) and tuple(lse.shape) == (b, hq, s),
          f"lse shape={tuple(getattr(lse, 'shape', ()))} is invalid: expected [batch, q_heads, seq] = {(b, hq, s)}")
    check(lse.dtype == torch.float32, f"lse dtype={lse.dtype} is invalid: expected torch.float32")
    check(lse.device == query.device, f"lse device={lse.device} differs from query device={query.device}")
    scale = _check_scale(scale, d)
    check(lookahead is None or (is_int(lookahead) and lookahead >= 0),
          f"lookahead={lookahead!r} is invalid: expected None or an integer >= 0")
    triton_ok = not kernel_options and kernel_supports(query.dtype, d) and key.dtype == query.dtype
    peak = reduction == "peak"
    if peak and backend == "auto" and query.device.type == "cuda" and not (triton_ok and HAS_TRITON):
        backend = "torch"  # FlexAttention returns a log-sum-exp only: the peak runs on the kernel or in torch
    backend = resolve_backend(backend, query.device, triton_ok=triton_ok)
    check(not (peak and backend == "flex"),
          "reduction='peak' is invalid with backend='flex' (FlexAttention returns a log-sum-exp only): expected "
          "backend 'auto', 'triton' or 'torch'")
    if backend == "triton":
        kernel_options = check_triton_options(kernel_options, TRITON_OPTION_KEYS)
    else:
        kernel_options = check_kernel_options(kernel_options)

    with torch.no_grad():
        if backend == "triton":
            log_mass = future_log_mass_triton(query, key, lse, window, scale, lookahead, peak=peak, **kernel_options)
        elif backend == "flex":
            log_mass = _future_log_mass_flex(query, key, lse, window, scale, lookahead, kernel_options)
        else:
            log_mass = _future_log_mass_torch(query, key, lse, window, scale, lookahead, peak=peak)
        pos = torch.arange(s, device=query.device)
        # Rows without any future query are -inf whatever the kernel returns for fully masked rows.
        has_future = (pos + window) < s
        log_mass = torch.where(has_future, log_mass.float(), torch.full_like(log_mass, -math.inf, dtype=torch.float32))
        if count_normalize and not peak:
            count = torch.clamp(s - (pos + window), min=1)
            if lookahead is not None:  # appendix B.2: the count is clipped to the L + 1 queries of the lookahead
                count = torch.clamp(count, max=lookahead + 1)
            count = count.to(torch.float32)
            log_mass = log_mass - torch.log(count)
        grouped = log_mass.reshape(b, hkv, hq // hkv, s)
        if aggregation == "max":
            agg = grouped.amax(dim=2)
        else:
            agg = torch.logsumexp(grouped, dim=2) - math.log(hq // hkv)
        log_eps = torch.full_like(agg, math.log(eps))
        return torch.logaddexp(agg, log_eps)
