"""KVpop retention policy pieces: learned decay, static priorities, teacher cutoffs and boundary decisions.

Paper references: Eq. 4-6 (eligible set, teacher policy, labels), appendix B.3 (Eq. 18-21, decay and static
priorities), B.6 (query sampling) and C (running top-k cutoffs). Only decay step ``n = 1`` is modelled here: then the
effective score ``r_t + (q - t) log γ`` ranks tokens exactly like the static priority ``r_t - t log γ`` (Eq. 20).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from kvlearn.errors import check, check_int
from kvlearn.ops.fenwick import running_cutoff, static_ranks

__all__ = [
    "log_decay",
    "LearnedDecay",
    "static_priorities",
    "TeacherPolicy",
    "teacher_policy",
    "teacher_policies",
    "stacked_teacher_policy",
    "BoundaryDecisions",
    "boundary_decisions",
    "sample_query_positions",
]


# ----------------------------------------------------------------------------------------------------------------
# Validation helpers
# ----------------------------------------------------------------------------------------------------------------


def _check_budget(sinks, window, topk) -> None:
    check_int("sinks", sinks, 0)
    check_int("window", window, 1)
    check_int("topk", topk, 0)


def _check_decay_range(decay_min, decay_max) -> None:
    for name, v in (("decay_min", decay_min), ("decay_max", decay_max)):
        check(isinstance(v, (int, float)) and not isinstance(v, bool) and 0.0 < float(v) < 1.0,
              f"{name}={v!r} is invalid: expected a decay factor in the open interval (0, 1)")
    check(decay_min <= decay_max,
          f"decay_min={decay_min} > decay_max={decay_max}: expected 0 < decay_min <= decay_max < 1")


def _check_bht(name: str, x, shape: tuple[int, ...] | None = None) -> None:
    check(isinstance(x, Tensor) and x.dim() == 3,
          f"{name} shape={tuple(getattr(x, 'shape', ()))} is invalid: expected [batch, kv_heads, seq]")
    if shape is not None:
        check(tuple(x.shape) == tuple(shape), f"{name} shape={tuple(x.shape)} is invalid: expected {tuple(shape)}")


# ----------------------------------------------------------------------------------------------------------------
# Decay (Eq. 21) and static priorities (Eq. 20)
# ----------------------------------------------------------------------------------------------------------------


def log_decay(alpha: Tensor, decay_min: float, decay_max: float) -> Tensor:
    """``log γ_h = log γ_min + σ(α_h) (log γ_max - log γ_min)`` (Eq. 21).

    Args:
        alpha: ``[kv_heads]`` unconstrained parameters.
        decay_min, decay_max: ``0 < decay_min <= decay_max < 1``.

    Returns:
        ``[kv_heads]`` float32 log-decay in ``[log decay_min, log decay_max]`` (all negative).
    """
    _check_decay_range(decay_min, decay_max)
    check(isinstance(alpha, Tensor) and alpha.dim() == 1,
          f"alpha shape={tuple(getattr(alpha, 'shape', ()))} is invalid: expected [kv_heads]")
    lo, hi = math.log(decay_min), math.log(decay_max)
    return lo + torch.sigmoid(alpha.float()) * (hi - lo)


class LearnedDecay(nn.Module):
    """Per-KV-head learned decay ``γ_h`` (Eq. 21). ``alpha`` starts at 0, the log-midpoint of the range, or where
    ``γ_h = init`` (``decay_min < init < decay_max``)."""

    def __init__(self, num_kv_heads: int, decay_min: float = 0.999, decay_max: float = 0.999999,
                 init: float | None = None):
        super().__init__()
        check_int("num_kv_heads", num_kv_heads, 1)
        _check_decay_range(decay_min, decay_max)
        self.decay_min = float(decay_min)
        self.decay_max = float(decay_max)
        alpha0 = 0.0
        if init is not None:
            check(decay_min < init < decay_max,
                  f"init={init!r} is invalid: expected a decay strictly between {decay_min} and {decay_max}")
            u = (math.log(init) - math.log(decay_min)) / (math.log(decay_max) - math.log(decay_min))
            alpha0 = math.log(u / (1.0 - u))  # the sigmoid's inverse
        self.alpha = nn.Parameter(torch.full((num_kv_heads,), alpha0, dtype=torch.float32))

    def forward(self) -> Tensor:
        """Returns ``log γ`` ``[kv_heads]`` float32."""
        return log_decay(self.alpha, self.decay_min, self.decay_max)

    def extra_repr(self) -> str:
        return f"num_kv_heads={self.alpha.numel()}, decay_min={self.decay_min}, decay_max={self.decay_max}"


def static_priorities(raw_scores: Tensor, log_gamma: Tensor, offset: int = 0) -> Tensor:
    """Static priority ``r̄[b, h, t] = r[b, h, t] - t log γ_h`` (Eq. 20), differentiable in both inputs.

    Args:
        raw_scores: ``[batch, kv_heads, seq]`` raw scores (cast to float32).
        log_gamma: ``[kv_heads]`` log-decay (``< 0``).
        offset: absolute position of ``raw_scores[..., 0]`` (positions are ``offset .. offset + seq - 1``).

    Returns:
        ``[batch, kv_heads, seq]`` float32. With decay step 1 the effective score at query ``q`` is
        ``r̄_t + q log γ``, so ranking by ``r̄`` is ranking by effective score (Eq. 19).
    """
    _check_bht("raw_scores", raw_scores)
    h = raw_scores.shape[1]
    check(isinstance(log_gamma, Tensor) and tuple(log_gamma.shape) == (h,),
          f"log_gamma shape={tuple(getattr(log_gamma, 'shape', ()))} is invalid: expected [kv_heads] = ({h},)")
    check(log_gamma.device == raw_scores.device,
          f"log_gamma device={log_gamma.device} differs from raw_scores device={raw_scores.device}")
    check_int("offset", offset, 0)
    t = torch.arange(offset, offset + raw_scores.shape[-1], device=raw_scores.device, dtype=torch.float32)
    return raw_scores.float() - t * log_gamma.float()[None, :, None]


# ----------------------------------------------------------------------------------------------------------------
# Teacher policy (Eq. 4-5, appendix C)
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class TeacherPolicy:
    """The teacher's running top-k policy over one sequence (all tensors ``[batch, kv_heads, seq]``, no grad).

    Attributes:
        priorities: float32 static teacher priorities ``r^tgt_t - t log γ`` (Eq. 20).
        ranks: int32 rank of each token (0 = highest priority, ties -> earlier token first).
        cutoffs: int32 rank of the ``topk``-th best token of ``E(q)`` per query ``q`` (``seq`` if ``|E(q)| < topk``,
            ``-1`` if ``topk == 0``); eligible ``t`` is retained at ``q`` iff ``ranks[t] <= cutoffs[q]``.
        cutoffs_next: int32, the same for ``topk + 1`` (the best token just outside the budget).
        order: int64 inverse map, ``order[..., r]`` = token index with rank ``r``.
        sinks, window, topk: the budget the cutoffs were computed for.
    """

    priorities: Tensor
    ranks: Tensor
    cutoffs: Tensor
    cutoffs_next: Tensor
    order: Tensor
    sinks: int
    window: int
    topk: int


def teacher_policy(target: Tensor, log_gamma: Tensor, sinks: int, window: int, topk: int) -> TeacherPolicy:
    """Rank tokens by the teacher's static priority and compute its running top-k / top-(k+1) cutoffs.

    Args:
        target: ``[batch, kv_heads, seq]`` future-attention target ``r^tgt`` (Eq. 3).
        log_gamma: ``[kv_heads]`` the shared per-head log-decay (detached here: the teacher has no gradient).
        sinks, window, topk: the budget ``s, w, k`` (``s >= 0, w >= 1, k >= 0``).
    """
    return teacher_policies([target], [log_gamma], sinks, window, topk)[0]


def teacher_policies(targets: Sequence[Tensor], log_gammas: Sequence[Tensor], sinks: int, window: int,
                     topk: int) -> list[TeacherPolicy]:
    """:func:`teacher_policy` of several layers in one pass: the layers' priorities are stacked along the batch
    dimension (``[layers * batch, kv_heads, seq]``), so the sort and the two running cutoffs launch once for all of
    them rather than once per layer (the retrofit computes every layer's policy each step). Every step works per
    (row, head), so each policy equals :func:`teacher_policy` of its layer alone, bit for bit; its tensors are
    views into the stacked ones.

    Args:
        targets: per layer, ``[batch, kv_heads, seq]`` (one shape and device for all).
        log_gammas: per layer, ``[kv_heads]``.
    """
    stacked = stacked_teacher_policy(targets, log_gammas, sinks, window, topk)
    b = targets[0].shape[0]
    return [TeacherPolicy(*(getattr(stacked, f)[i * b : (i + 1) * b] for f in _POLICY_TENSORS), sinks, window, topk)
            for i in range(len(targets))]


_POLICY_TENSORS = ("priorities", "ranks", "cutoffs", "cutoffs_next", "order")


def stacked_teacher_policy(targets: Sequence[Tensor], log_gammas: Sequence[Tensor], sinks: int, window: int,
                           topk: int) -> TeacherPolicy:
    """The policies of :func:`teacher_policies` as one :class:`TeacherPolicy` over the layers stacked along the
    batch dimension (``[layers * batch, kv_heads, seq]``, layer-major): rows ``i * batch .. (i + 1) * batch - 1``
    are layer ``i``'s policy. Same arguments and checks as :func:`teacher_policies`."""
    check(len(targets) >= 1 and len(targets) == len(log_gammas),
          f"got {len(targets)} targets and {len(log_gammas)} log_gammas: expected the same number, at least one")
    for i, target in enumerate(targets):
        _check_bht(f"targets[{i}]", target)
        check(target.shape == targets[0].shape and target.device == targets[0].device,
              f"targets[{i}] shape={tuple(target.shape)} on {target.device} is invalid: expected "
              f"{tuple(targets[0].shape)} on {targets[0].device}, like targets[0]")
    _check_budget(sinks, window, topk)
    with torch.no_grad():
        prio = torch.cat([static_priorities(t.detach(), g.detach()) for t, g in zip(targets, log_gammas)])
        ranks = static_ranks(prio)
        cut_k = running_cutoff(ranks, sinks, window, topk)
        cut_k1 = running_cutoff(ranks, sinks, window, topk + 1)
        idx = torch.arange(prio.shape[-1], device=prio.device, dtype=torch.int64).expand_as(prio)
        order = torch.empty_like(idx).scatter_(-1, ranks.long(), idx)
    return TeacherPolicy(prio, ranks, cut_k, cut_k1, order, sinks, window, topk)


# ----------------------------------------------------------------------------------------------------------------
# Boundary decisions (Eq. 6)
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class BoundaryDecisions:
    """Teacher decisions at sampled query positions, all ``[batch, kv_heads, n]``.

    Attributes:
        query: int64 query position ``q`` (broadcast copy of the sampled positions).
        t_new: int64 newly eligible token ``q - window`` (0 where invalid).
        t_bnd: int64 boundary token: the ``topk``-th best of ``E(q) \\ {t_new}`` (0 where invalid).
        y: float32 ``+1`` if the teacher keeps ``t_new`` at ``q``, ``-1`` if it drops it, ``0`` where invalid.
        valid: bool, ``sinks + window + topk <= q < seq`` and ``topk >= 1``.
    """

    query: Tensor
    t_new: Tensor
    t_bnd: Tensor
    y: Tensor
    valid: Tensor


def boundary_decisions(teacher: TeacherPolicy, query_positions: Tensor, sinks: int, window: int,
                       topk: int) -> BoundaryDecisions:
    """The eviction decision the teacher makes when ``t_new = q - window`` becomes eligible at query ``q``.

    For ``q >= sinks + window + topk`` the eligible set ``E(q) = {t : sinks <= t <= q - window}`` has at least
    ``topk + 1`` tokens, so exactly one comparison decides whether ``t_new`` enters the cache: ``t_new`` against
    ``t_bnd``, the ``topk``-th best token of ``E(q) \\ {t_new}``. Label ``y = +1`` iff ``t_new`` is in the teacher's
    top-k of ``E(q)``. Then ``t_bnd`` is the ``(k+1)``-th best of ``E(q)`` (the token evicted) when ``y = +1`` and the
    ``k``-th best (the last retained) when ``y = -1``.

    Args:
        teacher: from :func:`teacher_policy` with the same ``sinks, window, topk``.
        query_positions: ``[n]`` int64 query positions (any order, duplicates allowed, out of range -> invalid).
        sinks, window, topk: the budget.
    """
    _check_budget(sinks, window, topk)
    check((teacher.sinks, teacher.window, teacher.topk) == (sinks, window, topk),
          f"budget (sinks, window, topk)={(sinks, window, topk)} differs from the teacher's "
          f"{(teacher.sinks, teacher.window, teacher.topk)}: expected the same budget")
    check(isinstance(query_positions, Tensor) and query_positions.dim() == 1
          and not query_positions.is_floating_point() and query_positions.dtype != torch.bool,
          f"query_positions shape={tuple(getattr(query_positions, 'shape', ()))} is invalid: expected an int64 [n]")
    ranks = teacher.ranks
    b, h, seq = ranks.shape
    dev = ranks.device
    n = query_positions.numel()
    q = query_positions.to(device=dev, dtype=torch.int64)
    valid_q = (q >= sinks + window + topk) & (q < seq)
    if topk == 0:  # no long-range budget: nothing ever competes, so no decision exists
        valid_q = torch.zeros_like(valid_q)
    q_safe = torch.where(valid_q, q, torch.zeros_like(q))
    t_new = torch.where(valid_q, q_safe - window, torch.zeros_like(q))

    def take(x: Tensor, index: Tensor) -> Tensor:  # x [b, h, seq], index [n] -> [b, h, n]
        return torch.gather(x, -1, index.expand(b, h, n))

    with torch.no_grad():
        rank_new = take(ranks, t_new).long()
        cut_k = take(teacher.cutoffs, q_safe).long()
        cut_k1 = take(teacher.cutoffs_next, q_safe).long()
        keep = rank_new <= cut_k
        bnd_rank = torch.where(keep, cut_k1, cut_k).clamp(0, seq - 1)
        t_bnd = torch.gather(teacher.order, -1, bnd_rank)
        valid = valid_q.expand(b, h, n).clone()
        y = torch.where(keep, 1.0, -1.0).to(torch.float32) * valid
        t_bnd = torch.where(valid, t_bnd, torch.zeros_like(t_bnd))
    return BoundaryDecisions(
        query=q.expand(b, h, n).clone(),
        t_new=t_new.expand(b, h, n).clone(),
        t_bnd=t_bnd,
        y=y,
        valid=valid,
    )


# ----------------------------------------------------------------------------------------------------------------
# Query sampling (appendix B.6)
# ----------------------------------------------------------------------------------------------------------------


def sample_query_positions(seq_len: int, sinks: int, window: int, topk: int, num: int, late_fraction: float = 0.5,
                           generator: torch.Generator | None = None) -> Tensor:
    """Sample boundary-loss query positions in ``[sinks + window + topk, seq_len)`` (appendix B.6).

    ``round(num * late_fraction)`` samples are late-biased, ``q = lo + floor(sqrt(u) (seq_len - lo))`` (density
    rising linearly toward the end); the rest are uniform, ``q = lo + floor(u (seq_len - lo))``. Returned as
    ``[uniform..., late...]``, int64 on the CPU (or the generator's device), not sorted, duplicates possible.
    """
    _check_budget(sinks, window, topk)
    check_int("seq_len", seq_len, 1)
    check_int("num", num, 0)
    check(isinstance(late_fraction, (int, float)) and not isinstance(late_fraction, bool)
          and 0.0 <= late_fraction <= 1.0, f"late_fraction={late_fraction!r} is invalid: expected a float in [0, 1]")
    lo = sinks + window + topk
    check(seq_len > lo, f"seq_len={seq_len} is invalid: expected > sinks + window + topk = {lo} "
                        "so that at least one query position has a full long-range budget")
    span = seq_len - lo
    n_late = int(round(num * late_fraction))
    device = generator.device if generator is not None else torch.device("cpu")
    u = torch.rand(num, generator=generator, device=device, dtype=torch.float64)
    u[num - n_late:] = u[num - n_late:].sqrt()
    q = lo + torch.floor(u * span).to(torch.int64)
    return q.clamp_(lo, seq_len - 1)
