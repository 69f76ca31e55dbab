"""KVpop scorers trained through the distillation loss: a straight-through soft retention on sampled query rows.

The retrofit trains KVpop's scorers by the boundary loss alone: the hard running top-k (ranks, cutoffs) has no
gradient in the priorities, so the KD loss never tells a scorer that a token it let go was needed. DMS's gates learn
from the KD loss through a relaxed eviction; on trace at CR 94% DMS's student keeps what KVpop's miss
(docs/DESIGN.md section 5, "CR 94% with window 128 for every student"). This module is the direct test of that
reading: the same KD gradient sent into KVpop's priorities, with the forward left exactly as it was.

Per layer that keeps its own cache, on ``n`` query rows ``R`` sampled per step from the rows where the running
top-k evicts (``q >= sinks + window + topk``), with the student's static priorities ``p̂ [B, Hkv, T]`` (float32,
differentiable in the scorer and the decay) and its int32 ranks and cutoffs (:mod:`kvlearn.ops.fenwick`):

* the cutoff priority ``c_q = p̂[the key of rank cutoffs[q]]``: the weakest kept eligible key's priority (the sort's
  values, so the gradient reaches that key too and the bias depends on priority differences only, as the ranking
  does);
* the soft retention bias ``b_qk`` over the keys ``k <= q``: ``0`` for the sinks (``k < sinks``) and the window
  (``q - k < window``); for an eligible key ``log σ((p̂_k - c_q) / τ)`` (a key above the cutoff ``-> 0``, below it
  ``-> -inf`` as ``τ -> 0``: the hard rule); ``0`` while nothing is evicted yet at ``q`` (``cutoffs[q] = T``) and
  ``-inf`` with no long-range budget (``cutoffs[q] = -1``);
* the soft attention ``s_q = softmax_k(scale q·k + b_qk) v`` with ``q``, ``k``, ``v`` *detached* (the backbone keeps
  exactly its hard-path gradient; only ``p̂`` receives this path's);
* ``out_q <- out_q + λ (N / n) (s_q - stopgrad(s_q))`` with ``N`` the evicting rows: zero in the forward (bit for
  bit), so training and serving compute the same hard retention; in the backward the KD loss's gradient at the hard
  output row reaches ``p̂`` through the soft retention (a straight-through estimator: forward hard, gradient
  soft). ``N / n`` makes ``λ = 1`` an unbiased estimate of the gradient that every evicting row would send.

Rows are computed in float32 with autocast off, under activation checkpointing (nothing of size ``[B, Hq, n, T]``
is kept for the backward). The cost is one ``[n, T]`` attention per layer, but in eager mode it is memory-bound: the
bias and the logits pass over ``[B, H, n, T]`` float32 tensors about a dozen times, forward, recompute and backward.
``ScorerKD.compile`` (``RetrofitConfig.scorer_kd_compile``, ``kvlearn retrofit --scorer-kd-compile``) runs the soft
rows through ``torch.compile`` on CUDA (:func:`compiled_soft_retention_rows`: the elementwise passes fused; the same
values to float32 rounding, tested against the eager function); other devices run them eagerly. Sharing layers
(``kv_bits`` ``"share"``) send no such gradient to their anchor's scorer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from ..errors import check, check_int, check_positive

__all__ = ["ScorerKD", "scorer_kd_rows", "cutoff_priorities", "soft_retention_bias", "soft_retention_rows",
           "compiled_soft_retention_rows", "straight_through_retention", "COMPILE_DEVICES"]

COMPILE_DEVICES = ("cuda",)  # device types on which ScorerKD(compile=True) runs the compiled soft rows


@dataclass(frozen=True)
class ScorerKD:
    """One forward's straight-through scorer distillation (see the module docstring).

    ``rows``: int64 ``[n]`` distinct query positions in ``[0, seq_len)``, sorted (:func:`scorer_kd_rows`), on the
    model's device (their range is checked here when they are on the CPU: a check of device rows would make the host
    wait for the GPU). ``weight``: ``λ > 0`` times ``N / n`` (the caller folds the row scaling in). ``temperature``:
    ``τ > 0``. ``seq_len``: the length of the forwards they are for. ``compile``: on :data:`COMPILE_DEVICES` the soft
    rows run through :func:`compiled_soft_retention_rows` (elsewhere, and when False, eagerly)."""

    rows: Tensor
    weight: float
    temperature: float
    seq_len: int
    compile: bool = False

    def __post_init__(self) -> None:
        check(isinstance(self.rows, Tensor) and self.rows.dim() == 1 and self.rows.numel() >= 1
              and self.rows.dtype == torch.int64,
              f"rows={self.rows!r} is invalid: expected a non-empty int64 [n] tensor of query positions")
        check_positive("weight", self.weight)
        check_positive("temperature", self.temperature)
        check_int("seq_len", self.seq_len, 1)
        check(isinstance(self.compile, bool), f"compile={self.compile!r} is invalid: expected True or False")
        if self.rows.device.type == "cpu":
            lo, hi = int(self.rows.min()), int(self.rows.max())
            check(0 <= lo and hi < self.seq_len,
                  f"rows reach positions {lo}..{hi}: expected positions in [0, seq_len={self.seq_len})")


def scorer_kd_rows(seq_len: int, sinks: int, window: int, topk: int, num: int,
                   generator: torch.Generator | None = None) -> tuple[Tensor, float]:
    """``(rows, scale)``: ``min(num, N)`` distinct query positions drawn uniformly without replacement from the ``N =
    seq_len - (sinks + window + topk)`` rows where the running top-k evicts, sorted, int64 on the CPU; ``scale = N /
    len(rows)`` (the factor that makes the sampled rows' gradient an unbiased estimate of all ``N`` rows')."""
    check_int("num", num, 1)
    check_int("topk", topk, 1, hint=" (a scorer gradient needs a long-range budget)")
    lo = sinks + window + topk
    check(seq_len > lo, f"seq_len={seq_len} is invalid: expected > sinks + window + topk = {lo} (no row evicts)")
    span = seq_len - lo
    n = min(num, span)
    rows = torch.randperm(span, generator=generator)[:n].sort().values + lo
    return rows, span / n


def cutoff_priorities(priorities: Tensor, cutoffs: Tensor) -> Tensor:
    """``c [B, H, T]`` float32: per query the priority of the key whose rank is ``cutoffs[q]`` (the weakest kept
    eligible key), taken from the sorted priorities (differentiable). ``priorities`` float32 ``[B, H, T]`` (the ones
    the ranks were computed from), ``cutoffs`` int32 ``[B, H, T]``; the sentinels (``T``: keep all, ``-1``: keep
    none) give an arbitrary finite value that :func:`soft_retention_bias` does not read."""
    T = priorities.shape[-1]
    ordered = torch.sort(priorities, dim=-1, descending=True, stable=True).values  # rank r -> priority
    return ordered.gather(-1, cutoffs.long().clamp(0, T - 1))


def soft_retention_bias(priorities: Tensor, cutoff_rows: Tensor, cutoff_ranks_rows: Tensor, rows: Tensor, sinks: int,
                        window: int, temperature: float) -> Tensor:
    """The soft retention bias ``b [B, H, n, T]`` float32 of the query rows ``rows [n]`` (module docstring).

    ``priorities [B, H, T]`` float32; ``cutoff_rows [B, H, n]`` the rows' cutoff priorities
    (:func:`cutoff_priorities`); ``cutoff_ranks_rows [B, H, n]`` their int cutoffs (for the sentinels)."""
    T = priorities.shape[-1]
    k = torch.arange(T, device=priorities.device)[None, :]  # [1, T]
    q = rows.to(priorities.device)[:, None]  # [n, 1]
    causal = k <= q
    eligible = causal & (k >= sinks) & (q - k >= window)  # [n, T]
    soft = F.logsigmoid((priorities[:, :, None, :] - cutoff_rows[..., None]) / temperature)  # [B, H, n, T]
    keep_all = (cutoff_ranks_rows >= T)[..., None]
    keep_none = (cutoff_ranks_rows < 0)[..., None]
    zero = torch.zeros((), dtype=soft.dtype, device=soft.device)
    ninf = torch.full((), float("-inf"), dtype=soft.dtype, device=soft.device)
    soft = torch.where(keep_all, zero, torch.where(keep_none, ninf, soft))
    bias = torch.where(eligible, soft, zero)
    return bias.masked_fill(~causal, float("-inf"))


def soft_retention_rows(query_rows: Tensor, key: Tensor, value: Tensor, priorities: Tensor, cutoffs: Tensor,
                        rows: Tensor, sinks: int, window: int, temperature: float, scale: float) -> Tensor:
    """Soft-retention attention ``[B, Hq, n, D]`` float32 of the query rows ``query_rows [B, Hq, n, D]`` (the queries
    at positions ``rows [n]``) over ``key``/``value [B, Hkv, T, D]``, GQA (query head ``h`` reads KV head ``h // G``).
    Differentiable in every input; the caller detaches the ones that must not learn from it."""
    B, Hq, n, D = query_rows.shape
    Hkv = key.shape[1]
    G = Hq // Hkv
    cut = cutoff_priorities(priorities, cutoffs)
    r = rows.to(priorities.device)
    bias = soft_retention_bias(priorities, cut[:, :, r], cutoffs[:, :, r], r, sinks, window, temperature)
    q = query_rows.float().reshape(B, Hkv, G, n, D)
    logits = torch.einsum("bhgnd,bhtd->bhgnt", q, key.float()) * scale + bias[:, :, None]  # [B, Hkv, G, n, T]
    probs = torch.softmax(logits, dim=-1)
    out = torch.einsum("bhgnt,bhtd->bhgnd", probs, value.float())
    return out.reshape(B, Hq, n, D)


_COMPILED: dict[str, object] = {}


def compiled_soft_retention_rows(backend: str = "inductor"):
    """``torch.compile(soft_retention_rows, dynamic=False, fullgraph=True)``, created on first use (one per backend):
    the bias, the softmax and their backward fused instead of a dozen float32 passes over ``[B, H, n, T]``. A training
    run with a fixed sequence length and row count compiles once (per distinct ``sinks``/``window``, constants of the
    graph)."""
    if backend not in _COMPILED:
        _COMPILED[backend] = torch.compile(soft_retention_rows, dynamic=False, fullgraph=True, backend=backend)
    return _COMPILED[backend]


def straight_through_retention(out: Tensor, query: Tensor, key: Tensor, value: Tensor, priorities: Tensor,
                               cutoffs: Tensor, sinks: int, window: int, scale: float | None,
                               kd: ScorerKD) -> Tensor:
    """``out [B, Hq, T, D]`` (the hard retention's attention output) plus ``λ (s - stopgrad(s))`` on ``kd.rows``:
    equal to ``out`` in the forward, and in the backward the gradient at those rows also reaches ``priorities``
    through the soft retention (module docstring). ``query [B, Hq, T, D]``, ``key``/``value [B, Hkv, T, D]`` (what the
    hard path attended; detached here), ``priorities [B, Hkv, T]`` float32, ``cutoffs [B, Hkv, T]`` int32."""
    check(query.shape[2] == kd.seq_len,
          f"a forward of {query.shape[2]} tokens got scorer KD rows for seq_len={kd.seq_len}: expected equal lengths")
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    rows = kd.rows.to(query.device)
    q_rows = query.detach().index_select(2, rows)
    k, v = key.detach(), value.detach()

    rows_fn = (compiled_soft_retention_rows() if kd.compile and query.device.type in COMPILE_DEVICES
               else soft_retention_rows)

    def soft(p: Tensor) -> Tensor:
        return rows_fn(q_rows, k, v, p, cutoffs, rows, sinks, window, kd.temperature, scale)

    with torch.autocast(device_type=query.device.type, enabled=False):
        s = checkpoint(soft, priorities, use_reentrant=False) if priorities.requires_grad else soft(priorities)
        delta = (s - s.detach()) * kd.weight  # exactly 0 in the forward
    return out.index_add(2, rows, delta.to(out.dtype))
