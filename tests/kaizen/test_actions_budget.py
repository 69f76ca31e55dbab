"""KV-Kaizen's action space, cost model and budget multiplier (``docs/DESIGN.md`` section 8).

- the cost of each action by hand; the paper's reproducible factors (section 4: 4-bit 4x without metadata, an MLA
  latent of 128 is 10.7x, 12 groups of 4 layers 4x, the three composed 152x with MLX's 3.56x quantizer; appendix
  C.3: one bf16 scale per 128-element row); the 17 actions of the full space; feasible ranges;
- every bad input is a one-line KVLearnError naming the value and the valid range;
- static / evenly shared / random-at-budget constructors;
- the budget multiplier's dynamics on a hand-computed sequence, and the penalty's value and gradient.
"""

import pytest
import torch

from kvlearn import KVLearnError
from kvlearn.kaizen.actions import (AXES, Backbone, KaizenConfig, LayerAction, action_bits, action_mask,
                                    action_space, check_budget, feasible_range)
from kvlearn.kaizen.budget import BudgetMultiplier, excess, selection_cost

QWEN14 = Backbone(num_layers=48, kv_heads=8, head_dim=128)  # Qwen2.5-14B: 2 n_kv d_h = 2048
QWEN14_MLA = Backbone(num_layers=48, kv_heads=8, head_dim=128, mla_rank=1024, rope_dim=64)


def test_action_cost_by_hand():
    g = Backbone(num_layers=2, kv_heads=2, head_dim=16)
    assert action_bits(LayerAction(16), g) == 2 * 2 * 16 * 16  # no scale at 16 bits
    assert action_bits(LayerAction(4), g) == 2 * 2 * 16 * 4 + 2 * 2 * 16  # + one bf16 scale per K and V vector
    assert action_bits(LayerAction(4), g, metadata=False) == 2 * 2 * 16 * 4
    assert action_bits(LayerAction.shared(), g) == 0
    m = Backbone(num_layers=2, kv_heads=2, head_dim=16, mla_rank=32, rope_dim=8)
    assert action_bits(LayerAction(16, rank=8), m) == (8 + 8) * 16
    assert action_bits(LayerAction(2, rank=16), m) == (16 + 8) * 2 + 2 * 16  # latent + RoPE key: two scales
    assert action_bits(LayerAction(8), m) == (32 + 8) * 8 + 32  # rank None = the full latent


def test_paper_factors():
    L = 48
    four_bit = KaizenConfig.static(QWEN14, bits=4)
    assert four_bit.compression(metadata=False) == 4.0
    assert four_bit.compression() == pytest.approx(4096 / 1056)  # one bf16 scale per 128-element row: 3.88x
    latent = KaizenConfig.static(QWEN14_MLA, rank=128)
    assert latent.compression() == pytest.approx(2048 / 192)  # 10.7x
    groups = KaizenConfig.evenly_shared(QWEN14, group=4)
    assert len(groups.anchors) == 12 and groups.compression() == 4.0
    assert groups.anchor_of(7) == 4 and groups.anchor_of(8) == 8
    composed = (KaizenConfig.evenly_shared(QWEN14_MLA, group=4).compression() / (2048 / 1088)) * latent.compression()
    assert composed * 16 / 4.5 == pytest.approx(152, rel=2e-3)  # x MLX's 4-bit (4.5 bits per element) = 152x
    assert KaizenConfig.static(QWEN14).bits_per_token() == QWEN14.reference_bits == L * 2048 * 16


def test_action_space_and_feasible_ranges():
    full = action_space(QWEN14_MLA)
    assert len(full) == 17 and full[0] == LayerAction(16) and full[-1].share  # least compressed first
    assert len(action_space(QWEN14_MLA, ("precision", "rank"))) == 16
    assert [str(a) for a in action_space(QWEN14, ("precision", "depth"))] == ["b16", "b8", "b4", "b2", "share"]
    costs = [action_bits(a, QWEN14_MLA, metadata=False) for a in full]
    assert costs == sorted(costs, reverse=True)
    assert feasible_range(QWEN14, ("precision",)) == (1.0, 8.0)  # "precision cannot pass 8x"
    assert feasible_range(QWEN14, ("precision", "depth")) == (1.0, 8.0 * 48)
    assert feasible_range(QWEN14, ("depth",)) == (1.0, 48.0)
    lo, hi = feasible_range(QWEN14_MLA, ("rank",))
    assert lo == pytest.approx(2048 / 1088) and hi == pytest.approx(2048 / 192)  # MLA starts above 1x
    assert feasible_range(QWEN14_MLA, AXES)[1] == pytest.approx(2048 * 16 * 48 / ((128 + 64) * 2))  # 4096x
    assert feasible_range(QWEN14) == feasible_range(QWEN14, ("precision", "depth"))  # None: the backbone's axes


