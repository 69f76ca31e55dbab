"""Boundary-aware retention loss (Eq. 7, 22-24) against hand-computed values."""

import math

import pytest
import torch

from kvlearn.errors import KVLearnError
from kvlearn.kvpop.loss import boundary_loss
from kvlearn.kvpop.policy import BoundaryDecisions, boundary_decisions, teacher_policy


def _softplus(x):
    return math.log1p(math.exp(x))


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def _decisions(t_new, t_bnd, y, valid):
    t_new = torch.tensor(t_new)
    return BoundaryDecisions(
        query=t_new + 2,  # unused by the loss
        t_new=t_new,
        t_bnd=torch.tensor(t_bnd),
        y=torch.tensor(y, dtype=torch.float32),
        valid=torch.tensor(valid),
    )


# One batch element, 2 heads, 3 decisions each; head 0's last decision is invalid.
PRED = [[0.0, 0.5, 1.0, 0.0, 1.5, 0.2], [0.0, 2.0, 0.3, -1.0, 0.1, 0.6]]
TARGET = [[0.0, 1.0, 2.0, 0.0, 3.0, 0.5], [0.0, 0.2, 1.0, 2.0, 1.5, 0.7]]
DEC = dict(
    t_new=[[[4, 5, 3], [4, 5, 5]]],
    t_bnd=[[[1, 2, 0], [2, 1, 3]]],
    y=[[[1.0, -1.0, 1.0], [1.0, 1.0, -1.0]]],
    valid=[[[True, True, False], [True, True, True]]],
)


def test_hand_computed_case():
    pred = torch.tensor([PRED], requires_grad=True)
    target = torch.tensor([TARGET])
    tau, w_min, tau_w, clip = 2.0, 0.1, 0.5, (0.8, 1.4)
    out = boundary_loss(pred, target, _decisions(**DEC), temperature=tau, margin_min_weight=w_min,
                        margin_temperature=tau_w, balance_clip=clip)
    # (y, pred diff p_new - p_bnd, teacher margin y (r_new - r_bnd)) for the five valid decisions
    rows = [
        (+1, 1.5 - 0.5, 3.0 - 1.0),  # head 0: t_new=4, t_bnd=1
        (-1, 0.2 - 1.0, -(0.5 - 2.0)),  # head 0: t_new=5, t_bnd=2
        (+1, 0.1 - 0.3, 1.5 - 1.0),  # head 1: t_new=4, t_bnd=2
        (+1, 0.6 - 2.0, 0.7 - 0.2),  # head 1: t_new=5, t_bnd=1
        (-1, 0.6 - (-1.0), -(0.7 - 2.0)),  # head 1: t_new=5, t_bnd=3
    ]
    # balancing: head 0 has rho = 1/2 -> 1 and 1; head 1 has rho = 2/3 -> keep 1/(4/3) = 0.75 -> clipped to 0.8,
    # drop 1/(2/3) = 1.5 -> clipped to 1.4
    bal = [1.0, 1.0, 0.8, 0.8, 1.4]
    raw_w = [(w_min + (1 - w_min) * _sigmoid(m / tau_w)) * b for (_, _, m), b in zip(rows, bal)]
    mean_w = sum(raw_w) / 5
    w = [x / mean_w for x in raw_w]
    losses = [_softplus(-y * d / tau) for y, d, _ in rows]
    expected = sum(wi * li for wi, li in zip(w, losses)) / 5
    assert abs(out.loss.item() - expected) < 1e-6
    got_w = out.weights[0]
    torch.testing.assert_close(got_w[0], torch.tensor([w[0], w[1], 0.0]))
    torch.testing.assert_close(got_w[1], torch.tensor(w[2:]))
    assert int(out.num_valid) == 5
    # agreement: head 0 both right, head 1 all three wrong
    assert abs(out.accuracy.item() - 2 / 5) < 1e-7
    # gradient of Eq. 7 w.r.t. p_new of the first decision: -y w sigmoid(-y d / tau) / tau / 5
    out.loss.backward()
    g_expected = -w[0] * _sigmoid(-1.0 / tau) / tau / 5
    assert abs(pred.grad[0, 0, 4].item() - g_expected) < 1e-6
    assert pred.grad[0, 0, 3].item() == 0.0  # the invalid decision contributes nothing


