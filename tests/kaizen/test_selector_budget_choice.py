"""The selector's evaluation choice under the budget (:meth:`KaizenSelector.choose_within_budget`, what
``kvlearn eval --method kaizen`` runs): the argmax when it is within ``C* = C_ref / ρ*``, else the most likely
configuration within it, checked against brute-force enumeration of every allowed configuration (tiny GQA backbone:
4 layers, 2 KV heads of 16), per row, for tight and loose targets and a restricted set of sharing layers; through
:func:`kvlearn.kaizen.apply.select` the chosen configuration never exceeds the target's bits."""

import math
import sys
from itertools import product
from pathlib import Path

import pytest
import torch

from kvlearn import KVLearnError
from kvlearn.kaizen.actions import Backbone
from kvlearn.kaizen.apply import KaizenMethodConfig, apply_kaizen, select, selector_of
from kvlearn.kaizen.selector import KaizenSelector

sys.path.insert(0, str(Path(__file__).parent))
from test_cache_sharing import VOCAB, tiny  # noqa: E402

BB = Backbone(num_layers=4, kv_heads=2, head_dim=16)


def brute_force(logits_row: torch.Tensor, costs, mask, budget: float):
    """The allowed configuration of greatest summed log-probability with cost <= budget (ties: the first found)."""
    logp = torch.log_softmax(logits_row.double(), -1)
    best, best_value = None, -math.inf
    L, A = logp.shape
    for combo in product(range(A), repeat=L):
        if not all(mask[l][a] for l, a in enumerate(combo)):
            continue
        if sum(costs[a] for a in combo) > budget * (1 + 1e-9):
            continue
        value = sum(float(logp[l, a]) for l, a in enumerate(combo))
        if value > best_value + 1e-12:
            best, best_value = combo, value
    return best, best_value


@pytest.mark.parametrize("share_layers", [None, (2,)])
def test_choice_is_the_argmax_within_budget_else_the_best_feasible(share_layers):
    sel = KaizenSelector(VOCAB, BB, share_layers=share_layers)
    costs, mask = sel.costs.tolist(), sel.mask.tolist()
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 4, sel.num_actions, generator=gen) * 2
    logits = logits.masked_fill(~sel.mask, float("-inf"))
    logits[0, :, 0] += 10  # row 0: 16 bits everywhere by far: over any target > 1
    projected = 0
    for target in (1.0, 2.0, 4.0, 7.0):
        choice = sel.choose_within_budget(logits, target)
        budget = BB.reference_bits / target
        logp = torch.log_softmax(logits.double(), -1)
        for row in range(logits.shape[0]):
            argmax = logits[row].argmax(-1)
            got = choice[row].tolist()
            assert sum(costs[a] for a in got) <= budget * (1 + 1e-9)
            assert all(mask[l][a] for l, a in enumerate(got))
            if sum(costs[a] for a in argmax.tolist()) <= budget:
                assert got == argmax.tolist()
            else:
                projected += 1
                _, want_value = brute_force(logits[row], costs, mask, budget)
                value = sum(float(logp[row, l, a]) for l, a in enumerate(got))
                assert value == pytest.approx(want_value, abs=1e-9)
    assert projected >= 4  # the check has teeth: several rows were over budget


def test_per_row_targets_and_an_infeasible_budget():
    sel = KaizenSelector(VOCAB, BB, share_layers=())
    logits = torch.zeros(2, 4, sel.num_actions).masked_fill(~sel.mask, float("-inf"))
    logits[:, :, 0] = 5.0  # 16 bits everywhere
    choice = sel.choose_within_budget(logits, torch.tensor([1.0, 4.0]))
    assert choice[0].tolist() == [0, 0, 0, 0]
    assert sum(sel.costs[a] for a in choice[1].tolist()) <= BB.reference_bits / 4
    with pytest.raises(KVLearnError) as e:  # no sharing allowed: 2 bits everywhere is 8x at most
        sel.choose_within_budget(logits, 10.0)
    assert "infeasible" in str(e.value) and "\n" not in str(e.value)


def test_select_never_exceeds_the_target():
    model = tiny(0)
    apply_kaizen(model, KaizenMethodConfig(target=4.0))
    sel = selector_of(model)
    with torch.no_grad():  # the initial margin favours 16 bits everywhere: the argmax is 1x
        sel.head_bias.normal_(generator=torch.Generator().manual_seed(3))
        sel.head_bias[:, 0] += 4.0
    ids = torch.randint(1, VOCAB, (3, 20), generator=torch.Generator().manual_seed(1))
    for target in (1.0, 2.0, 4.0, 8.0):
        configs, logits = select(model, ids, target=target)
        for config in configs:
            assert config.compression(metadata=False) >= target * (1 - 1e-9)
        if target > 1:
            assert (logits.argmax(-1)[:, :] == 0).all()  # the raw argmax would have kept 16 bits
