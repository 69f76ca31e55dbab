"""The budget penalty and its adaptive rate multiplier (``docs/DESIGN.md`` section 8).

The paper's appendix D.1 (the update rule) is missing from our copy; this is our design from what the paper states:
the multiplier ``β`` rises while the realised cost is above the target, decreases slowly once it is met (by at most
``η δ = 0.001`` per step at the paper's setting), starts at 0 and is capped (default cap ``10^4``; the paper also
tests ``β_max = 50``); a constant multiplier is ``η = 0``.

With ``C`` the cost of a sequence's configuration in bits per token (:meth:`KaizenConfig.bits_per_token`) and
``C* = C_ref / ρ*`` its target (``ρ*`` the requested compression):

- excess ``e = C / C* - 1`` (``> 0``: over budget);
- penalty, added to the task loss: ``P = β · relu(Ĉ / C* - 1)``, where ``Ĉ`` is the selector's differentiable cost
  (the straight-through Gumbel one-hots times the per-action costs: the hard cost forward, the expected cost's
  gradient backward); a configuration under budget is not pushed further;
- update after each optimizer step, from the realised (hard, argmax) cost:
  ``β ← min(β_max, max(0, β + η · max(e, -δ)))``: up by ``η e`` while over budget, down by ``η |e|`` but at most
  ``η δ`` per step while under.

With several sequences (a batch, or data-parallel ranks: average ``e`` over all of them before the update), ``P`` and
``e`` are means over the sequences, each against its own target (budget-conditioned selectors).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import check, check_non_negative


def excess(cost, target) -> torch.Tensor:
    """``e = C / C* - 1`` per sequence (float32); ``cost``, ``target``: numbers or tensors ``[batch]`` in bits/token."""
    cost = torch.as_tensor(cost, dtype=torch.float32)
    target = torch.as_tensor(target, dtype=torch.float32)
    check(bool((target > 0).all()), "target cost must be > 0 bits per token")
    return cost / target - 1


def selection_cost(weights: torch.Tensor, action_costs) -> torch.Tensor:
    """``Ĉ``: the cost in bits per token of per-layer action weights ``weights [batch, L, A]`` (the selector's
    straight-through one-hots, or probabilities), ``action_costs [A]`` the cost of each action of the action space
    (``[action_bits(a, backbone) for a in action_space(backbone, axes)]``). Returns ``[batch]``, differentiable."""
    costs = torch.as_tensor(action_costs, dtype=weights.dtype, device=weights.device)
    check(weights.dim() == 3 and weights.shape[-1] == costs.numel(),
          f"weights of shape {tuple(weights.shape)} are invalid: expected [batch, layers, {costs.numel()} actions]")
    return (weights * costs).sum(dim=(-1, -2))


@dataclass
class BudgetMultiplier:
    """The adaptive rate multiplier ``β`` (module docstring). ``eta = 0`` keeps ``β`` constant at ``beta``.

    Attributes:
        eta: ``η``, the step size (default 0.01).
        delta: ``δ``, the largest excess below target counted per step (default 0.1; ``η δ = 0.001``).
        cap: ``β_max`` (default ``10^4``).
        beta: the current multiplier (starts at 0 unless given).
    """

    eta: float = 0.01
    delta: float = 0.1
    cap: float = 1e4
    beta: float = 0.0

    def __post_init__(self) -> None:
        self.eta = check_non_negative("eta", self.eta)
        self.delta = check_non_negative("delta", self.delta)
        self.cap = check_non_negative("cap", self.cap, allow_inf=True)
        self.beta = check_non_negative("beta", self.beta)
        check(self.beta <= self.cap, f"beta={self.beta} is invalid: expected 0 <= beta <= cap = {self.cap}")

    def penalty(self, cost: torch.Tensor, target) -> torch.Tensor:
        """``β · mean(relu(Ĉ / C* - 1))``: ``cost`` the differentiable cost ``[batch]`` (or a scalar) in bits per
        token, ``target`` the target(s) ``C*``. Differentiable in ``cost``; ``β`` is a constant."""
        target = torch.as_tensor(target, dtype=cost.dtype, device=cost.device)
        check(bool((target > 0).all()), "target cost must be > 0 bits per token")
        return self.beta * torch.relu(cost / target - 1).mean()

    def update(self, cost, target) -> float:
        """One step from the realised (hard) cost(s) ``C`` against ``C*``: ``β ← min(β_max, max(0, β + η · max(ē,
        -δ)))``, ``ē`` the mean excess. Returns the new ``β``."""
        e = float(excess(cost, target).mean())
        self.beta = min(self.cap, max(0.0, self.beta + self.eta * max(e, -self.delta)))
        return self.beta

    def state_dict(self) -> dict:
        return {"eta": self.eta, "delta": self.delta, "cap": self.cap, "beta": self.beta}

    def load_state_dict(self, state: dict) -> None:
        restored = BudgetMultiplier(**state)
        self.eta, self.delta, self.cap, self.beta = restored.eta, restored.delta, restored.cap, restored.beta
