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

Matmul precision of the chunkwise form (``matmul_dtype``, :data:`MATMUL_DTYPES`; default ``"float32"``): the
heavy chunk matmuls (``qkᵀ``, ``S v``, ``q C``, ``q n``, the chunk-state products ``kᵀv`` and the weighted chunk-state
sums) may run with cheaper operands; everything else (gates, cumsums, stabiliser ``m``, exponent weights, the
normaliser's max and division) stays in the compute dtype:

- ``"float32"``: exact float32 matmuls (today's behaviour; on CUDA with TF32 *not* forced on: the process-wide
  setting applies, which PyTorch leaves at IEEE float32 by default).
- ``"tf32"``: the same float32 matmuls with TF32 allowed, forward and backward, inside :func:`tf32_matmuls` (a
  context manager that sets ``torch.backends.cuda.matmul.fp32_precision = "tf32"`` and restores the previous
  value on exit: no global state leaks). On the CPU it is a no-op (the setting only affects cuBLAS). Under
  ``torch.compile`` the context manager cannot be traced (a graph break per matmul), so a compiled caller
  enters :func:`tf32_matmuls` around the whole compiled call (forward and backward) instead, as
  :class:`kvlearn.kvpop.scorers.MLSTMScorer` does; inside a compiled region the matmuls are then plain.
- ``"bfloat16"``: operands cast to bfloat16, the product returned as float32 (cuBLAS/CPU accumulate in float32;
  the product itself is rounded to bfloat16 once before it is widened). The backward's matmuls run in bfloat16
  too (autograd through the casts). Measured error against ``"float32"`` in ``tests/ops/test_mlstm.py``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlearn.errors import check, check_int

__all__ = [
    "MLSTMState",
    "mlstm_zero_state",
    "mlstm_step",
    "mlstm_readout",
    "mlstm_recurrent",
    "mlstm_chunkwise",
    "mlstm_chunkwise_unchecked",
    "mlstm_readout_unchecked",
    "chunk_group_size",
    "MATMUL_DTYPES",
    "check_matmul_dtype",
    "tf32_matmuls",
]

DEFAULT_EPS = 1e-6
MATMUL_DTYPES = ("float32", "tf32", "bfloat16")  # operand precision of the chunkwise form's heavy matmuls


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
        check_int(name, val, 1)
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


def check_mlstm_state(state, b: int, h: int, dk: int, dv: int, device: torch.device) -> None:
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
        check_mlstm_state(state, b, h, dk, v.shape[-1], q.device)


def check_matmul_dtype(matmul_dtype, name: str = "matmul_dtype") -> None:
    """One-line error unless ``matmul_dtype`` is one of :data:`MATMUL_DTYPES`."""
    check(
        isinstance(matmul_dtype, str) and matmul_dtype in MATMUL_DTYPES,
        f"{name}={matmul_dtype!r} is unknown: expected one of {', '.join(MATMUL_DTYPES)}",
    )


@contextlib.contextmanager
def tf32_matmuls() -> Iterator[None]:
    """Allow TF32 in cuBLAS float32 matmuls inside the block; the previous setting is restored on exit.

    Uses the ``fp32_precision`` API (torch >= 2.9): it saves the raw ``torch.backends.cuda.matmul.fp32_precision``
    (``"none"`` = inherit from ``torch.backends.fp32_precision``, or ``"ieee"``/``"tf32"``, which the legacy
    ``allow_tf32`` flag also sets), sets ``"tf32"`` and writes the saved value back. It never sets the legacy
    ``allow_tf32`` flag: since torch 2.9 reading ``allow_tf32`` after the new API set a value raises ("mix of the
    legacy and new APIs"), whereas a value restored through the new API reads back through either. The setting is
    process-wide (not per thread): another thread's CUDA matmuls inside the block are TF32 too. CPU matmuls are
    unaffected (a no-op there)."""
    matmul = torch.backends.cuda.matmul
    old = matmul.fp32_precision
    matmul.fp32_precision = "tf32"
    try:
        yield
    finally:
        matmul.fp32_precision = old


class _TF32MatMul(torch.autograd.Function):
    """``a @ b`` with TF32 allowed in the forward and in the backward's two matmuls (eager only)."""

    @staticmethod
    def forward(ctx, a: Tensor, b: Tensor) -> Tensor:
        ctx.save_for_backward(a, b)
        with tf32_matmuls():
            return a @ b

    @staticmethod
    def backward(ctx, grad: Tensor):
        a, b = ctx.saved_tensors
        ga = gb = None
        with tf32_matmuls():
            if ctx.needs_input_grad[0]:
                ga = _sum_to(grad @ b.transpose(-1, -2), a.shape)
            if ctx.needs_input_grad[1]:
                gb = _sum_to(a.transpose(-1, -2) @ grad, b.shape)
        return ga, gb


def _sum_to(g: Tensor, shape) -> Tensor:
    """Reduce a broadcast gradient back to ``shape`` (matmul broadcasts the batch dims)."""
    return g if tuple(g.shape) == tuple(shape) else g.sum_to_size(shape)


def _mm(a: Tensor, b: Tensor, matmul_dtype: str) -> Tensor:
    """``a @ b`` (batched, broadcasting) with the operand precision ``matmul_dtype`` (see the module docstring);
    the result is in ``a``'s dtype."""
    if matmul_dtype == "bfloat16":
        return (a.to(torch.bfloat16) @ b.to(torch.bfloat16)).to(a.dtype)
    if matmul_dtype == "tf32" and a.is_cuda and a.dtype == torch.float32 and not torch.compiler.is_compiling():
        return _TF32MatMul.apply(a, b)
    return a @ b


def _cast_state(state: MLSTMState, dtype: torch.dtype) -> MLSTMState:
    return MLSTMState(*(x.to(dtype) for x in state))


# ----------------------------------------------------------------------------------------------------------------
# recurrent form


def mlstm_readout_unchecked(q: Tensor, c: Tensor, n: Tensor, m: Tensor, eps: float) -> Tensor:
    """The readout of :func:`mlstm_readout` without validation or casts (it runs inside ``torch.compile``).

    ``q [B,H,...,Dk]`` against one state per (B,H): ``c [B,H,Dk,Dv]``, ``n [B,H,Dk]``, ``m [B,H]``, all in one
    float dtype -> ``h [B,H,...,Dv]`` in that dtype."""
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
        check_mlstm_state(state, b, h, dk, v.shape[-1], q.device)
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
    return mlstm_readout_unchecked(q, c, n, m, eps), MLSTMState(c, n, m)


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
    check_mlstm_state(state, q.shape[0], q.shape[1], q.shape[-1], c.shape[-1], q.device)
    dt = _compute_dtype(q, *state)
    c, n, m = _cast_state(state, dt)
    return mlstm_readout_unchecked(q.to(dt), c, n, m, eps)


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


def chunk_group_size(nc: int) -> int:
    """Divisor ``G`` of ``nc`` minimising the chunk-state work ``(nc/G + 1)·nc + nc·G`` (``G`` near ``sqrt(nc)``)."""
    best, best_cost = 1, None
    for gsz in range(1, nc + 1):
        if nc % gsz == 0:
            cost = (nc // gsz + 1) * nc + nc * gsz
            if best_cost is None or cost < best_cost:
                best, best_cost = gsz, cost
    return best


def _chunks(q, k, v, igate, logf, c0, n0, m0, eps, matmul_dtype: str = "float32") -> tuple[Tensor, MLSTMState]:
    """Process ``NC`` consecutive chunks of length ``L`` (the matmuls with ``matmul_dtype`` operands).

    Shapes: q, k ``[B,H,NC,L,Dk]``, v ``[B,H,NC,L,Dv]``, igate, logf ``[B,H,NC,L]``; start state ``c0 [B,H,Dk,Dv]``,
    ``n0 [B,H,Dk]``, ``m0 [B,H]`` (``c0 = n0 = None``: zero ``C`` and ``n``, nothing to add). Returns
    ``h [B,H,NC,L,Dv]`` and the state after the last chunk. No validation and no Python reads of tensor values
    (it runs inside ``torch.compile``).
    """
    bsz, heads, nc, length, dk = q.shape
    dv = v.shape[-1]
    b = torch.cumsum(logf, dim=-1)  # [B,H,NC,L] log decay from the chunk start through token t (inclusive)
    g = b[..., -1]  # [B,H,NC] log decay over the whole chunk
    # Segment sums seg[t, s] = sum_{s < r <= t} log f_r, summed directly (not as b_t - b_s, which cancels
    # catastrophically in float32 when |b| is large).
    idx = torch.arange(length, device=q.device)
    causal = idx[:, None] >= idx[None, :]  # t >= s
    strict = idx[:, None] > idx[None, :]  # r > s
    seg = torch.where(strict, logf.unsqueeze(-1), 0.0).cumsum(dim=-2)  # [B,H,NC,L(t),L(s)]
    log_d = torch.where(causal, seg + igate.unsqueeze(-2), float("-inf"))  # [B,H,NC,L(t),L(s)]
    a = log_d[..., -1, :]  # [B,H,NC,L] log weight of token s in the end-of-chunk state (before m)
    a_max = a.max(dim=-1).values  # [B,H,NC]

    # 1) the state at the start of every chunk, all chunks at once (no loop over chunks). Chunk i adds
    #    U_i = sum_s exp(a[i,s] - A_i) k_s v_s^T with A_i = max_s a[i,s]; at the start of chunk j it has decayed
    #    by seg[j,i] = sum_{i<l<j} g_l, so its log weight there is L[j,i] = A_i + seg[j,i] (i < j). The
    #    stabiliser of the state at the start of chunk j is M_j = max(max_i L[j,i], m0 + sum_{l<j} g_l): exactly
    #    the recurrent m at that point. Rows j = 0..NC (row NC is the final state).
    wk = torch.exp(a - a_max.unsqueeze(-1))  # [B,H,NC,L]
    kw = k * wk.unsqueeze(-1)
    u = _mm(kw.transpose(-1, -2), v, matmul_dtype).reshape(bsz, heads, nc, dk * dv)  # [B,H,NC,Dk*Dv]
    un = kw.sum(dim=-2)  # [B,H,NC,Dk]
    rows = torch.arange(nc + 1, device=q.device)
    cols = torch.arange(nc, device=q.device)
    # seg[j, i] = sum over l with i < l < j of g_l: a cumsum over l of g_l masked to l > i, shifted down one
    # row (summed directly, never as a difference of two large cumsums, which cancels in float32)
    after = cols[:, None] > cols[None, :]  # [l, i]
    cum = (g.unsqueeze(-1) * after).cumsum(dim=-2)  # [B,H,NC(l),NC(i)] = sum_{i < l' <= l} g_l'
    seg_c = torch.cat([torch.zeros_like(cum[..., :1, :]), cum], dim=-2)  # [B,H,NC+1,NC]
    before = cols[None, :] < rows[:, None]  # [j, i]: chunk i is complete at the start of chunk j
    log_w = torch.where(before, a_max.unsqueeze(-2) + seg_c, float("-inf"))  # [B,H,NC+1,NC]
    g_before = (g.unsqueeze(-2) * before).sum(dim=-1)  # [B,H,NC+1] sum_{l<j} g_l
    log_w0 = m0.unsqueeze(-1) + g_before
    m_all = torch.maximum(log_w.max(dim=-1).values, log_w0)  # [B,H,NC+1]

    # The weighted sum C_j = sum_{i<j} exp(L[j,i] - M_j) U_i (+ the c0 term) over all (j, i) is a dense
    # (NC+1) x NC matmul, O(NC^2 Dk Dv). It is evaluated in two levels with groups of G chunks (G | NC, about
    # sqrt(NC)): (a) the exact formula above, but only for the group starts j = 0, G, 2G, ..., NC (the last row
    # is the final state); (b) inside a group, C_j = exp(M_s + sum_{s<=l<j} g_l - M_j) C_s + sum over the
    # group's chunks i < j of exp(L[j,i] - M_j) U_i, with s the group start. The (j, i) entries used in (b) are
    # those of the same log_w matrix; the carried exponent is <= 0 (M_j is the max over all terms), and every
    # partial sum of the g_l <= 0 is bounded by the full one, so nothing cancels. O((NC/G + G) NC Dk Dv).
    gsz = chunk_group_size(nc)
    ngr = nc // gsz
    m_out = m_all[..., ::gsz]  # [B,H,NG+1] rows 0, G, ..., NC
    w_out = torch.exp(log_w[..., ::gsz, :] - m_out.unsqueeze(-1))  # [B,H,NG+1,NC]
    c_out = _mm(w_out, u, matmul_dtype)  # [B,H,NG+1,Dk*Dv]
    n_out = _mm(w_out, un, matmul_dtype)  # [B,H,NG+1,Dk]
    if c0 is not None:
        w0 = torch.exp(log_w0[..., ::gsz] - m_out)  # [B,H,NG+1]
        c_out = c_out + w0.unsqueeze(-1) * c0.reshape(bsz, heads, 1, dk * dv)
        n_out = n_out + w0.unsqueeze(-1) * n0.unsqueeze(2)
    final = MLSTMState(c_out[:, :, -1].reshape(bsz, heads, dk, dv), n_out[:, :, -1], m_all[:, :, -1])
    m_s = m_all[:, :, :-1]  # [B,H,NC] stabiliser at every chunk start
    if gsz == 1:
        c_s, n_s = c_out[:, :, :-1], n_out[:, :, :-1]
    else:
        blk = log_w[:, :, :-1].reshape(bsz, heads, ngr, gsz, ngr, gsz).diagonal(dim1=2, dim2=4)  # [B,H,G,G,NG]
        m_grp = m_s.reshape(bsz, heads, ngr, gsz)
        w_in = torch.exp(blk.permute(0, 1, 4, 2, 3) - m_grp.unsqueeze(-1))  # [B,H,NG,G(j),G(i)], 0 for i >= j
        g_in = F.pad(g.reshape(bsz, heads, ngr, gsz)[..., :-1], (1, 0)).cumsum(dim=-1)  # sum_{s<=l<j} g_l, direct
        carry = torch.exp(m_out[..., :-1].unsqueeze(-1) + g_in - m_grp).unsqueeze(-1)  # [B,H,NG,G,1]
        c_s = _mm(w_in, u.reshape(bsz, heads, ngr, gsz, dk * dv), matmul_dtype) + carry * c_out[:, :, :-1].unsqueeze(3)
        n_s = _mm(w_in, un.reshape(bsz, heads, ngr, gsz, dk), matmul_dtype) + carry * n_out[:, :, :-1].unsqueeze(3)
    c_s = c_s.reshape(bsz, heads, nc, dk, dv)
    n_s = n_s.reshape(bsz, heads, nc, dk, 1)

    # 2) outputs of all chunks in parallel: intra-chunk quadratic part + contribution of the chunk's start state.
    log_inter = b + m_s.unsqueeze(-1)  # [B,H,NC,L] = b_t + m_start
    m_row = torch.maximum(log_inter, log_d.max(dim=-1).values)  # == recurrent m_t
    w_intra = torch.exp(log_d - m_row.unsqueeze(-1))  # masked entries are exactly 0
    w_inter = torch.exp(log_inter - m_row)  # [B,H,NC,L]
    s = _mm(q, k.transpose(-1, -2), matmul_dtype) * w_intra  # [B,H,NC,L,L]
    num = _mm(s, v, matmul_dtype) + w_inter.unsqueeze(-1) * _mm(q, c_s, matmul_dtype)
    qn = s.sum(dim=-1) + w_inter * _mm(q, n_s, matmul_dtype).squeeze(-1)
    den = torch.maximum(qn.abs(), torch.exp(-m_row)) + eps
    return num / den.unsqueeze(-1), final


def mlstm_chunkwise_unchecked(
    q, k, v, igate, fgate, state, chunk_size: int, eps: float, matmul_dtype: str = "float32"
) -> tuple[Tensor, MLSTMState]:
    """:func:`mlstm_chunkwise` without validation (the body that the KVpop scorer runs under ``torch.compile``).

    Same arguments and result as :func:`mlstm_chunkwise` (``chunk_size`` and ``eps`` positional); the caller
    guarantees the shapes, devices, ``chunk_size >= 1`` and a valid ``matmul_dtype``."""
    dt = _compute_dtype(q, k, v, igate, fgate, *(state if state is not None else ()))
    q, k, v, igate, fgate = (x.to(dt) for x in (q, k, v, igate, fgate))
    bsz, heads, t, _ = q.shape
    dv = v.shape[-1]
    if state is None:  # empty state: C = n = 0 add nothing (no [B,H,NC+1,Dk,Dv] term), m = 0
        c0, n0, m0 = None, None, torch.zeros(bsz, heads, device=q.device, dtype=dt)
    else:
        c0, n0, m0 = _cast_state(state, dt)
    logf = F.logsigmoid(fgate)

    outs = []
    full = (t // chunk_size) * chunk_size
    for lo, hi, length in ((0, full, chunk_size), (full, t, t - full)):
        if hi == lo:
            continue
        nc = (hi - lo) // length

        def split(x: Tensor) -> Tensor:
            return x[:, :, lo:hi].reshape(bsz, heads, nc, length, *x.shape[3:])

        h, (c0, n0, m0) = _chunks(split(q), split(k), split(v), split(igate), split(logf), c0, n0, m0, eps,
                                   matmul_dtype)
        outs.append(h.reshape(bsz, heads, hi - lo, dv))
    return (torch.cat(outs, dim=2) if len(outs) > 1 else outs[0]), MLSTMState(c0, n0, m0)


def mlstm_chunkwise(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    igate: Tensor,
    fgate: Tensor,
    chunk_size: int = 64,
    state: MLSTMState | None = None,
    eps: float = DEFAULT_EPS,
    matmul_dtype: str = "float32",
) -> tuple[Tensor, MLSTMState]:
    """Chunkwise-parallel mLSTM: same result as :func:`mlstm_recurrent`, differentiable by autograd.

    Within a chunk the outputs are a masked quadratic form with log-space gate cumsums and a per-row
    stabiliser (the recurrent ``m_t``); between chunks only the state ``(C, n, m)`` is passed. ``T`` need not be
    a multiple of ``chunk_size``: the remainder is one shorter last chunk.

    Args:
        q, k: ``[B, H, T, Dk]``; v: ``[B, H, T, Dv]``; igate, fgate: ``[B, H, T]`` preactivations.
        chunk_size: chunk length ``L >= 1``.
        state: initial state or None (empty).
        matmul_dtype: operand precision of the chunk matmuls, one of :data:`MATMUL_DTYPES` (``"float32"``:
            exact; ``"tf32"``: TF32 on CUDA, a no-op on the CPU; ``"bfloat16"``: bf16 operands, float32 results;
            see the module docstring). Gates and the stabiliser always run in float32.

    Returns:
        ``h [B, H, T, Dv]`` (float32) and the state after token ``T-1``.
    """
    check_int("chunk_size", chunk_size, 1)
    check_matmul_dtype(matmul_dtype)
    _check_sequence_inputs(q, k, v, igate, fgate, state)
    return mlstm_chunkwise_unchecked(q, k, v, igate, fgate, state, chunk_size, eps, matmul_dtype)
