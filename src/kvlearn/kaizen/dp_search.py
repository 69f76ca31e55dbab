"""KV-Kaizen's offline search baseline (the paper's appendix E.2): per-layer loss increases and an exact dynamic
program over them (``docs/DESIGN.md`` section 8, "Offline dynamic-programming search").

1. :func:`measure_layer_losses`: on calibration data (:func:`calibration_batch`, testbed training rows), the
   teacher-forced loss of the model with *one* layer ``l`` changed to action ``a`` and every other layer at the
   least compressed action ``a_0 = action_space(...)[0]`` (16 bits, own cache, full latent), minus the loss with
   every layer at ``a_0``: ``Δ[l, a] = loss(a_0, .., a at l, .., a_0) - loss(a_0, .., a_0)``, so ``Δ[l, a_0] = 0``.
   A ``share`` at layer ``l`` reads the cache of layer ``l - 1`` (its anchor when nothing else changes).
2. :func:`dp_search`: the multiple-choice knapsack ``min Σ_l Δ[l, a_l]`` subject to ``Σ_l c(a_l) <= B`` with one
   allowed action per layer (``action_mask``: no ``share`` at layer 0), ``c`` the integer cost in bits per token
   (:func:`~kvlearn.kaizen.actions.action_bits`, no metadata) and ``B = C_ref / ρ*``. Exact: the costs are divided
   by their greatest common divisor ``g`` (``Σ c <= B`` iff ``Σ c/g <= ⌊B/g⌋``, both sides integers), and the table
   ``D_l[u]`` (the least summed increase of layers ``0..l`` at exactly ``u`` cost units) is filled layer by layer.
3. :func:`search`: both on a model at a target compression, returning the chosen :class:`KaizenConfig`.

The estimate is additive, as in the paper: it predicts a configuration well when each layer changes a little, and
misses the interactions when many layers are compressed hard (its Table 9).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import KVLearnError, check, check_int, is_int
from .actions import Backbone, KaizenConfig, LayerAction, action_bits, action_mask, action_space, check_axes, check_budget


@dataclass(frozen=True)
class DPChoice:
    """The DP's answer: ``indices`` (one action index per layer), ``loss`` (``Σ_l Δ[l, a_l]``, the predicted increase)
    and ``bits`` (``Σ_l c(a_l)``, bits per token)."""

    indices: tuple[int, ...]
    loss: float
    bits: int


def _as_table(name: str, values, dtype) -> torch.Tensor:
    try:
        return torch.as_tensor(values, dtype=dtype)
    except (TypeError, ValueError, RuntimeError) as err:
        reason = " ".join(str(err).split())
        raise KVLearnError(f"{name} is invalid: expected a rectangular table of numbers ({reason})") from None


def dp_search(losses, costs, budget, allowed=None) -> DPChoice:
    """The exact multiple-choice knapsack of the module docstring.

    Args:
        losses: ``[L, A]`` the estimated loss increase of each action at each layer (finite where allowed).
        costs: ``[A]`` (the same for every layer) or ``[L, A]``, non-negative integer costs (bits per token).
        budget: ``B``, a number >= 0: the configuration's cost must be ``<= B`` (with a relative slack of 1e-9, the
            tolerance of :func:`~kvlearn.kaizen.actions.check_budget`).
        allowed: ``[L, A]`` booleans, the actions each layer may take (``None``: all).

    Returns the :class:`DPChoice` of least summed loss; among equal sums the costlier (less compressed) total
    wins; remaining ties go deterministically to the lower action index. One-line errors for bad shapes or values and for
    an infeasible budget (naming the feasible range in bits per token).
    """
    losses = _as_table("losses", losses, torch.float64)
    check(losses.dim() == 2 and losses.shape[0] >= 1 and losses.shape[1] >= 1,
          f"losses of shape {tuple(losses.shape)} are invalid: expected [layers, actions]")
    L, A = losses.shape
    costs = _as_table("costs", costs, torch.float64)
    check(costs.dim() in (1, 2), f"costs of shape {tuple(costs.shape)} are invalid: expected [{A}] or [{L}, {A}]")
    costs = costs.expand(L, A) if costs.dim() == 1 and costs.shape[0] == A else costs
    check(tuple(costs.shape) == (L, A), f"costs of shape {tuple(costs.shape)} are invalid: expected [{A}] or [{L}, {A}]")
    check(bool((costs >= 0).all()) and bool((costs == costs.round()).all()) and bool(costs.isfinite().all()),
          "costs are invalid: expected non-negative integers (bits per token)")
    if allowed is None:
        allowed = torch.ones(L, A, dtype=torch.bool)
    allowed = _as_table("allowed", allowed, torch.bool)
    check(tuple(allowed.shape) == (L, A), f"allowed of shape {tuple(allowed.shape)} is invalid: expected [{L}, {A}]")
    empty = [l for l in range(L) if not bool(allowed[l].any())]
    check(not empty, f"layer {empty[0] if empty else ''} allows no action: expected at least one per layer")
    check(bool(losses[allowed].isfinite().all()), "losses are invalid: expected finite numbers where allowed")
    ok = isinstance(budget, (int, float)) and not isinstance(budget, bool) and math.isfinite(budget) and budget >= 0
    check(ok, f"budget={budget!r} is invalid: expected a finite number of bits per token >= 0")

    cost = costs.long()
    big = torch.iinfo(torch.long).max
    least = int(torch.where(allowed, cost, big).min(dim=1).values.sum())
    most = int(torch.where(allowed, cost, -1).max(dim=1).values.sum())
    check(least <= budget * (1 + 1e-9), f"budget of {budget:.6g} bits per token is infeasible: the allowed "
                                        f"configurations cost {least} .. {most} bits per token")
    g = math.gcd(*[int(c) for c in cost[allowed].unique().tolist()]) or 1
    units = cost // g  # [L, A]
    cap = min(int(math.floor(budget * (1 + 1e-9) / g)), most // g)
    inf = math.inf
    best = torch.full((cap + 1,), inf, dtype=torch.float64)  # D_{-1}: nothing chosen, cost 0
    best[0] = 0.0
    choice = torch.full((L, cap + 1), -1, dtype=torch.long)  # the action of layer l on the best path to u
    for l in range(L):
        new = torch.full((cap + 1,), inf, dtype=torch.float64)
        for a in range(A):
            if not bool(allowed[l, a]):
                continue
            u = int(units[l, a])
            if u > cap:
                continue
            cand = torch.full((cap + 1,), inf, dtype=torch.float64)
            cand[u:] = best[: cap + 1 - u] + float(losses[l, a])
            better = cand < new  # strict: the lower action index keeps ties
            new = torch.where(better, cand, new)
            choice[l] = torch.where(better, torch.full_like(choice[l], a), choice[l])
        best = new
    low = float(best.min())
    ends = (best == low).nonzero().flatten()
    u = int(ends.max())  # the costliest among the optimal ends
    indices = []
    for l in reversed(range(L)):
        a = int(choice[l, u])
        indices.append(a)
        u -= int(units[l, a])
    indices.reverse()
    return DPChoice(tuple(indices), float(sum(float(losses[l, a]) for l, a in enumerate(indices))),
                    int(sum(int(cost[l, a]) for l, a in enumerate(indices))))


# ----------------------------------------------------------------------------------------------------------------
# per-layer loss increases on calibration data


def calibration_batch(examples: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)``, ``LongTensor [examples, length]``: testbed *training* rows of batch ``seed``
    (:func:`kvlearn.testbed.data.training_batch`, the dense training format: supervised in-context answers and the
    final answer; no evaluation example is ever drawn)."""
    from ..testbed.data import training_batch

    return training_batch(examples, length, seed, dense=True)


