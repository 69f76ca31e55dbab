"""KVpop boundary-aware retention loss (paper Eq. 7, appendix B.4-B.5).

At each sampled decision (query ``q``, batch ``b``, KV head ``h``) the student compares the newly eligible token
``t_new`` with the teacher's boundary token ``t_bnd``::

    ℓ = softplus(-y (p̂[t_new] - p̂[t_bnd]) / τ)                                        (Eq. 7)
    Δ = y (p[t_new] - p[t_bnd]) >= 0,  ω_margin = ω_min + (1 - ω_min) σ(Δ / τ_ω)      (Eq. 22-23)
    ω_bal = clip(1 / (2 ρ_h), c_min, c_max) if y = +1 else clip(1 / (2 (1 - ρ_h)), c_min, c_max)   (Eq. 24)
    ω = ω_margin ω_bal / mean_valid(ω_margin ω_bal);   loss = mean_valid(ω ℓ)

``p̂`` / ``p`` are the student's / teacher's *static* priorities ``r_t - t log γ_h`` (Eq. 20). With decay step 1
the difference of effective scores at any query equals the difference of static priorities, so this is exactly
the comparison the running top-k mask makes (including the decay term, which does not cancel for tokens of
different age).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from kvlearn.errors import check
from kvlearn.kvpop.policy import BoundaryDecisions

__all__ = ["BoundaryLoss", "boundary_loss"]


@dataclass
class BoundaryLoss:
    """Result of :func:`boundary_loss`.

    Attributes:
        loss: scalar float32, differentiable w.r.t. the student's priorities (0 when nothing is valid).
        weights: ``[batch, kv_heads, n]`` float32 final weights ``ω`` (mean 1 over valid decisions, 0 elsewhere),
            detached.
        accuracy: scalar float32, fraction of valid decisions where the student's comparison agrees with ``y``
            (0 when nothing is valid), detached.
        num_valid: scalar int64 number of valid decisions.

    With ``groups > 1`` (:func:`boundary_loss`): ``loss`` and ``accuracy`` are the means over the groups of each
    group's, the weights have mean 1 over each group's valid decisions, and ``num_valid`` is int64 ``[groups]``.
    """

    loss: Tensor
    weights: Tensor
    accuracy: Tensor
    num_valid: Tensor


def _check_positive(name: str, value) -> None:
    check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0,
          f"{name}={value!r} is invalid: expected a finite float > 0")


def boundary_loss(
    pred_priority: Tensor,
    target_priority: Tensor,
    decisions: BoundaryDecisions,
    temperature: float = 1.0,
    margin_weighting: bool = True,
    margin_min_weight: float = 0.1,
    margin_temperature: float = 1.0,
    balance: bool = True,
    balance_clip: tuple[float, float] = (0.2, 5.0),
    reduce_sum=None,
    groups: int = 1,
) -> BoundaryLoss:
    """Weighted pairwise logistic loss at the teacher's retention boundary.

    Args:
        pred_priority: ``[batch, kv_heads, seq]`` student static priority ``r̂_t - t log γ_h`` (gradients flow here).
        target_priority: ``[batch, kv_heads, seq]`` teacher static priority (e.g. ``TeacherPolicy.priorities``);
            only used for the margin weight, never differentiated.
        decisions: :class:`~kvlearn.kvpop.policy.BoundaryDecisions` with ``[batch, kv_heads, n]`` fields.
        temperature: ``τ > 0`` of Eq. 7.
        margin_weighting: apply Eq. 22-23 (``ω_min = margin_min_weight`` in ``[0, 1]``,
            ``τ_ω = margin_temperature > 0``).
        balance: apply Eq. 24 with ``balance_clip = (c_min, c_max)``, ``0 < c_min <= c_max``.
        reduce_sum: data parallelism: a function summing a tensor over the processes (e.g.
            :func:`kvlearn.train.parallel.all_reduce_sum`). Every batch statistic (keep fraction per head, weight
            mean, number of valid decisions) is then taken over the global batch, and the returned loss is this
            process's share of the global mean (its sum over the global count): the shares add up to the loss of
            one process on the whole batch. None: this batch alone.
        groups: the ``kv_heads`` axis holds this many independent losses, ``kv_heads / groups`` heads each (the
            retrofit stacks its layers along it: one call for every layer instead of one per layer). Each group is
            computed as a call on its own heads alone would compute it (its own weight normalisation and valid
            count; the balancing is per head anyway), and the loss and accuracy are the means over the groups of
            theirs (see :class:`BoundaryLoss`). 1: one loss over all heads.
    """
    check(isinstance(pred_priority, Tensor) and pred_priority.dim() == 3,
          f"pred_priority shape={tuple(getattr(pred_priority, 'shape', ()))} is invalid: expected [batch, kv_heads, seq]")
    check(isinstance(target_priority, Tensor) and target_priority.shape == pred_priority.shape,
          f"target_priority shape={tuple(getattr(target_priority, 'shape', ()))} is invalid: "
          f"expected the pred_priority shape {tuple(pred_priority.shape)}")
    check(target_priority.device == pred_priority.device,
          f"target_priority device={target_priority.device} differs from pred_priority device={pred_priority.device}")
    check(isinstance(decisions, BoundaryDecisions),
          f"decisions of type {type(decisions).__name__} is invalid: expected BoundaryDecisions")
    b, h, seq = pred_priority.shape
    check(isinstance(groups, int) and not isinstance(groups, bool) and groups >= 1 and h % groups == 0,
          f"groups={groups!r} is invalid: expected an integer >= 1 that divides kv_heads={h}")
    shape = decisions.t_new.shape
    check(len(shape) == 3 and shape[0] == b and shape[1] == h,
          f"decisions shape={tuple(shape)} is invalid: expected [batch, kv_heads, n] with batch={b}, kv_heads={h}")
    for name in ("t_bnd", "y", "valid"):
        check(getattr(decisions, name).shape == shape,
              f"decisions.{name} shape={tuple(getattr(decisions, name).shape)} is invalid: expected {tuple(shape)}")
    check(decisions.t_new.device == pred_priority.device,
          f"decisions device={decisions.t_new.device} differs from pred_priority device={pred_priority.device}")
    _check_positive("temperature", temperature)
    _check_positive("margin_temperature", margin_temperature)
    check(isinstance(margin_min_weight, (int, float)) and 0.0 <= margin_min_weight <= 1.0,
          f"margin_min_weight={margin_min_weight!r} is invalid: expected a weight in [0, 1]")
    check(isinstance(balance_clip, (tuple, list)) and len(balance_clip) == 2
          and all(isinstance(c, (int, float)) for c in balance_clip) and 0 < balance_clip[0] <= balance_clip[1],
          f"balance_clip={balance_clip!r} is invalid: expected (c_min, c_max) with 0 < c_min <= c_max")

    reduce = reduce_sum if reduce_sum is not None else (lambda t: t)
    if groups == 1:
        def total(x: Tensor) -> Tensor:  # [b, h, n] -> scalar
            return x.sum()

        def per_head(v: Tensor) -> Tensor:
            return v
    else:
        def total(x: Tensor) -> Tensor:  # [b, h, n] -> [groups]: each group's sum
            return x.reshape(b, groups, h // groups, x.shape[-1]).sum(dim=(0, 2, 3))

        def per_head(v: Tensor) -> Tensor:  # [groups] -> [1, h, 1]: each head its group's value
            return v.repeat_interleave(h // groups)[None, :, None]
    valid = decisions.valid.bool()
    validf = valid.to(torch.float32)
    y = torch.where(valid, decisions.y.to(torch.float32), torch.zeros((), device=valid.device))
    t_new = torch.where(valid, decisions.t_new, 0).long().clamp(0, seq - 1)
    t_bnd = torch.where(valid, decisions.t_bnd, 0).long().clamp(0, seq - 1)

    pred = pred_priority.float()
    diff = torch.gather(pred, -1, t_new) - torch.gather(pred, -1, t_bnd)  # [b, h, n]
    per_example = F.softplus(-y * diff / temperature)

    with torch.no_grad():
        weights = torch.ones_like(validf)
        if margin_weighting:
            tgt = target_priority.detach().float()
            margin = y * (torch.gather(tgt, -1, t_new) - torch.gather(tgt, -1, t_bnd))
            weights = weights * (margin_min_weight + (1.0 - margin_min_weight) * torch.sigmoid(margin / margin_temperature))
        if balance:
            c_min, c_max = float(balance_clip[0]), float(balance_clip[1])
            pos = reduce(((y > 0) & valid).to(torch.float32).sum(dim=(0, 2)))  # [h]
            cnt = reduce(validf.sum(dim=(0, 2)))
            rho = pos / cnt.clamp(min=1.0)  # fraction of keep labels of head h (over batch and positions)
            w_keep = (0.5 / rho.clamp(min=1e-12)).clamp(c_min, c_max)
            w_drop = (0.5 / (1.0 - rho).clamp(min=1e-12)).clamp(c_min, c_max)
            weights = weights * torch.where(y > 0, w_keep[None, :, None], w_drop[None, :, None])
        weights = weights * validf
        num_valid = reduce(total(valid))
        mean_w = per_head(reduce(total(weights)) / num_valid.clamp(min=1))
        weights = torch.where(mean_w > 0, weights / mean_w.clamp(min=1e-30), weights)
        # Student tie rule: equal static priorities go to the earlier token, and t_bnd < t_new always,
        # so a tie means t_new is dropped.
        agree = torch.where(y > 0, diff.detach() > 0, diff.detach() <= 0) & valid
        accuracy = reduce(total(agree.to(torch.float32))) / num_valid.clamp(min=1)

    loss = total(weights * per_example * validf) / num_valid.clamp(min=1)
    if groups > 1:
        loss, accuracy = loss.mean(), accuracy.mean()
    return BoundaryLoss(loss=loss, weights=weights, accuracy=accuracy, num_valid=num_valid)