def test_bad_input_one_line_errors():
    cases = [
        (lambda: LayerAction(bits=3), "bits=3 is invalid: expected one of 2, 4, 8, 16"),
        (lambda: LayerAction(bits=True), "bits=True is invalid"),
        (lambda: LayerAction(bits=4, share=True), "keeps no cache of its own: bits=4"),
        (lambda: KaizenConfig.static(QWEN14, rank=128), "rank=128 needs an MLA backbone; this one is GQA"),
        (lambda: KaizenConfig.static(QWEN14_MLA, rank=100), "rank=100 is invalid: expected one of 128, 256, 512, 1024"),
        (lambda: KaizenConfig(QWEN14, (LayerAction.shared(),) + (LayerAction(),) * 47), "layer 0 cannot share"),
        (lambda: KaizenConfig(QWEN14, (LayerAction(),) * 3), "3 actions given for a backbone of 48 layers"),
        (lambda: check_budget(9.0, QWEN14, ("precision",)),
         r"target compression 9.0 is outside the feasible range \[1x, 8x\] for axes precision"),
        (lambda: check_budget(0.5, QWEN14), r"outside the feasible range \[1x, 384x\]"),
        (lambda: action_space(QWEN14, ("rank",)), "axis 'rank' needs an MLA backbone"),
        (lambda: action_space(QWEN14, ("width",)), "axes=.* is invalid: expected a non-empty subset"),
        (lambda: Backbone(4, 2, 16, mla_rank=20), "mla_rank=20 is invalid: expected a positive multiple of 8"),
        (lambda: KaizenConfig.from_indices(QWEN14, [0] * 47 + [9], ("precision", "depth")),
         r"action index 9 is invalid: expected 0 .. 4"),
        (lambda: BudgetMultiplier(cap=-1), "cap=-1 is invalid: expected a number >= 0"),
    ]
    for make, message in cases:
        with pytest.raises(KVLearnError, match=message) as err:
            make()
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("axes", [("precision",), ("precision", "depth"), ("depth",), AXES])
@pytest.mark.parametrize("target", [2.0, 3.0, 6.0])
def test_random_configuration_meets_the_budget(axes, target):
    backbone = QWEN14_MLA if "rank" in axes else QWEN14
    config = KaizenConfig.random(backbone, target, axes, seed=3)
    allowed = set(action_space(backbone, axes))
    assert set(config.actions) <= allowed and not config.actions[0].share
    rho = config.compression(metadata=False)
    assert target <= rho < target * 1.35, rho  # meets the budget, with little slack left
    assert KaizenConfig.random(backbone, target, axes, seed=3) == config  # seeded
    assert any(KaizenConfig.random(backbone, target, axes, seed=s) != config for s in range(4, 8))


def test_from_indices_is_the_selector_interface():
    space = action_space(QWEN14, ("precision", "depth"))
    config = KaizenConfig.from_indices(QWEN14, [0, 4, 2] + [1] * 45, ("precision", "depth"))
    assert config.actions[:3] == (space[0], LayerAction.shared(), LayerAction(4)) and config.anchor_of(1) == 0
    mask = action_mask(QWEN14, ("precision", "depth"))
    assert mask[0] == [True] * 4 + [False] and all(mask[l] == [True] * 5 for l in range(1, 48))


def test_multiplier_dynamics_hand_computed():
    m = BudgetMultiplier(eta=0.5, delta=0.2, cap=1.0)
    target = 100.0
    # cost -> excess e -> beta = min(1, max(0, beta + 0.5 max(e, -0.2)))
    steps = [(200, 1.0, 0.5), (150, 0.5, 0.75), (400, 3.0, 1.0),  # capped at 1
             (50, -0.5, 0.9),  # decrease bounded: 0.5 * 0.2
             (95, -0.05, 0.875),  # below target by less than delta: 0.5 * 0.05
             (100, 0.0, 0.875)]
    for cost, e, beta in steps:
        assert float(excess(cost, target)) == pytest.approx(e)
        assert m.update(cost, target) == pytest.approx(beta)
    for _ in range(10):  # never below 0
        m.update(10, target)
    assert m.beta == 0.0
    m.update(torch.tensor([300.0, 100.0]), torch.tensor([100.0, 200.0]))  # mean excess (2 - 0.5) / 2 = 0.75
    assert m.beta == pytest.approx(0.375)
    frozen = BudgetMultiplier(eta=0.0, beta=5.0)  # constant multiplier
    assert frozen.update(1e6, 1.0) == 5.0
    restored = BudgetMultiplier()
    restored.load_state_dict(m.state_dict())
    assert restored == m


def test_penalty_value_and_gradient():
    m = BudgetMultiplier(beta=2.0)
    space = action_space(QWEN14, ("precision", "depth"))
    costs = [action_bits(a, QWEN14, metadata=False) for a in space]
    logits = torch.zeros(2, 48, len(space), requires_grad=True)
    weights = torch.softmax(logits, -1)
    cost = selection_cost(weights, costs)  # uniform over b16, b8, b4, b2, share: mean cost 0.375 of b16
    assert torch.allclose(cost, torch.full((2,), 48 * 32768 * 0.375))
    target = QWEN14.reference_bits / 4  # 4x: 0.25 of the reference
    p = m.penalty(cost, target)
    assert float(p.detach()) == pytest.approx(2.0 * (0.375 / 0.25 - 1))
    p.backward()
    g = logits.grad[0, 0]
    assert g[0] > 0 and g[-1] < 0  # pushes probability from b16 towards share
    assert float(m.penalty(torch.tensor([10.0]), 20.0)) == 0.0  # under budget: no penalty