def test_unweighted_equals_plain_mean_and_weights_are_normalised():
    g = torch.Generator().manual_seed(0)
    pred = torch.randn(2, 3, 10, generator=g)
    target = torch.randn(2, 3, 10, generator=g)
    n = 7
    t_new = torch.randint(0, 10, (2, 3, n), generator=g)
    t_bnd = torch.randint(0, 10, (2, 3, n), generator=g)
    y = torch.where(torch.rand(2, 3, n, generator=g) < 0.3, 1.0, -1.0)
    valid = torch.rand(2, 3, n, generator=g) < 0.7
    dec = BoundaryDecisions(query=t_new, t_new=t_new, t_bnd=t_bnd, y=y * valid, valid=valid)
    plain = boundary_loss(pred, target, dec, margin_weighting=False, balance=False)
    ref, count = 0.0, 0
    for b in range(2):
        for h in range(3):
            for j in range(n):
                if valid[b, h, j]:
                    d = pred[b, h, t_new[b, h, j]] - pred[b, h, t_bnd[b, h, j]]
                    ref += _softplus(-float(y[b, h, j]) * float(d))
                    count += 1
    assert abs(plain.loss.item() - ref / count) < 1e-5
    torch.testing.assert_close(plain.weights, valid.float())
    full = boundary_loss(pred, target, dec)
    assert abs(full.weights[valid].mean().item() - 1.0) < 1e-6
    assert (full.weights[~valid] == 0).all() and (full.weights[valid] > 0).all()


def test_balancing_factor_uses_head_fraction_over_batch_and_positions():
    # head 0: keep labels 1 of 4 (over two batch elements) -> rho = 1/4: keep 1/(2/4) = 2, drop 1/(2*3/4) = 2/3
    # head 1: all keep -> rho = 1: keep 1/2 = 0.5, (drop would be inf -> clipped, but there is none)
    y = torch.tensor([[[1.0, -1.0], [1.0, 1.0]], [[-1.0, -1.0], [1.0, 1.0]]])  # [2, 2, 2]
    valid = torch.ones(2, 2, 2, dtype=torch.bool)
    idx = torch.tensor([[[3, 4], [3, 4]], [[3, 4], [3, 4]]])
    dec = BoundaryDecisions(query=idx, t_new=idx, t_bnd=idx - 2, y=y, valid=valid)
    pred = torch.zeros(2, 2, 6)
    out = boundary_loss(pred, torch.zeros(2, 2, 6), dec, margin_weighting=False, balance_clip=(0.1, 10.0))
    raw = torch.tensor([[[2.0, 2 / 3], [0.5, 0.5]], [[2 / 3, 2 / 3], [0.5, 0.5]]])
    torch.testing.assert_close(out.weights, raw / raw.mean())
    # head 0: keep and drop decisions carry the same total weight (2 * 1 == 2/3 * 3)
    w0 = out.weights[:, 0]
    assert abs(w0[y[:, 0] > 0].sum().item() - w0[y[:, 0] < 0].sum().item()) < 1e-6
    # clipping bites
    out = boundary_loss(pred, torch.zeros(2, 2, 6), dec, margin_weighting=False, balance_clip=(0.6, 1.5))
    raw = torch.tensor([[[1.5, 2 / 3], [0.6, 0.6]], [[2 / 3, 2 / 3], [0.6, 0.6]]])
    torch.testing.assert_close(out.weights, raw / raw.mean())


def test_no_valid_decisions_gives_zero_loss_and_zero_grad():
    pred = torch.randn(1, 2, 8, requires_grad=True)
    dec = BoundaryDecisions(query=torch.zeros(1, 2, 3, dtype=torch.long), t_new=torch.zeros(1, 2, 3, dtype=torch.long),
                            t_bnd=torch.zeros(1, 2, 3, dtype=torch.long), y=torch.zeros(1, 2, 3),
                            valid=torch.zeros(1, 2, 3, dtype=torch.bool))
    out = boundary_loss(pred, torch.randn(1, 2, 8), dec)
    assert out.loss.item() == 0.0 and int(out.num_valid) == 0 and out.accuracy.item() == 0.0
    out.loss.backward()
    assert torch.isfinite(pred.grad).all() and (pred.grad == 0).all()
    assert (out.weights == 0).all()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gradient_direction(seed):
    """A small step of p̂_new in the direction of y lowers the loss; the target gets no gradient."""
    g = torch.Generator().manual_seed(seed)
    pred = torch.randn(1, 1, 10, generator=g, requires_grad=True)
    target = torch.randn(1, 1, 10, generator=g, requires_grad=True)
    for y in (1.0, -1.0):
        dec = _decisions([[[7]]], [[[2]]], [[[y]]], [[[True]]])
        out = boundary_loss(pred, target, dec)
        (grad,) = torch.autograd.grad(out.loss, pred, retain_graph=True)
        assert grad[0, 0, 7].item() * y < 0 and grad[0, 0, 2].item() * y > 0
        stepped = pred.detach().clone()
        stepped[0, 0, 7] += 0.1 * y
        assert boundary_loss(stepped, target, dec).loss.item() < out.loss.item()
    assert not out.weights.requires_grad
    out.loss.backward()
    assert target.grad is None