@dataclass(frozen=True)
class LossTable:
    """Per-layer loss increases measured on calibration data.

    Attributes:
        actions: the action space (``action_space(backbone, axes)``), ``A`` actions, ``actions[0]`` the reference.
        increases: ``[L, A]`` float64, ``Δ[l, a]`` in nats per supervised token (``inf`` where not allowed:
            ``share`` at layer 0).
        base_loss: the loss with every layer at ``actions[0]`` (nats per supervised token).
    """

    actions: tuple[LayerAction, ...]
    increases: torch.Tensor
    base_loss: float


@torch.no_grad()
def config_loss(model, config: KaizenConfig, input_ids: torch.Tensor, labels: torch.Tensor, batch_size: int = 4) -> float:
    """Teacher-forced cross-entropy of ``model`` run under ``config`` (``use_cache=False``, anchors fake-quantized)
    on ``input_ids [N, T]`` with ``labels [N, T]`` (-100 = not supervised; token ``t`` is predicted at ``t - 1``),
    the mean over supervised tokens, in float32 micro-batches of ``batch_size`` rows. The model must be attached
    (:func:`kvlearn.kaizen.sharing.attach`)."""
    check_int("batch_size", batch_size, 1)
    check(input_ids.shape == labels.shape and input_ids.dim() == 2,
          f"input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} are invalid: expected the same [N, T]")
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for start in range(0, input_ids.shape[0], batch_size):
        ids = input_ids[start:start + batch_size].to(device)
        lab = labels[start:start + batch_size, 1:].to(device)
        logits = model(input_ids=ids, use_cache=False, kaizen_config=config).logits[:, :-1]
        total += float(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), lab.flatten(),
                                                         ignore_index=-100, reduction="sum"))
        count += int((lab != -100).sum())
    check(count > 0, "the calibration data supervise no token: expected labels other than -100")
    return total / count


