"""KVpop importance scorers: one small learned model per KV head, fed with the cached key and value of a token.

Every scorer sees ``x_t = [k_t; v_t]`` (``[B, Hkv, T, 2D]``), *detached* from the backbone and cast to float32,
and returns raw scores ``[B, Hkv, T]`` in float32. Parameters are per KV head and are also used in float32
whatever dtype the module was cast to.

Contract shared by all scorers (what the cache and the training loop rely on):

- ``forward(key, value) -> scores [B, H, T]``: training / full-sequence scoring.
- ``readout_delay``: ``u = t - readout_delay`` is the token whose score becomes *final* when token ``t`` arrives.
  0 for the stateless scorers and for the immediate mLSTM readout, ``window`` for the delayed mLSTM readout.
- ``prefill(key, value) -> (scores [B, H, T], state)``: the same scores as ``forward``; the last
  ``readout_delay`` of them are *provisional* (see :class:`MLSTMScorer`). ``state`` continues into ``step``.
- ``init_state(batch, device)``: the state before any token (``None`` for stateless scorers).
- stateful (mLSTM) only: ``continue_prefill(key, value, valid, state, past_key, past_value) -> (scores, past_scores,
  state)`` continues a sequence by a chunk (chunked prefill), re-scoring the ``readout_delay`` tokens before it.
- ``step(key_t, value_t, key_u=None, value_u=None, state=None) -> (score_u [B, H] | None, state)``: token ``t``
  arrives; returns the final score of ``u = t - readout_delay``. With ``readout_delay > 0`` the caller passes
  the cached key/value of ``u`` (still inside the protected window), or ``None`` while ``u < 0`` (then the
  score is ``None``). With ``readout_delay == 0`` ``key_u``/``value_u`` must be ``None``: ``u`` is ``t``.
- ``num_parameters_per_head()`` and ``state_bytes_per_head()`` for the overhead accounting.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kvlearn.errors import check, check_int
from kvlearn.ops.mlstm import (
    MLSTMState,
    check_matmul_dtype,
    check_mlstm_state,
    mlstm_chunkwise_unchecked,
    mlstm_readout_unchecked,
    mlstm_step,
    mlstm_zero_state,
    tf32_matmuls,
)

__all__ = ["KVScorer", "LinearScorer", "MLPScorer", "MLSTMScorer", "hedgehog", "mlstm_scores", "mlstm_continue_scores"]


def _cat_kv(key: Tensor, value: Tensor) -> Tensor:
    """Detached float32 ``x = [k; v]`` over the last dim."""
    return torch.cat([key.detach(), value.detach()], dim=-1).float()


# Token rows per batch entry of the per-head projections (:func:`head_matmul`).
HEAD_MATMUL_ROWS = 256


def head_matmul(x: Tensor, w: Tensor, rows: int | None = None) -> Tensor:
    """Per-head projection ``x [B, H, ..., C] @ w [H, C, N] -> [B, H, ..., N]`` (one float dtype, no casts).

    The same products as ``torch.einsum("bh...c,hcn->bh...n", x, w)``, but computed as one batched matmul over
    (batch, head, chunk of ``rows`` token rows; default :data:`HEAD_MATMUL_ROWS`), the rows past the last full
    chunk as one more matmul. Why: the weight's gradient is then a batched matmul over those entries, each reducing
    over ``rows`` tokens, and a sum over the entries. The einsum's weight gradient is one reduction over all
    ``B * T`` tokens per head into an ``[C, N]`` output, which a GEMM covers with a handful of thread blocks
    (the MLP scorer in the 8 x 4096 retrofit: ``C = N = 64``, 8 tiles of 32 x 32 over 32768 tokens; the MLP step's
    profile, ``results/raw/retrofit_step_profile_retrofit_kvpop_mlp_1880c5c.txt``, has 8 calls of about 1 ms of an
    FFMA GEMM, one a layer). Forward values are the same dot products (length ``C``); the weight gradient differs
    from the einsum's by the summation order only."""
    heads, c, n = w.shape
    lead = x.shape[:-1]
    b = x.shape[0]
    total = math.prod(x.shape[2:-1])  # token rows per (batch, head): 1 for [B, H, C]
    rows = HEAD_MATMUL_ROWS if rows is None else rows
    xr = x.reshape(b, heads, total, c)
    if total <= rows:
        y = xr @ w  # [B, H, total, N]: w broadcast over the batch
    else:
        full = total // rows * rows
        y = (xr[:, :, :full].reshape(b, heads, total // rows, rows, c) @ w.unsqueeze(1)).reshape(b, heads, full, n)
        if full < total:
            y = torch.cat([y, xr[:, :, full:] @ w], dim=2)
    return y.reshape(*lead, n)


def head_matvec(x: Tensor, w: Tensor, rows: int | None = None) -> Tensor:
    """``x [B, H, ..., C] · w [H, C] -> [B, H, ...]`` per head (``torch.einsum("bh...c,hc->bh...")``) by
    :func:`head_matmul`, for the same reason."""
    return head_matmul(x, w.unsqueeze(-1), rows).squeeze(-1)


def hedgehog(y: Tensor) -> Tensor:
    """Hedgehog feature map ``φ(y) = [softmax(y); softmax(-y)]`` over the last dim: ``[..., d] -> [..., 2d]``."""
    return torch.cat([torch.softmax(y, dim=-1), torch.softmax(-y, dim=-1)], dim=-1)


class KVScorer(nn.Module):
    """Base class: input validation, ``x = [k; v]`` in float32 (detached), and the stateless decode contract."""

    readout_delay: int = 0

    def __init__(self, num_kv_heads: int, head_dim: int) -> None:
        super().__init__()
        check_int("num_kv_heads", num_kv_heads, 1)
        check_int("head_dim", head_dim, 1)
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    # -- inputs ---------------------------------------------------------------------------------------------
    def _x(self, key: Tensor, value: Tensor, ndim: int = 4, names: tuple[str, str] = ("key", "value")) -> Tensor:
        """``[B,H,T,D]`` (or ``[B,H,D]`` with ndim=3) key and value -> detached float32 ``x = [k; v]``."""
        self._check_kv(key, value, ndim, names)
        return _cat_kv(key, value)

    def _check_kv(self, key: Tensor, value: Tensor, ndim: int = 4, names: tuple[str, str] = ("key", "value")) -> None:
        """Validate ``[B,H,T,D]`` (or ``[B,H,D]`` with ndim=3) key and value (one-line KVLearnError)."""
        layout = "[batch, kv_heads, seq, head_dim]" if ndim == 4 else "[batch, kv_heads, head_dim]"
        for name, t in zip(names, (key, value)):
            check(isinstance(t, Tensor), f"{name} is {type(t).__name__}: expected a torch.Tensor {layout}")
            check(t.is_floating_point(), f"{name}.dtype={t.dtype} is invalid: expected a floating-point tensor")
            check(t.dim() == ndim, f"{name}.shape={tuple(t.shape)} is invalid: expected {layout}")
            check(
                t.shape[1] == self.num_kv_heads and t.shape[-1] == self.head_dim,
                f"{name}.shape={tuple(t.shape)} is invalid: expected kv_heads={self.num_kv_heads} and "
                f"head_dim={self.head_dim} in {layout}",
            )
        check(
            key.shape == value.shape,
            f"{names[1]}.shape={tuple(value.shape)} differs from {names[0]}.shape={tuple(key.shape)}: expected equal shapes",
        )
        check(value.device == key.device, f"{names[1]}.device={value.device} differs from {names[0]}.device={key.device}")
        if ndim == 4:
            check(key.shape[2] >= 1, f"{names[0]}.shape={tuple(key.shape)} has seq=0: expected at least one token")

    def _param(self, p: Tensor) -> Tensor:
        return p.float()

    # -- decode contract (stateless default) ----------------------------------------------------------------
    @property
    def stateful(self) -> bool:
        return False

    def init_state(self, batch: int, device: torch.device | str | None = None):
        """State before the first token (``None``: stateless)."""
        check_int("batch", batch, 1)
        return None

    def prefill(self, key: Tensor, value: Tensor):
        """Scores of a prompt ``[B, H, T]`` and the state after it (``None``: stateless)."""
        return self(key, value), None

    def step(self, key_t: Tensor, value_t: Tensor, key_u: Tensor | None = None, value_u: Tensor | None = None, state=None):
        """Token ``t`` (``[B, H, D]``) arrives; a stateless scorer scores it at once: returns ``(score_t [B,H], None)``."""
        check(
            key_u is None and value_u is None,
            "key_u/value_u given to a scorer with readout_delay=0: expected None (the scored token is t itself)",
        )
        x = self._x(key_t, value_t, ndim=3, names=("key_t", "value_t"))
        return self._score_x(x.unsqueeze(2)).squeeze(2), None

    def forward(self, key: Tensor, value: Tensor) -> Tensor:
        """Raw scores ``[B, H, T]`` float32 of key/value ``[B, H, T, D]`` (inputs detached)."""
        return self._score_x(self._x(key, value))

    def _score_x(self, x: Tensor) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    # -- accounting -----------------------------------------------------------------------------------------
    def num_parameters_per_head(self) -> int:
        """Learned parameters per KV head (all parameters are per head)."""
        return sum(p.numel() for p in self.parameters()) // self.num_kv_heads

    def state_bytes_per_head(self) -> int:
        """Bytes of decode-time state per KV head and sequence (beyond the KV cache itself)."""
        return 0


class LinearScorer(KVScorer):
    """``r̂_{h,t} = w_hᵀ [k_t; v_t] + b_h``: weight ``[H, 2D]``, bias ``[H]``.

    ``zero_init=True`` (default) starts from a neutral ranking (all scores 0); otherwise the weight is drawn
    like ``nn.Linear`` (uniform ±1/sqrt(2D)).
    """

    def __init__(self, num_kv_heads: int, head_dim: int, zero_init: bool = True) -> None:
        super().__init__(num_kv_heads, head_dim)
        self.weight = nn.Parameter(torch.zeros(num_kv_heads, 2 * head_dim))
        self.bias = nn.Parameter(torch.zeros(num_kv_heads))
        if not zero_init:
            bound = 1.0 / math.sqrt(2 * head_dim)
            nn.init.uniform_(self.weight, -bound, bound)

    def _score_x(self, x: Tensor) -> Tensor:
        return head_matvec(x, self._param(self.weight)) + self._param(self.bias)[:, None]


class MLPScorer(KVScorer):
    """Per-head two-layer MLP ``r̂ = w2ᵀ SiLU(W1ᵀ x + b1) + b2`` with ``x = [k; v]``.

    ``hidden`` defaults to ``2 * head_dim`` (as wide as the input). ``W1 [H, 2D, hidden]`` is drawn like
    ``nn.Linear``; the output layer ``w2 [H, hidden]``, ``b2 [H]`` is zero (neutral ranking at start) unless
    ``zero_init=False``.
    """

    def __init__(self, num_kv_heads: int, head_dim: int, hidden: int | None = None, zero_init: bool = True) -> None:
        super().__init__(num_kv_heads, head_dim)
        hidden = 2 * head_dim if hidden is None else hidden
        check_int("hidden", hidden, 1)
        self.hidden = hidden
        bound1 = 1.0 / math.sqrt(2 * head_dim)
        self.w1 = nn.Parameter(torch.empty(num_kv_heads, 2 * head_dim, hidden).uniform_(-bound1, bound1))
        self.b1 = nn.Parameter(torch.empty(num_kv_heads, hidden).uniform_(-bound1, bound1))
        self.w2 = nn.Parameter(torch.zeros(num_kv_heads, hidden))
        self.b2 = nn.Parameter(torch.zeros(num_kv_heads))
        if not zero_init:
            bound2 = 1.0 / math.sqrt(hidden)
            nn.init.uniform_(self.w2, -bound2, bound2)

    def _score_x(self, x: Tensor) -> Tensor:
        hid = head_matmul(x, self._param(self.w1)) + self._param(self.b1)[:, None]
        return head_matvec(F.silu(hid), self._param(self.w2)) + self._param(self.b2)[:, None]


def _fold_identity(d_in: int, d_out: int) -> Tensor:
    """``[d_in, d_out]`` with ``W[j, j mod d_out] = 1``, columns scaled to unit norm (identity when equal)."""
    w = torch.zeros(d_in, d_out)
    w[torch.arange(d_in), torch.arange(d_in) % d_out] = 1.0
    return w / w.norm(dim=0, keepdim=True).clamp_min(1.0)


# ----------------------------------------------------------------------------------------------------------------
# mLSTM scorer as pure functions of tensors and Python constants: the eager path, the decode step and the
# torch.compile'd path (CUDA) all run this code. No validation in here (it is done before), no Python reads of
# tensor values, so that the compiled region traces as one graph.


def _cap(z: Tensor, softcap: float | None) -> Tensor:
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def _project(x: Tensor, w_q, w_k, w_v, w_i, b_i, w_f, b_f, softcap: float | None):
    """``x [B,H,T,2D]`` (or ``[B,H,2D]``) -> ``q̃, k̃ [..,D]``, ``ṽ [..,Dv]``, ``ĩ, f̃ [..]`` (float32).

    The five per-head projections are one matmul with the weights concatenated ``[H, 2D, D/2 + D/2 + Dv + 2]``:
    ``x`` is read once (and once in the backward) instead of five times."""
    half, dv = w_q.shape[-1], w_v.shape[-1]
    w = torch.cat([w_q.float(), w_k.float(), w_v.float(), w_i.float().unsqueeze(-1), w_f.float().unsqueeze(-1)], dim=-1)
    y = head_matmul(x, w)  # [B,H,(T,)N]
    yq, yk, v, ig, fg = y.split([half, half, dv, 1, 1], dim=-1)
    shape = (w.shape[0],) + (1,) * (x.dim() - 3)
    ig = ig.squeeze(-1) + b_i.float().view(shape)
    fg = fg.squeeze(-1) + b_f.float().view(shape)
    return hedgehog(yq), hedgehog(yk), v, _cap(ig, softcap), _cap(fg, softcap)


def _score_head(h: Tensor, a: Tensor, b: Tensor, norm_weight: Tensor | None, norm_eps: float) -> Tensor:
    """Readout ``h [B,H,...,Dv]`` -> score ``[B,H,...]``: ``aᵀ SiLU(Norm(h)) + b``."""
    heads, extra = a.shape[0], h.dim() - 3
    if norm_weight is not None:
        h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + norm_eps)
        h = h * norm_weight.float().view((heads,) + (1,) * extra + (h.shape[-1],))
    return head_matvec(F.silu(h), a.float()) + b.float().view((heads,) + (1,) * extra)


def _skip_score(x: Tensor, w1: Tensor | None, b1: Tensor | None, w2: Tensor | None) -> Tensor | float:
    """The skip path ``w2ᵀ SiLU(W1ᵀ x + b1)`` of ``x [B,H,...,2D]`` -> ``[B,H,...]`` (0 when absent)."""
    if w1 is None:
        return 0.0
    extra = x.dim() - 3
    hid = head_matmul(x, w1.float()) + b1.float().view((w1.shape[0],) + (1,) * extra + (-1,))
    return head_matvec(F.silu(hid), w2.float())


def mlstm_scores(
    key: Tensor,
    value: Tensor,
    valid: Tensor | None,
    params: tuple,
    delay: int,
    chunk_size: int,
    softcap: float | None,
    eps: float,
    norm_eps: float,
    matmul_dtype: str = "float32",
    read_key: Tensor | None = None,
    read_value: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The MLSTMScorer forward as one pure function (what ``torch.compile`` compiles; no validation).

    Scores ``[B,H,T]`` float32 and the final state ``(C [B,H,Dk,Dv], n [B,H,Dk], m [B,H])`` of a full sequence, from
    validated key/value ``[B,H,T,D]`` and ``valid`` ``[B,T]`` (None: no padding).

    ``params = (w_q, w_k, w_v, w_i, b_i, w_f, b_f, norm_weight or None, a, b, skip_w1, skip_b1, skip_w2)`` (the last three
    None without the skip path); ``delay`` is the readout delay;
    ``matmul_dtype`` the operand precision of the mLSTM chunk matmuls (:func:`kvlearn.ops.mlstm.mlstm_chunkwise`).
    ``read_key, read_value`` (delayed readout; None: ``key, value``): the form of each token the *readout* reads (its
    query features and skip path), where the memory is written from ``key, value``: a cache whose store quantizes
    reads the delayed token back in its stored form (``Store.round_trip``), so a retrofit under quantized keys trains
    the readout on that form (:mod:`kvlearn.kvpop.train_attention`).
    """
    w_q, w_k, w_v, w_i, b_i, w_f, b_f, norm_weight, a, b, skip_w1, skip_b1, skip_w2 = params
    x = _cat_kv(key, value)
    q, k, v, ig, fg = _project(x, w_q, w_k, w_v, w_i, b_i, w_f, b_f, softcap)
    if delay > 0 and read_key is not None:  # the readout's query features and skip path from the stored form
        x = _cat_kv(read_key, read_value)
        q = _project(x, w_q, w_k, w_v, w_i, b_i, w_f, b_f, softcap)[0]
    if valid is not None:  # padding neither writes (input gate -> 0) nor decays (forget gate -> 1) the memory
        keep = valid[:, None, :].to(torch.bool)
        ig = torch.where(keep, ig, -1e4)
        fg = torch.where(keep, fg, 1e4)
    t = x.shape[2]
    if delay == 0:
        h, state = mlstm_chunkwise_unchecked(q, k, v, ig, fg, None, chunk_size, eps, matmul_dtype)
    else:
        # delayed: the readout at time s uses q̃_{s-w} (zeros for s < w: nothing to read yet, discarded)
        shift = min(delay, t)
        q_read = F.pad(q[:, :, : t - shift], (0, 0, shift, 0))
        h_seq, state = mlstm_chunkwise_unchecked(q_read, k, v, ig, fg, None, chunk_size, eps, matmul_dtype)
        h_prov = mlstm_readout_unchecked(q[:, :, t - shift :], *state, eps)  # u = T-w .. T-1, read at T-1
        h = torch.cat([h_seq[:, :, shift:], h_prov], dim=2)  # u = 0 .. T-1-w read at u + w, then provisional
    return (_score_head(h, a, b, norm_weight, norm_eps) + _skip_score(x, skip_w1, skip_b1, skip_w2), *state)


def mlstm_continue_scores(
    key: Tensor,
    value: Tensor,
    valid: Tensor | None,
    state: MLSTMState | None,
    past_key: Tensor | None,
    past_value: Tensor | None,
    params: tuple,
    delay: int,
    chunk_size: int,
    softcap: float | None,
    eps: float,
    norm_eps: float,
    matmul_dtype: str = "float32",
    read_key: Tensor | None = None,
    read_value: Tensor | None = None,
) -> tuple[Tensor, Tensor | None, MLSTMState]:
    """Continue a sequence from ``state`` by the forward's tokens ``key, value [B,H,T,D]`` (validated).

    ``valid [B, T]`` (None: no padding) may mark padding anywhere: the real tokens of each row are processed in
    order as if the padding were not there (they are first moved to the front of the row, stably; padding then
    neither writes nor decays the memory and its scores are garbage). With the delayed readout (``delay = w``)
    ``past_key, past_value [B,H,w,D]`` are the ``w`` real tokens before the forward, oldest first (None, or rows
    of zeros, where there is no such token: its readout is discarded anyway). Token ``u`` is read from the memory
    after token ``u + w``, i.e. real token ``j`` of the forward reads the past token ``j`` (``j < w``) or the
    forward's real token ``j - w``; the tokens whose ``u + w`` lies beyond the forward are read from the final
    memory (*provisional*).

    Returns ``scores [B,H,T]`` of the forward's tokens (column order), ``past_scores [B,H,w]`` of the past tokens
    (final for ``j < n_real``, provisional after; None without the delayed readout) and the state after the
    forward's last real token. ``read_key, read_value``: as in :func:`mlstm_scores`, the forward's tokens as the
    readout reads them (``past_key, past_value`` are already read back from the store).
    """
    w_q, w_k, w_v, w_i, b_i, w_f, b_f, norm_weight, a, b, skip_w1, skip_b1, skip_w2 = params
    bsz, heads, t, _ = key.shape
    x = _cat_kv(key, value)
    q, k, v, ig, fg = _project(x, w_q, w_k, w_v, w_i, b_i, w_f, b_f, softcap)
    if delay > 0 and read_key is not None:
        x = _cat_kv(read_key, read_value)
        q = _project(x, w_q, w_k, w_v, w_i, b_i, w_f, b_f, softcap)[0]
    if valid is None:
        valid = torch.ones(bsz, t, dtype=torch.bool, device=key.device)
    valid = valid.to(torch.bool)
    # rank order: each row's real tokens first, in order, then its padding
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)  # [B,T] column of rank r
    n_real = valid.sum(dim=1)  # [B]
    idx = torch.arange(t, device=key.device)
    real_r = idx[None, :] < n_real[:, None]  # [B,T]

    def by_rank(x: Tensor) -> Tensor:
        o = order[:, None, :].expand(bsz, heads, t)
        return torch.gather(x, 2, o if x.dim() == 3 else o[..., None].expand(-1, -1, -1, x.shape[-1]))

    q, k, v, ig, fg = (by_rank(x) for x in (q, k, v, ig, fg))
    keep = real_r[:, None, :]
    ig = torch.where(keep, ig, -1e4)  # padding neither writes (input gate -> 0) nor decays (forget gate -> 1)
    fg = torch.where(keep, fg, 1e4)
    past_scores = None
    if delay == 0:
        h, state = mlstm_chunkwise_unchecked(q, k, v, ig, fg, state, chunk_size, eps, matmul_dtype)
        scores_r = _score_head(h, a, b, norm_weight, norm_eps)
    else:
        if past_key is None:
            q_past = torch.zeros(bsz, heads, delay, q.shape[-1], device=q.device, dtype=q.dtype)
            x_past = torch.zeros(bsz, heads, delay, x.shape[-1], device=x.device, dtype=x.dtype)
        else:
            x_past = _cat_kv(past_key, past_value)
            q_past = _project(x_past, w_q, w_k, w_v, w_i, b_i, w_f, b_f, softcap)[0]
        ext = torch.cat([q_past, q], dim=2)  # [B,H,w+T,D]: query features by rank over the past and the forward
        h_seq, state = mlstm_chunkwise_unchecked(ext[:, :, :t], k, v, ig, fg, state, chunk_size, eps, matmul_dtype)
        h_end = mlstm_readout_unchecked(ext, *state, eps)  # [B,H,w+T,Dv] every token read from the final memory
        final = (torch.arange(delay + t, device=q.device)[None, :] < n_real[:, None])[:, None, :, None]
        h = torch.where(final, F.pad(h_seq, (0, 0, 0, delay)), h_end)  # token of ext rank j read at rank j
        scores_ext = _score_head(h, a, b, norm_weight, norm_eps)
        past_scores, scores_r = scores_ext[:, :, :delay], scores_ext[:, :, delay:]
        past_scores = past_scores + _skip_score(x_past, skip_w1, skip_b1, skip_w2)
    inverse = torch.argsort(order, dim=1)  # rank of each column
    scores = torch.gather(scores_r, 2, inverse[:, None, :].expand(bsz, heads, t)) + _skip_score(x, skip_w1, skip_b1, skip_w2)
    return scores, past_scores, state


_COMPILED: dict[tuple[str, str], Callable] = {}
# torch.compile modes MLSTMScorer(compile_mode=...) takes: "default" (kernels fused, launched one by one) or
# "reduce-overhead" (the same kernels replayed as CUDA graphs: one launch per compiled forward / backward)
COMPILE_MODES = ("default", "reduce-overhead")
_COMPILE_DEVICES = ("cuda",)  # device types on which MLSTMScorer(compile=True) runs the compiled function
_COMPILE_BACKEND = "inductor"


def _compiled_scores(backend: str = "inductor", mode: str = "default") -> Callable:
    """``torch.compile(mlstm_scores, dynamic=False, mode=mode)``, created on first use (one per backend and mode).

    ``dynamic=False``: one graph per input shape (sequence length, chunk count) and per set of Python constants
    (readout delay, chunk size, ...); a training run with a fixed sequence length compiles once. ``mode`` is one of
    :data:`COMPILE_MODES` (``"reduce-overhead"``: CUDA graphs, ``docs/DESIGN.md`` section 5, "Launch overhead")."""
    fn = _COMPILED.get((backend, mode))
    if fn is None:
        fn = _COMPILED[(backend, mode)] = torch.compile(mlstm_scores, dynamic=False, backend=backend,
                                                        **({} if mode == "default" else {"mode": mode}))
    return fn


class _TF32Scope(torch.autograd.Function):
    """``fn(*args)`` with its forward *and* its backward inside :func:`tf32_matmuls` (the compiled mLSTM path:
    the context manager cannot be traced inside the compiled region, and the compiled backward runs later, at
    ``.backward()``, outside any ``with`` block of the forward). The forward builds ``fn``'s own autograd graph on
    detached inputs; the backward differentiates it with ``torch.autograd.grad`` (first-order gradients only)."""

    @staticmethod
    def forward(ctx, fn, *args):
        ctx.set_materialize_grads(False)
        inputs = [a.detach().requires_grad_(a.requires_grad) if isinstance(a, Tensor) else a for a in args]
        with torch.enable_grad(), tf32_matmuls():
            outs = fn(*inputs)
        ctx.inner = (inputs, outs)
        return tuple(o.detach() for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        inputs, outs = ctx.inner
        del ctx.inner
        pairs = [(o, g) for o, g in zip(outs, grads) if g is not None and o.requires_grad]
        wanted = [i for i, a in enumerate(inputs) if isinstance(a, Tensor) and a.requires_grad]
        result = [None] * len(inputs)
        if pairs and wanted:
            with tf32_matmuls():
                got = torch.autograd.grad([o for o, _ in pairs], [inputs[i] for i in wanted], [g for _, g in pairs],
                                          allow_unused=True)
            for i, g in zip(wanted, got):
                result[i] = g
        return (None, *result)


class MLSTMScorer(KVScorer):
    """Stateful scorer: one mLSTM cell per KV head with a delayed readout.

    Per head ``h`` and token ``t`` with ``x_t = [k_t; v_t]`` (``2D``):

    - ``q̃_t = φ(W_q x_t)``, ``k̃_t = φ(W_k x_t)`` with ``W_q, W_k [2D, D/2]`` and the Hedgehog map φ
      (so ``q̃, k̃`` have dim ``D``); ``ṽ_t = W_v x_t`` with ``W_v [2D, Dv]``, ``Dv = value_dim`` (default ``D/2``).
    - gates ``ĩ_t = cap(x_t·w_i + b_i)``, ``f̃_t = cap(x_t·w_f + b_f)``, ``cap(z) = c·tanh(z/c)`` with
      ``c = gate_softcap`` (``None``: no cap); ``i = exp(ĩ)``, ``f = σ(f̃)``; stabilised mLSTM state in float32.
    - readout ``h_{u|q} = q̃_uᵀ C_q / max(|q̃_uᵀ n_q|, exp(-m_q))`` and score
      ``r̂_u = aᵀ SiLU(Norm(h_{u|q})) + b``; Norm is a per-head RMSNorm when ``use_norm``.

    ``delayed_readout=True`` reads token ``u`` at ``q = u + window`` (the state after token ``q``); tokens
    ``u > T-1-window`` have no such state inside the sequence and are read from the final state at ``T-1``
    (causal; they are still in the protected window at the end of the sequence, so those scores are
    *provisional* and are replaced in decoding by ``step`` once token ``u + window`` arrives).
    ``delayed_readout=False`` reads ``u`` at ``q = u`` (the ablation).

    Initialisation (appendix E.5): ``W_q = W_k`` copy the key half of ``x`` folded to ``D/2`` dims
    (``W[j, j mod D/2] = 1/sqrt(2)`` for the key rows, 0 for the value rows); ``W_v`` does the same from the value
    half; ``w_i = w_f = 0``, ``b_i = 0`` (every token written with weight 1), ``b_f`` = linspace(3, 6) over heads
    (``σ(3) = 0.95`` ... ``σ(6) = 0.9975``: memories of ~20 to ~400 tokens, kept early); ``a = 0``, ``b = 0``
    (neutral ranking at start); RMSNorm weight 1.

    ``skip=True`` (default False) is the paper's optional skip connection from the delayed token to the score
    (appendix E.5, "practical variants"), here ``MLPScorer``'s two-layer MLP on ``x_u`` (hidden ``skip_hidden``,
    default ``2D``; output layer zero at init) added to the score:
    ``r̂_u = aᵀ SiLU(Norm(h_{u|q})) + b + w2ᵀ SiLU(W1ᵀ x_u + b1)``. Without it the score depends on token ``u`` only
    through ``q̃_u`` (the value half of ``x_u`` not at all at init) and the readout is a normalised mixture of the
    *memory's* values, which the later tokens dominate (at the default forget biases ``u``'s own write has decayed
    by ``σ(3)^w`` to ``σ(6)^w`` when it is read at ``u + w``), so the needles, whose importance is in their own
    keys, are hard to score (``benchmarks/kvpop_scorer_fit.py``, ``docs/DESIGN.md`` section 5, "The skip connection"). ``step`` uses ``u``'s
    cached key/value for it, as for ``q̃_u``.

    ``compile=True`` (default) runs the full-sequence forward (``forward``/``prefill``) through
    ``torch.compile(dynamic=False)`` when the inputs are on CUDA and autograd is on (training; the first call per
    input shape compiles); without autograd (``no_grad``/``inference_mode``), on other devices and with
    ``compile=False`` it runs eagerly. Both run the same code (same results to float32 rounding); ``step`` is
    always eager. ``compile_mode`` (:data:`COMPILE_MODES`): ``"default"`` launches the compiled kernels one by one,
    ``"reduce-overhead"`` replays them as CUDA graphs (torch's cudagraph trees; not with ``matmul_dtype="tf32"``):
    the training step is launch-bound, and the compiled scorer is most of the launches KVpop adds.

    ``matmul_dtype`` (``"float32"`` default, ``"tf32"``, ``"bfloat16"``): operand precision of the mLSTM's chunk
    matmuls (:func:`kvlearn.ops.mlstm.mlstm_chunkwise`; gates and stabiliser stay float32). With ``"tf32"`` on the
    compiled path the whole compiled forward and backward run inside :func:`kvlearn.ops.mlstm.tf32_matmuls`
    (restored afterwards), so there *every* float32 matmul of the scorer is TF32, the ``[k; v]`` projections
    included; eagerly only the chunk matmuls are. ``step`` (decoding) has no chunk matmuls and is unaffected.
    """

    def __init__(
        self,
        num_kv_heads: int,
        head_dim: int,
        window: int,
        delayed_readout: bool = True,
        use_norm: bool = False,
        chunk_size: int = 64,
        value_dim: int | None = None,
        gate_softcap: float | None = 15.0,
        forget_bias_range: tuple[float, float] = (3.0, 6.0),
        compile: bool = True,
        matmul_dtype: str = "float32",
        skip: bool = False,
        compile_mode: str = "default",
        skip_hidden: int | None = None,
    ) -> None:
        super().__init__(num_kv_heads, head_dim)
        check(
            head_dim % 2 == 0,
            f"head_dim={head_dim} is invalid for MLSTMScorer: expected an even head_dim (Hedgehog halves it)",
        )
        check_int("window", window, 1)
        check_int("chunk_size", chunk_size, 1)
        check(isinstance(delayed_readout, bool), f"delayed_readout={delayed_readout!r} is invalid: expected True or False")
        check(isinstance(use_norm, bool), f"use_norm={use_norm!r} is invalid: expected True or False")
        check(isinstance(compile, bool), f"compile={compile!r} is invalid: expected True or False")
        check(isinstance(skip, bool), f"skip={skip!r} is invalid: expected True or False")
        check_matmul_dtype(matmul_dtype)
        check(compile_mode in COMPILE_MODES,
              f"compile_mode={compile_mode!r} is unknown: expected one of {', '.join(COMPILE_MODES)}")
        check(compile_mode == "default" or matmul_dtype != "tf32",
              f"compile_mode={compile_mode!r} with matmul_dtype='tf32' is not supported (the TF32 scope runs the "
              "compiled backward inside its own autograd.Function): expected compile_mode='default', or matmul_dtype "
              "'float32' or 'bfloat16'")
        value_dim = head_dim // 2 if value_dim is None else value_dim
        check_int("value_dim", value_dim, 1)
        check(
            gate_softcap is None or (isinstance(gate_softcap, (int, float)) and gate_softcap > 0),
            f"gate_softcap={gate_softcap!r} is invalid: expected None or a number > 0",
        )
        lo, hi = forget_bias_range
        check(lo <= hi, f"forget_bias_range={forget_bias_range!r} is invalid: expected (low, high) with low <= high")

        self.window = window
        self.delayed_readout = delayed_readout
        self.readout_delay = window if delayed_readout else 0
        self.use_norm = use_norm
        self.chunk_size = chunk_size
        self.compile = compile
        self.compile_mode = compile_mode
        self.matmul_dtype = matmul_dtype
        self.value_dim = value_dim
        self.gate_softcap = None if gate_softcap is None else float(gate_softcap)
        self.feature_dim = head_dim  # Hedgehog doubles the D/2 projection
        self.eps = 1e-6  # mLSTM readout eps (stabilised scale)
        self.norm_eps = 1e-6

        h, d, half = num_kv_heads, head_dim, head_dim // 2
        w_qk = torch.zeros(2 * d, half)
        w_qk[:d] = _fold_identity(d, half)
        w_v = torch.zeros(2 * d, value_dim)
        w_v[d:] = _fold_identity(d, value_dim)
        self.w_q = nn.Parameter(w_qk.expand(h, -1, -1).clone())
        self.w_k = nn.Parameter(w_qk.expand(h, -1, -1).clone())
        self.w_v = nn.Parameter(w_v.expand(h, -1, -1).clone())
        self.w_i = nn.Parameter(torch.zeros(h, 2 * d))
        self.b_i = nn.Parameter(torch.zeros(h))
        self.w_f = nn.Parameter(torch.zeros(h, 2 * d))
        self.b_f = nn.Parameter(torch.linspace(float(lo), float(hi), h) if h > 1 else torch.full((1,), (lo + hi) / 2))
        self.norm_weight = nn.Parameter(torch.ones(h, value_dim)) if use_norm else None
        self.a = nn.Parameter(torch.zeros(h, value_dim))
        self.b = nn.Parameter(torch.zeros(h))
        self.skip = skip
        if skip:  # MLPScorer's per-token path on x_u, its output layer zero (neutral ranking at start)
            hidden = 2 * d if skip_hidden is None else skip_hidden
            check_int("skip_hidden", hidden, 1)
            bound = 1.0 / math.sqrt(2 * d)
            self.skip_w1 = nn.Parameter(torch.empty(h, 2 * d, hidden).uniform_(-bound, bound))
            self.skip_b1 = nn.Parameter(torch.empty(h, hidden).uniform_(-bound, bound))
            self.skip_w2 = nn.Parameter(torch.zeros(h, hidden))
        else:
            self.skip_w1 = self.skip_b1 = self.skip_w2 = None

    def extra_repr(self) -> str:
        return (
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, window={self.window}, "
            f"delayed_readout={self.delayed_readout}, use_norm={self.use_norm}, value_dim={self.value_dim}, "
            f"gate_softcap={self.gate_softcap}, chunk_size={self.chunk_size}, compile={self.compile}, compile_mode={self.compile_mode!r}, "
            f"matmul_dtype={self.matmul_dtype!r}, skip={self.skip}"
        )

    # -- pieces ---------------------------------------------------------------------------------------------
    def score_params(self) -> tuple:
        """The parameter tensors :func:`mlstm_scores` takes as ``params``, in its order."""
        return (self.w_q, self.w_k, self.w_v, self.w_i, self.b_i, self.w_f, self.b_f, self.norm_weight, self.a, self.b,
                self.skip_w1, self.skip_b1, self.skip_w2)

    def _features(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """``x [B,H,...,2D]`` -> ``q̃ [..,D]``, ``k̃ [..,D]``, ``ṽ [..,Dv]``, ``ĩ [..]``, ``f̃ [..]``."""
        return _project(x, self.w_q, self.w_k, self.w_v, self.w_i, self.b_i, self.w_f, self.b_f, self.gate_softcap)

    def _head(self, h: Tensor) -> Tensor:
        """Readout ``h [B,H,...,Dv]`` -> score ``[B,H,...]``: ``aᵀ SiLU(Norm(h)) + b``."""
        return _score_head(h, self.a, self.b, self.norm_weight, self.norm_eps)

    # -- full sequence --------------------------------------------------------------------------------------
    def _check_read(self, key: Tensor, read_key: Tensor | None, read_value: Tensor | None) -> None:
        """``read_key, read_value`` (both or neither) shaped as ``key``: the readout's form of the same tokens."""
        if read_key is None and read_value is None:
            return
        check(read_key is not None and read_value is not None, "only one of read_key/read_value given: expected both")
        check(self.readout_delay > 0, "read_key/read_value given with delayed_readout=False: expected None (the "
                                      "immediate readout reads each token as it arrives)")
        self._check_kv(read_key, read_value, names=("read_key", "read_value"))
        check(read_key.shape == key.shape, f"read_key.shape={tuple(read_key.shape)} is invalid: expected the key's "
                                           f"{tuple(key.shape)} (the same tokens in the form the readout reads)")

    def _run(self, key: Tensor, value: Tensor, valid: Tensor | None = None, read_key: Tensor | None = None,
             read_value: Tensor | None = None) -> tuple[Tensor, MLSTMState]:
        self._check_kv(key, value)
        self._check_read(key, read_key, read_value)
        if valid is not None:
            check(isinstance(valid, Tensor) and tuple(valid.shape) == (key.shape[0], key.shape[2]),
                  f"valid shape {tuple(getattr(valid, 'shape', ()))} is invalid: expected [batch, seq] = "
                  f"{(key.shape[0], key.shape[2])}")
        # compiled for training on CUDA (fuses the elementwise work on [B,H,NC,L,L] and the feature maps in forward
        # and backward); eager without autograd (prefill of prompts of many lengths: one compile per length would
        # cost more than it saves) and on other devices
        use_compiled = self.compile and torch.is_grad_enabled() and key.device.type in _COMPILE_DEVICES
        fn = _compiled_scores(_COMPILE_BACKEND, self.compile_mode) if use_compiled else mlstm_scores
        consts = (self.readout_delay, self.chunk_size, self.gate_softcap, self.eps, self.norm_eps, self.matmul_dtype)
        if use_compiled and self.matmul_dtype == "tf32":  # the TF32 scope around the compiled forward and backward
            scores, c, n, m = _TF32Scope.apply(lambda k, v, val, rk, rv, *p: fn(k, v, val, p, *consts, rk, rv), key,
                                               value, valid, read_key, read_value, *self.score_params())
        else:
            scores, c, n, m = fn(key, value, valid, self.score_params(), *consts, read_key, read_value)
        return scores, MLSTMState(c, n, m)

    def forward(self, key: Tensor, value: Tensor, read_key: Tensor | None = None,
                read_value: Tensor | None = None) -> Tensor:
        """Scores ``[B, H, T]`` float32; with the delayed readout the last ``window`` are provisional.
        ``read_key, read_value`` (optional, shaped as ``key``): the tokens as the delayed readout reads them (their
        stored form, :func:`mlstm_scores`); the memory is written from ``key, value``."""
        return self._run(key, value, None, read_key, read_value)[0]

    def prefill(
        self, key: Tensor, value: Tensor, valid: Tensor | None = None, state: MLSTMState | None = None
    ) -> tuple[Tensor, MLSTMState]:
        """``forward``'s scores and the mLSTM state after the last token (to continue with ``step`` or another
        ``prefill``).

        ``valid``: optional ``[B, T]`` bool; padding (``False``) leaves the memory untouched. Without ``state``
        (an empty memory) the padding must be a prefix of each row (left padding), so that the readout ``window``
        columns later is ``window`` real tokens later; with ``state`` it may be anywhere (see
        :meth:`continue_prefill`).

        ``state``: the memory after earlier tokens (``None``: empty). The scores of the chunk's tokens are then
        those of the whole sequence; with the delayed readout the earlier tokens' readouts that fall into this
        chunk need their key/value: use :meth:`continue_prefill`, which returns them too."""
        if state is None:
            return self._run(key, value, valid)
        scores, _, state = self.continue_prefill(key, value, valid, state)
        return scores, state

    def continue_prefill(
        self,
        key: Tensor,
        value: Tensor,
        valid: Tensor | None = None,
        state: MLSTMState | None = None,
        past_key: Tensor | None = None,
        past_value: Tensor | None = None,
        read_key: Tensor | None = None,
        read_value: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None, MLSTMState]:
        """Continue a sequence by a chunk (chunked prefill): ``(scores [B,H,T], past_scores [B,H,w] | None, state)``.

        Args:
            key, value: ``[B, H, T, D]`` the chunk.
            valid: optional ``[B, T]`` bool, padding (``False``) anywhere in a row; each row's real tokens are
                scored as that row alone would be.
            state: the memory after the earlier tokens (``None``: empty).
            past_key, past_value: delayed readout only: ``[B, H, w, D]`` the ``w = window`` real tokens before the
                chunk, oldest first (rows of zeros where a row has fewer earlier tokens; ``None``: none at all).
            read_key, read_value: optional ``[B, H, T, D]``, the chunk's tokens as the delayed readout reads them
                (the store's form, as ``past_key`` is; ``None``: ``key, value``).

        Returns:
            ``scores``: the chunk's scores (the last ``w`` real tokens' provisional, as in :meth:`prefill`);
            ``past_scores``: delayed readout only, new scores of the ``w`` past tokens: *final* for the past token
            ``j`` when the chunk has more than ``j`` real tokens (token ``u + w`` arrived in it), provisional (read
            from the new state) otherwise; ``state``: the memory after the chunk. The cell math is the recurrence
            from ``state`` (chunk boundaries change nothing but float32 rounding).
        """
        self._check_kv(key, value)
        self._check_read(key, read_key, read_value)
        b, t = key.shape[0], key.shape[2]
        if valid is not None:
            check(isinstance(valid, Tensor) and tuple(valid.shape) == (b, t),
                  f"valid shape {tuple(getattr(valid, 'shape', ()))} is invalid: expected [batch, seq] = {(b, t)}")
        if state is not None:
            check_mlstm_state(state, b, self.num_kv_heads, self.feature_dim, self.value_dim, key.device)
        if self.readout_delay == 0:
            check(past_key is None and past_value is None,
                  "past_key/past_value given with delayed_readout=False: expected None (no readout is delayed)")
        elif past_key is not None or past_value is not None:
            check(past_key is not None and past_value is not None, "only one of past_key/past_value given: expected both")
            self._check_kv(past_key, past_value, names=("past_key", "past_value"))
            check(tuple(past_key.shape[:3]) == (b, self.num_kv_heads, self.readout_delay),
                  f"past_key.shape={tuple(past_key.shape)} is invalid: expected [batch, kv_heads, window, head_dim] "
                  f"with batch={b}, window={self.readout_delay}")
        return mlstm_continue_scores(key, value, valid, state, past_key, past_value, self.score_params(),
                                     self.readout_delay, self.chunk_size, self.gate_softcap, self.eps, self.norm_eps,
                                     self.matmul_dtype, read_key, read_value)

    # -- decoding -------------------------------------------------------------------------------------------
    @property
    def stateful(self) -> bool:
        return True

    def init_state(self, batch: int, device: torch.device | str | None = None) -> MLSTMState:
        """Empty state: ``C [B,H,D,Dv]``, ``n [B,H,D]``, ``m [B,H]`` zeros (float32)."""
        check_int("batch", batch, 1)
        return mlstm_zero_state(batch, self.num_kv_heads, self.feature_dim, self.value_dim, device)

    def step(
        self,
        key_t: Tensor,
        value_t: Tensor,
        key_u: Tensor | None = None,
        value_u: Tensor | None = None,
        state: MLSTMState | None = None,
    ) -> tuple[Tensor | None, MLSTMState]:
        """Token ``t`` (``[B, H, D]``) updates the state; returns the final score ``[B, H]`` of ``u = t - readout_delay``.

        Delayed readout: pass the cached key/value of ``u = t - window`` (``None`` while ``u < 0``: the score is
        then ``None``). Immediate readout: ``key_u``/``value_u`` must be ``None`` (``u = t``).
        ``state=None`` means the empty state.
        """
        x_t = self._x(key_t, value_t, ndim=3, names=("key_t", "value_t"))
        if state is None:
            state = self.init_state(x_t.shape[0], x_t.device)
        if self.readout_delay == 0:
            check(
                key_u is None and value_u is None,
                "key_u/value_u given with delayed_readout=False: expected None (the scored token is t itself)",
            )
            x_u = x_t
            q = self._features(x_t)[0]
        elif key_u is None or value_u is None:
            check(key_u is None and value_u is None, "only one of key_u/value_u given: expected both or neither")
            q = None
        else:
            x_u = self._x(key_u, value_u, ndim=3, names=("key_u", "value_u"))
            check(x_u.shape == x_t.shape, f"key_u.shape={tuple(key_u.shape)} differs from key_t.shape={tuple(key_t.shape)}")
            q = self._features(x_u)[0]
        _, k, v, ig, fg = self._features(x_t)
        h, new_state = mlstm_step(q if q is not None else torch.zeros_like(k), k, v, ig, fg, state, eps=self.eps)
        if q is None:
            return None, new_state
        return self._head(h) + _skip_score(x_u, self.skip_w1, self.skip_b1, self.skip_w2), new_state

    def state_bytes_per_head(self) -> int:
        """float32 ``C [D, Dv]`` + ``n [D]`` + ``m``: ``4·(D·Dv + D + 1)`` bytes per KV head and sequence."""
        return 4 * (self.feature_dim * self.value_dim + self.feature_dim + 1)
