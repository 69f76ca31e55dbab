"""The learned decay gets a gradient from the boundary loss (Eq. 7 on static priorities, Eq. 20-21): the compared
pair ``t_bnd < t_new`` always differs in age, so ``d diff / d log γ = -(t_new - t_bnd)`` and the decay term does not
cancel. Hand-computed signs and values: a teacher that keeps the *older* token and drops the newly eligible one
pushes ``log γ`` up (slower decay), one that keeps the new token pushes it down."""

import math

import pytest
import torch

from kvlearn.kvpop.loss import boundary_loss
from kvlearn.kvpop.policy import (BoundaryDecisions, LearnedDecay, boundary_decisions, static_priorities,
                                  teacher_policy)


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def _one_decision(t_new, t_bnd, y):
    def t(v):
        return torch.tensor([[[v]]])

    return BoundaryDecisions(query=t(t_new + 2), t_new=t(t_new), t_bnd=t(t_bnd),
                             y=torch.tensor([[[float(y)]]]), valid=torch.tensor([[[True]]]))


@pytest.mark.parametrize("y", [-1, 1])
def test_log_gamma_gradient_has_the_hand_computed_sign_and_value(y):
    # raw scores r̂[2] = 0.3 (older, t_bnd), r̂[9] = 0.1 (newly eligible, t_new); log γ = -0.01 (a strong decay so
    # that the age term is visible): diff = p̂[9] - p̂[2] = 0.1 - 0.3 - (9 - 2)(-0.01) = -0.13.
    raw = torch.zeros(1, 1, 12)
    raw[0, 0, 2], raw[0, 0, 9] = 0.3, 0.1
    log_gamma = torch.tensor([-0.01], requires_grad=True)
    pred = static_priorities(raw, log_gamma)
    result = boundary_loss(pred, pred.detach(), _one_decision(9, 2, y))  # one decision: weight 1
    (grad,) = torch.autograd.grad(result.loss, log_gamma)
    diff = 0.1 - 0.3 - 7 * (-0.01)
    # ℓ = softplus(-y diff), d diff / d log γ = -(t_new - t_bnd) = -7
    expected = -y * _sigmoid(-y * diff) * (-7)
    assert grad.item() == pytest.approx(expected, rel=1e-5)
    if y < 0:  # the teacher keeps the older token: descent raises log γ (slower decay, old tokens live longer)
        assert grad.item() < 0
    else:  # the teacher keeps the new token: descent lowers log γ (faster decay)
        assert grad.item() > 0


def test_alpha_gradient_is_the_log_gamma_gradient_times_the_range():
    # Eq. 21: d log γ / d α = σ'(α) (log γ_max - log γ_min): 2.5e-4 at α = 0 over the paper's range.
    decay = LearnedDecay(1)
    raw = torch.zeros(1, 1, 12)
    pred = static_priorities(raw, decay())
    result = boundary_loss(pred, pred.detach(), _one_decision(9, 2, -1))
    result.loss.backward()
    log_g = math.log(0.999) + 0.5 * (math.log(0.999999) - math.log(0.999))
    diff = -7 * log_g  # raw scores tie: only the age term
    scale = 0.25 * (math.log(0.999999) - math.log(0.999))
    assert decay.alpha.grad.item() == pytest.approx(_sigmoid(diff) * (-7) * scale, rel=1e-4)
    assert decay.alpha.grad.item() < 0  # keep-the-older-token pushes α (and γ) up


def test_teacher_decisions_compare_tokens_of_different_age():
    # On random targets every valid decision compares t_bnd < t_new, so the decay's gradient is not structurally 0.
    g = torch.Generator().manual_seed(0)
    target = torch.randn(2, 2, 200, generator=g)
    log_gamma = torch.tensor([-5e-4, -2e-3], requires_grad=True)
    teacher = teacher_policy(target, log_gamma, 4, 8, 32)
    queries = torch.arange(44, 200)
    dec = boundary_decisions(teacher, queries, 4, 8, 32)
    assert dec.valid.all()
    assert (dec.t_bnd < dec.t_new).all()
    raw = torch.randn(2, 2, 200, generator=g)
    result = boundary_loss(static_priorities(raw, log_gamma), teacher.priorities, dec)
    (grad,) = torch.autograd.grad(result.loss, log_gamma)
    assert (grad.abs() > 1e-3).all()
