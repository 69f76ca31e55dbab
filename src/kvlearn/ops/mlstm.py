"""The mLSTM cell (stabilised, float32): a recurrent reference, a one-token step and a chunkwise-parallel form.

Notation (per batch element and head; ``Dk`` key/query dim, ``Dv`` value dim):

- gates: input ``i_t = exp(ĩ_t)``, forget ``f_t = σ(f̃_t)``; we only use ``log f_t = logsigmoid(f̃_t)``;
- stabilised state ``(C [Dk, Dv], n [Dk], m)``. The *true* (unstabilised) memory is ``exp(m)·C`` and
  ``exp(m)·n``; ``m`` is a running log-scale chosen so that no exponential overflows:

      m_t = max(log f_t + m_{t-1}, ĩ_t)
      C_t = exp(log f_t + m_{t-1} - m_t) C_{t-1} + exp(ĩ_t - m_t) k_t v_tᵀ
      n_t = exp(log f_t + m_{t-1} - m_t) n_{t-1} + exp(ĩ_t - m_t) k_t
      h_t = (q_tᵀ C_t) / (max(|q_tᵀ n_t|, exp(-m_t)) + eps)

  In true scale the readout is ``qᵀC_true / max(|qᵀn_true|, 1)`` (up to ``eps``), so ``m`` changes nothing but
  the floating-point range.
- empty state: ``C = 0, n = 0, m = 0``. Because ``C`` and ``n`` are zero the value of ``m`` only sets the scale
  of the first writes; ``m = 0`` avoids ``-inf`` arithmetic (and NaN gradients) altogether. It is the state that
  :func:`mlstm_zero_state` returns and that ``state=None`` means everywhere.
- no ``1/sqrt(Dk)`` query scaling is applied here: callers scale ``q`` themselves if they want it.

All arithmetic runs in float32 (float64 when any input is float64, for gradcheck); the returned ``h`` and states
are in that compute dtype whatever the input dtype. The chunkwise form computes the same per-token stabiliser
``m_t`` as the recurrence, so both agree to float32 rounding, ``eps`` included.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlearn.errors import check

__all__ = [
    "MLSTMState",
    "mlstm_zero_state",
    "mlstm_step",
    "mlstm_readout",
    "mlstm_recurrent",
    "mlstm_chunkwise",
]

DEFAULT_EPS = 1e-6


class MLSTMState(NamedTuple):
    """Stabilised mLSTM state after some token: ``C [B,H,Dk,Dv]``, ``n [B,H,Dk]``, ``m [B,H]`` (float32)."""

    C: Tensor
    n: Tensor
    m: Tensor


def mlstm_zero_state(
    batch: int, heads: int, dk: int, dv: int, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
) -> MLSTMState:
    """The empty state ``C = 0 [B,H,Dk,Dv]``, ``n = 0 [B,H,Dk]``, ``m = 0 [B,H]``."""
    for name, val in (("batch", batch), ("heads", heads), ("dk", dk), ("dv", dv)):
        check(isinstance(val, int) and val >= 1, f"{name}={val!r} is invalid: expected an integer >= 1")
    return MLSTMState(
        torch.zeros(batch, heads, dk, dv, device=device, dtype=dtype),
        torch.zeros(batch, heads, dk, device=device, dtype=dtype),
        torch.zeros(batch, heads, device=device, dtype=dtype),
    )


# ----------------------------------------------------------------------------------------------------------------
# validation helpers


def _compute_dtype(*tensors) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_float(name: str, t) -> None:
    check(isinstance(t, Tensor), f"{name} is {type(t).__name__}: expected a torch.Tensor")
    check(t.is_floating_point(), f"{name}.dtype={t.dtype} is invalid: expected a floating-point tensor")


def _check_state(state, b: int, h: int, dk: int, dv: int, device: torch.device) -> None:
    check(
        isinstance(state, tuple) and len(state) == 3,
        f"state is {type(state).__name__}: expected an MLSTMState (C, n, m) or None",
    )
    c, n, m = state
    for name, t in (("state.C", c), ("state.n", n), ("state.m", m)):
        _check_float(name, t)
        check(t.device == device, f"{name}.device={t.device} differs from the inputs' device {device}")
    check(tuple(c.shape) == (b, h, dk, dv), f"state.C.shape={tuple(c.shape)} is invalid: expected {(b, h, dk, dv)}")
    check(tuple(n.shape) == (b, h, dk), f"state.n.shape={tuple(n.shape)} is invalid: expected {(b, h, dk)}")
    check(tuple(m.shape) == (b, h), f"state.m.shape={tuple(m.shape)} is invalid: expected {(b, h)}")


def _check_sequence_inputs(q, k, v, igate, fgate, state) -> None:
    for name, t in (("q", q), ("k", k), ("v", v), ("igate", igate), ("fgate", fgate)):
        _check_float(name, t)
    check(q.dim() == 4, f"q.shape={tuple(q.shape)} is invalid: expected [batch, heads, seq, dk]")
    b, h, t, dk = q.shape
    check(t >= 1, f"q.shape={tuple(q.shape)} has seq=0: expected at least one token")
    check(tuple(k.shape) == tuple(q.shape), f"k.shape={tuple(k.shape)} is invalid: expected q's shape {tuple(q.shape)}")
    check(
        v.dim() == 4 and tuple(v.shape[:3]) == (b, h, t),
        f"v.shape={tuple(v.shape)} is invalid: expected [batch, heads, seq, dv] with batch, heads, seq = {(b, h, t)}",
    )
    for name, g in (("igate", igate), ("fgate", fgate)):
        check(tuple(g.shape) == (b, h, t), f"{name}.shape={tuple(g.shape)} is invalid: expected {(b, h, t)}")
    for name, x in (("k", k), ("v", v), ("igate", igate), ("fgate", fgate)):
        check(x.device == q.device, f"{name}.device={x.device} differs from q.device={q.device}")
    if state is not None:
        _check_state(state, b, h, dk, v.shape[-1], q.device)


def _cast_state(state: MLSTMState, dtype: torch.dtype) -> MLSTMState:
    return MLSTMState(*(x.to(dtype) for x in state))


# ----------------------------------------------------------------------------------------------------------------
# recurrent form


def _readout(q: Tensor, c: Tensor, n: Tensor, m: Tensor, eps: float) -> Tensor:
    """``q [B,H,...,Dk]`` against one state per (B,H) -> ``h [B,H,...,Dv]`` (all in the compute dtype)."""
    extra = q.dim() - 3  # number of query axes between H and Dk
    num = torch.einsum("bh...k,bhkv->bh...v", q, c)
    qn = torch.einsum("bh...k,bhk->bh...", q, n)
    floor = torch.exp(-m).reshape(m.shape + (1,) * extra)
    return num / (torch.maximum(qn.abs(), floor) + eps).unsqueeze(-1)


def mlstm_step(
    q: Tensor, k: Tensor, v: Tensor, igate: Tensor, fgate: Tensor, state: MLSTMState | None = None, eps: float = DEFAULT_EPS
) -> tuple[Tensor, MLSTMState]:
    """One token of the stabilised recurrence (decoding).

    Args:
        q, k: ``[B, H, Dk]`` query (read) and key (write) vectors.
        v: ``[B, H, Dv]``.
        igate, fgate: ``[B, H]`` gate preactivations ``ĩ_t`` and ``f̃_t``.
        state: state after the previous token, or None for the empty state.

    Returns:
        ``h [B, H, Dv]`` read with ``q`` from the *updated* state, and the updated state (float32).
    """
    for name, t in (("q", q), ("k", k), ("v", v), ("igate", igate), ("fgate", fgate)):
        _check_float(name, t)
    check(q.dim() == 3, f"q.shape={tuple(q.shape)} is invalid: expected [batch, heads, dk]")
    b, h, dk = q.shape
    check(tuple(k.shape) == (b, h, dk), f"k.shape={tuple(k.shape)} is invalid: expected q's shape {(b, h, dk)}")
    check(v.dim() == 3 and tuple(v.shape[:2]) == (b, h), f"v.shape={tuple(v.shape)} is invalid: expected [{b}, {h}, dv]")
    for name, g in (("igate", igate), ("fgate", fgate)):
        check(tuple(g.shape) == (b, h), f"{name}.shape={tuple(g.shape)} is invalid: expected {(b, h)}")
    for name, x in (("k", k), ("v", v), ("igate", igate), ("fgate", fgate)):
        check(x.device == q.device, f"{name}.device={x.device} differs from q.device={q.device}")
    if state is not None:
        _check_state(state, b, h, dk, v.shape[-1], q.device)
    return _step(q, k, v, igate, fgate, state, eps)


def _step(q, k, v, igate, fgate, state, eps) -> tuple[Tensor, MLSTMState]:
    dt = _compute_dtype(q, k, v, igate, fgate, *(state if state is not None else ()))
    q, k, v, igate, fgate = (x.to(dt) for x in (q, k, v, igate, fgate))
    if state is None:
        state = mlstm_zero_state(q.shape[0], q.shape[1], q.shape[2], v.shape[2], q.device, dt)
    c_prev, n_prev, m_prev = _cast_state(state, dt)
    logf = F.logsigmoid(fgate)
    m = torch.maximum(logf + m_prev, igate)
    fw = torch.exp(logf + m_prev - m)  # [B,H] weight of the old state
    iw = torch.exp(igate - m)  # [B,H] weight of the new write
    c = fw[..., None, None] * c_prev + iw[..., None, None] * (k.unsqueeze(-1) * v.unsqueeze(-2))
    n = fw[..., None] * n_prev + iw[..., None] * k
    return _readout(q, c, n, m, eps), MLSTMState(c, n, m)


def mlstm_readout(q: Tensor, state: MLSTMState, eps: float = DEFAULT_EPS) -> Tensor:
    """Read a state with one or more queries that did not write to it.

    Args:
        q: ``[B, H, Dk]`` or ``[B, H, N, Dk]`` query vectors.
        state: an :class:`MLSTMState` with ``C [B,H,Dk,Dv]``.

    Returns:
        ``h [B, H, Dv]`` or ``[B, H, N, Dv]``: ``qᵀC / (max(|qᵀn|, exp(-m)) + eps)`` in float32.
    """
    _check_float("q", q)
    check(q.dim() in (3, 4), f"q.shape={tuple(q.shape)} is invalid: expected [batch, heads, dk] or [batch, heads, n, dk]")
    check(state is not None, "state=None is invalid for mlstm_readout: expected an MLSTMState (C, n, m)")
    check(isinstance(state, tuple) and len(state) == 3, f"state is {type(state).__name__}: expected an MLSTMState")
    c = state[0]
    _check_float("state.C", c)
    check(c.dim() == 4, f"state.C.shape={tuple(c.shape)} is invalid: expected [batch, heads, dk, dv]")
    _check_state(state, q.shape[0], q.shape[1], q.shape[-1], c.shape[-1], q.device)
    dt = _compute_dtype(q, *state)
    c, n, m = _cast_state(state, dt)
    return _readout(q.to(dt), c, n, m, eps)


def mlstm_recurrent(
    q: Tensor, k: Tensor, v: Tensor, igate: Tensor, fgate: Tensor, state: MLSTMState | None = None, eps: float = DEFAULT_EPS
) -> tuple[Tensor, MLSTMState]:
    """Reference: the stabilised recurrence as a loop over tokens.

    Args:
        q, k: ``[B, H, T, Dk]``; v: ``[B, H, T, Dv]``; igate, fgate: ``[B, H, T]`` preactivations.
        state: initial state or None (empty).

    Returns:
        ``h [B, H, T, Dv]`` (float32) and the state after token ``T-1``.
    """
    _check_sequence_inputs(q, k, v, igate, fgate, state)
    hs = []
    for t in range(q.shape[2]):
        h_t, state = _step(q[:, :, t], k[:, :, t], v[:, :, t], igate[:, :, t], fgate[:, :, t], state, eps)
        hs.append(h_t)
    return torch.stack(hs, dim=2), state


# ----------------------------------------------------------------------------------------------------------------
# chunkwise-parallel form


def _chunks(q, k, v, igate, logf, c0, n0, m0, eps) -> tuple[Tensor, MLSTMState]:
    """Process ``NC`` consecutive chunks of length ``L``.

    Shapes: q, k ``[B,H,NC,L,Dk]``, v ``[B,H,NC,L,Dv]``, igate, logf ``[B,H,NC,L]``; start state ``c0 [B,H,Dk,Dv]``,
    ``n0 [B,H,Dk]``, ``m0 [B,H]``. Returns ``h [B,H,NC,L,Dv]`` and the state after the last chunk.
    """
    nc, length = q.shape[2], q.shape[3]
    b = torch.cumsum(logf, dim=-1)  # [B,H,NC,L] log decay from the chunk start through token t (inclusive)
    g = b[..., -1]  # [B,H,NC] log decay over the whole chunk
    # Segment sums seg[t, s] = sum_{s < r <= t} log f_r, summed directly (not as b_t - b_s, which cancels
    # catastrophically in float32 when |b| is large).
    ones = torch.ones(length, length, dtype=torch.bool, device=q.device)
    causal = ones.tril()  # t >= s
    strict = ones.tril(-1)  # t > s
    seg = logf.unsqueeze(-1).expand(*logf.shape, length).masked_fill(~strict, 0.0).cumsum(dim=-2)
    log_d = (seg + igate.unsqueeze(-2)).masked_fill(~causal, float("-inf"))  # [B,H,NC,L(t),L(s)]
    a = log_d[..., -1, :]  # [B,H,NC,L] log weight of token s in the end-of-chunk state (before m)
    a_max = a.max(dim=-1).values  # [B,H,NC]

    # 1) the state at the start of every chunk, all chunks at once (no loop over chunks). Chunk i adds
    #    U_i = sum_s exp(a[i,s] - A_i) k_s v_s^T with A_i = max_s a[i,s]; at the start of chunk j it has decayed
    #    by seg[j,i] = sum_{i<l<j} g_l, so its log weight there is L[j,i] = A_i + seg[j,i] (i < j). The
    #    stabiliser of the state at the start of chunk j is M_j = max(max_i L[j,i], m0 + sum_{l<j} g_l): exactly
    #    the recurrent m at that point. Rows j = 0..NC (row NC is the final state).
    wk = torch.exp(a - a_max.unsqueeze(-1))  # [B,H,NC,L]
    kw = k * wk.unsqueeze(-1)
    u = kw.transpose(-1, -2) @ v  # [B,H,NC,Dk,Dv]
    un = kw.sum(dim=-2)  # [B,H,NC,Dk]
    rows = torch.arange(nc + 1, device=q.device)
    cols = torch.arange(nc, device=q.device)
    # seg[j, i] = sum over l with i < l < j of g_l: a cumsum over l of g_l masked to l > i, shifted down one
    # row (summed directly, never as a difference of two large cumsums, which cancels in float32)
    after = cols[:, None] > cols[None, :]  # [l, i]
    cum = (g.unsqueeze(-1) * after).cumsum(dim=-2)  # [B,H,NC(l),NC(i)] = sum_{i < l' <= l} g_l'
    seg = torch.cat([torch.zeros_like(cum[..., :1, :]), cum], dim=-2)  # [B,H,NC+1,NC]
    before = cols[None, :] < rows[:, None]  # [j, i]: chunk i is complete at the start of chunk j
    log_w = (a_max.unsqueeze(-2) + seg).masked_fill(~before, float("-inf"))  # [B,H,NC+1,NC]
    g_before = (g.unsqueeze(-2) * before).sum(dim=-1)  # [B,H,NC+1] sum_{l<j} g_l
    log_w0 = m0.unsqueeze(-1) + g_before
    m_all = torch.maximum(log_w.max(dim=-1).values, log_w0)  # [B,H,NC+1]
    w = torch.exp(log_w - m_all.unsqueeze(-1))
    w0 = torch.exp(log_w0 - m_all)
    c_all = torch.einsum("bhji,bhide->bhjde", w, u) + w0[..., None, None] * c0.unsqueeze(2)
    n_all = torch.einsum("bhji,bhid->bhjd", w, un) + w0[..., None] * n0.unsqueeze(2)
    final = MLSTMState(c_all[:, :, -1], n_all[:, :, -1], m_all[:, :, -1])
    c_s, n_s, m_s = c_all[:, :, :-1], n_all[:, :, :-1], m_all[:, :, :-1]

    # 2) outputs of all chunks in parallel: intra-chunk quadratic part + contribution of the chunk's start state.
    log_inter = b + m_s.unsqueeze(-1)  # [B,H,NC,L] = b_t + m_start
    m_row = torch.maximum(log_inter, log_d.max(dim=-1).values)  # == recurrent m_t
    w_intra = torch.exp(log_d - m_row.unsqueeze(-1))  # masked entries are exactly 0
    w_inter = torch.exp(log_inter - m_row)  # [B,H,NC,L]
    s = (q @ k.transpose(-1, -2)) * w_intra  # [B,H,NC,L,L]
    num = s @ v + w_inter.unsqueeze(-1) * (q @ c_s)
    qn = s.sum(dim=-1) + w_inter * (q @ n_s.unsqueeze(-1)).squeeze(-1)
    den = torch.maximum(qn.abs(), torch.exp(-m_row)) + eps
    return num / den.unsqueeze(-1), final


def mlstm_chunkwise(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    igate: Tensor,
    fgate: Tensor,
    chunk_size: int = 64,
    state: MLSTMState | None = None,
    eps: float = DEFAULT_EPS,
) -> tuple[Tensor, MLSTMState]:
    """Chunkwise-parallel mLSTM: same result as :func:`mlstm_recurrent`, differentiable by autograd.

    Within a chunk the outputs are a masked quadratic form with log-space gate cumsums and a per-row
    stabiliser (the recurrent ``m_t``); between chunks only the state ``(C, n, m)`` is passed. ``T`` need not be
    a multiple of ``chunk_size``: the remainder is one shorter last chunk.

    Args:
        q, k: ``[B, H, T, Dk]``; v: ``[B, H, T, Dv]``; igate, fgate: ``[B, H, T]`` preactivations.
        chunk_size: chunk length ``L >= 1``.
        state: initial state or None (empty).

    Returns:
        ``h [B, H, T, Dv]`` (float32) and the state after token ``T-1``.
    """
    check(
        isinstance(chunk_size, int) and not isinstance(chunk_size, bool) and chunk_size >= 1,
        f"chunk_size={chunk_size!r} is invalid: expected an integer >= 1",
    )
    _check_sequence_inputs(q, k, v, igate, fgate, state)
    dt = _compute_dtype(q, k, v, igate, fgate, *(state if state is not None else ()))
    q, k, v, igate, fgate = (x.to(dt) for x in (q, k, v, igate, fgate))
    bsz, heads, t, dk = q.shape
    dv = v.shape[-1]
    if state is None:
        state = mlstm_zero_state(bsz, heads, dk, dv, q.device, dt)
    state = _cast_state(state, dt)
    logf = F.logsigmoid(fgate)

    outs = []
    full = (t // chunk_size) * chunk_size
    for lo, hi, length in ((0, full, chunk_size), (full, t, t - full)):
        if hi == lo:
            continue
        nc = (hi - lo) // length

        def split(x: Tensor) -> Tensor:
            return x[:, :, lo:hi].reshape(bsz, heads, nc, length, *x.shape[3:])

        h, state = _chunks(split(q), split(k), split(v), split(igate), split(logf), *state, eps)
        outs.append(h.reshape(bsz, heads, hi - lo, dv))
    return torch.cat(outs, dim=2) if len(outs) > 1 else outs[0], state