def measure_layer_losses(model, input_ids: torch.Tensor, labels: torch.Tensor, axes=None,
                         batch_size: int = 4) -> LossTable:
    """The :class:`LossTable` of ``model`` (attached) on ``input_ids``/``labels`` ``[N, T]``: ``1 + Σ_l (allowed
    actions at l - 1)`` forwards (module docstring). ``Δ[l, actions[0]]`` is 0 exactly: that configuration is the
    reference one."""
    backbone = Backbone.from_model(model)
    space = action_space(backbone, axes)
    mask = action_mask(backbone, axes)
    reference = space[0]
    base_actions = [reference] * backbone.num_layers
    base = config_loss(model, KaizenConfig(backbone, base_actions), input_ids, labels, batch_size)
    increases = torch.full((backbone.num_layers, len(space)), math.inf, dtype=torch.float64)
    for l in range(backbone.num_layers):
        for a, action in enumerate(space):
            if not mask[l][a]:
                continue
            if action == reference:
                increases[l, a] = 0.0
                continue
            actions = list(base_actions)
            actions[l] = action
            increases[l, a] = config_loss(model, KaizenConfig(backbone, actions), input_ids, labels, batch_size) - base
    return LossTable(space, increases, base)


# ----------------------------------------------------------------------------------------------------------------
# the search


@dataclass(frozen=True)
class SearchResult:
    """``config``: the chosen configuration; ``table``: the measured :class:`LossTable`; ``choice``: the
    :class:`DPChoice` (``choice.loss`` is the predicted loss increase, ``choice.bits`` the cost without metadata)."""

    config: KaizenConfig
    table: LossTable
    choice: DPChoice


def choose(table: LossTable, backbone: Backbone, target: float, axes=None) -> tuple[KaizenConfig, DPChoice]:
    """The DP's configuration of ``table`` at the target compression ``target`` (``ρ*``; budget ``B = C_ref / ρ*``
    bits per token without metadata). One-line error for a target outside the axes' feasible range."""
    axes = check_axes(axes, backbone)
    target = check_budget(target, backbone, axes)
    space = action_space(backbone, axes)
    check(tuple(table.actions) == space, "the loss table was measured over another action space: measure it with "
                                         "the same axes")
    check(tuple(table.increases.shape) == (backbone.num_layers, len(space)),
          f"the loss table's shape {tuple(table.increases.shape)} does not fit {backbone.num_layers} layers x "
          f"{len(space)} actions")
    costs = [action_bits(a, backbone, metadata=False) for a in space]
    dp = dp_search(table.increases, costs, backbone.reference_bits / target, action_mask(backbone, axes))
    return KaizenConfig.from_indices(backbone, dp.indices, axes), dp


def search(model, target: float, axes=None, examples: int = 8, length: int = 1024, seed: int = 0,
           batch_size: int = 4) -> SearchResult:
    """Measure the loss table of ``model`` on ``examples`` calibration rows of ``length`` tokens (batch ``seed``)
    and choose its configuration at ``target`` (:func:`choose`). The target is checked before any forward. The model
    is attached (:func:`kvlearn.kaizen.sharing.attach`) if it is not."""
    from . import sharing

    backbone = Backbone.from_model(model)
    axes = check_axes(axes, backbone)
    check_budget(target, backbone, axes)
    check(is_int(examples) and examples >= 1, f"examples={examples!r} is invalid: expected an integer >= 1")
    ids, labels = calibration_batch(examples, length, seed)
    check(int(ids.max()) < model.config.vocab_size,
          f"the model's vocabulary of {model.config.vocab_size} tokens is smaller than the testbed's: calibration "
          "uses testbed examples (a testbed model)")
    sharing.attach(model)
    table = measure_layer_losses(model, ids, labels, axes, batch_size)
    config, dp = choose(table, backbone, target, axes)
    return SearchResult(config, table, dp)