def test_student_equal_to_teacher_agrees_on_every_decision():
    """End to end: pred = teacher priorities (ties included) -> accuracy 1, and the margins are >= 0."""
    g = torch.Generator().manual_seed(3)
    target = torch.randint(0, 4, (2, 2, 40), generator=g).float()
    teacher = teacher_policy(target, torch.tensor([0.0, -0.05]), sinks=2, window=4, topk=5)
    dec = boundary_decisions(teacher, torch.arange(0, 40), sinks=2, window=4, topk=5)
    out = boundary_loss(teacher.priorities, teacher.priorities, dec)
    assert int(out.num_valid) == 2 * 2 * (40 - 11)
    assert out.accuracy.item() == 1.0
    y = dec.y
    margin = y * (torch.gather(teacher.priorities, -1, dec.t_new) - torch.gather(teacher.priorities, -1, dec.t_bnd))
    assert (margin[dec.valid] >= 0).all()


def test_validation_errors():
    pred = torch.randn(1, 2, 6)
    dec = _decisions(**DEC)
    bad = [
        (dict(temperature=0.0), "temperature=0.0"),
        (dict(margin_temperature=-1.0), "margin_temperature=-1.0"),
        (dict(margin_min_weight=1.5), "margin_min_weight=1.5"),
        (dict(balance_clip=(2.0, 1.0)), "balance_clip"),
        (dict(target_priority=torch.randn(1, 2, 7)), "target_priority shape"),
    ]
    for override, needle in bad:
        kwargs = dict(pred_priority=pred, target_priority=torch.randn(1, 2, 6), decisions=dec)
        kwargs.update(override)
        with pytest.raises(KVLearnError, match=needle):
            boundary_loss(**kwargs)
    with pytest.raises(KVLearnError, match="decisions shape"):
        boundary_loss(torch.randn(1, 3, 6), torch.randn(1, 3, 6), dec)


@pytest.mark.parametrize("groups", [2, 3])
def test_groups_are_independent_losses_along_the_head_axis(groups):
    """``groups=G`` on ``[b, G*h, n]``: each group's weights, valid count, accuracy and loss are those of a call on
    its heads alone (groups with different valid counts and label balances), the loss and accuracy the means over
    the groups; the gradient is the one of that mean."""
    g = torch.Generator().manual_seed(groups)
    b, h, n, seq = 2, 2, 5, 12
    pred = torch.randn(b, groups * h, seq, generator=g, requires_grad=True)
    target = torch.randn(b, groups * h, seq, generator=g)
    t_new = torch.randint(6, seq, (b, groups * h, n), generator=g)
    dec = BoundaryDecisions(query=t_new + 2, t_new=t_new, t_bnd=torch.randint(0, 6, (b, groups * h, n), generator=g),
                            y=torch.where(torch.rand(b, groups * h, n, generator=g) < 0.6, 1.0, -1.0),
                            valid=torch.rand(b, groups * h, n, generator=g) < 0.3 + 0.2 * torch.arange(groups * h)[:, None] / h)
    dec.y = dec.y * dec.valid
    kw = dict(margin_temperature=0.7, balance_clip=(0.5, 2.0))
    out = boundary_loss(pred, target, dec, groups=groups, **kw)
    alone = []
    for i in range(groups):
        heads = slice(i * h, (i + 1) * h)
        part = BoundaryDecisions(*(getattr(dec, f)[:, heads] for f in ("query", "t_new", "t_bnd", "y", "valid")))
        alone.append(boundary_loss(pred[:, heads], target[:, heads], part, **kw))
        torch.testing.assert_close(out.weights[:, heads], alone[-1].weights)
    assert len({int(a.num_valid) for a in alone}) > 1  # the groups differ in their valid counts
    assert out.num_valid.tolist() == [int(a.num_valid) for a in alone]
    torch.testing.assert_close(out.accuracy, torch.stack([a.accuracy for a in alone]).mean())
    ref = torch.stack([a.loss for a in alone]).mean()
    torch.testing.assert_close(out.loss, ref)
    (grad,) = torch.autograd.grad(out.loss, pred)
    (want,) = torch.autograd.grad(ref, pred)
    torch.testing.assert_close(grad, want)
    one = boundary_loss(pred, target, dec, **kw)  # groups=1: one loss over all heads, another normalisation
    assert one.num_valid.dim() == 0 and int(one.num_valid) == int(out.num_valid.sum())


def test_groups_must_divide_the_heads():
    dec = _decisions(**DEC)
    for bad in (0, 3, 1.0, True):
        with pytest.raises(KVLearnError, match=rf"groups={bad!r} is invalid: expected an integer >= 1 that divides kv_heads=2"):
            boundary_loss(torch.randn(1, 2, 6), torch.randn(1, 2, 6), dec, groups=bad)
