"""KV-Kaizen's offline DP search baseline (``kaizen_dp``, :mod:`kvlearn.kaizen.dp_search`):

- the DP equals brute-force enumeration of every per-layer configuration on small random loss/cost tables (several
  seeds; per-action and per-layer costs; masks; costs with a large common divisor and with none), and on the real
  action spaces (precision + depth with no share at layer 0; an MLA backbone's 17 actions);
- on a tiny random GQA Qwen3 (3 layers, 2 KV heads, 2 query heads per KV head, testbed vocabulary) the measured
  increase of the reference action is 0 and the base loss is the plain model's; one entry re-measured by hand; the
  searched configuration meets the target and predicts no more loss than the uniform one;
- ``kaizen_dp`` runs through the evaluation harness and the CLI at ``--target 4``, its rows named ``kaizen_dp``;
- bad input is a one-line error (infeasible budget naming the feasible range, shapes, values, settings).
"""

import itertools
import json
import math
import random

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import kvlearn
from kvlearn import KVLearnError
from kvlearn.cli import main
from kvlearn.kaizen import sharing
from kvlearn.kaizen.actions import Backbone, KaizenConfig, action_bits, action_mask, action_space
from kvlearn.kaizen.dp_method import DPConfig, make_prompt_cache
from kvlearn.kaizen.dp_search import (LossTable, calibration_batch, choose, config_loss, dp_search,
                                      measure_layer_losses, search)
from kvlearn.kaizen.fixed import static_config
from kvlearn.methods import make_config
from kvlearn.testbed.tokenizer import VOCAB_SIZE


def one_line(err) -> str:
    message = str(err.value)
    assert message and "\n" not in message
    return message


def brute_force(losses, costs, budget, allowed):
    """``(least summed loss, its indices)`` over every allowed configuration with ``Σ c <= budget``."""
    L, A = len(losses), len(losses[0])
    per_layer = [list(costs[l]) if isinstance(costs[0], (list, tuple)) else list(costs) for l in range(L)]
    best = (math.inf, None)
    for combo in itertools.product(*[[a for a in range(A) if allowed[l][a]] for l in range(L)]):
        if sum(per_layer[l][a] for l, a in enumerate(combo)) <= budget:
            loss = sum(losses[l][a] for l, a in enumerate(combo))
            if loss < best[0]:
                best = (loss, combo)
    return best


def check_against_brute_force(losses, costs, budget, allowed):
    choice = dp_search(losses, costs, budget, allowed)
    loss, combo = brute_force(losses, costs, budget, allowed)
    per_layer = [list(costs[l]) if isinstance(costs[0], (list, tuple)) else list(costs) for l in range(len(losses))]
    assert choice.bits == sum(per_layer[l][a] for l, a in enumerate(choice.indices)) <= budget
    assert all(allowed[l][a] for l, a in enumerate(choice.indices))
    assert choice.loss == pytest.approx(loss, abs=1e-12)
    assert choice.indices == combo  # continuous random losses: the optimum is unique


@pytest.mark.parametrize("seed", range(8))
def test_dp_equals_brute_force_on_random_tables(seed):
    rng = random.Random(seed)
    for trial in range(6):
        L, A = rng.randint(1, 5), rng.randint(2, 4)
        unit = rng.choice([1, 7, 4096])  # a large common divisor, or none
        per_layer = trial % 2 == 1
        if per_layer:
            costs = [[unit * rng.randint(0, 9) for _ in range(A)] for _ in range(L)]
        else:
            costs = [unit * rng.randint(0, 9) for _ in range(A)]
        losses = [[rng.uniform(-0.2, 2.0) for _ in range(A)] for _ in range(L)]
        allowed = [[rng.random() < 0.8 for _ in range(A)] for _ in range(L)]
        for row in allowed:
            row[rng.randrange(A)] = True
        if trial % 3 == 0:  # the action constraint: the last action ("share") not allowed at layer 0
            allowed[0][A - 1] = False
            if not any(allowed[0]):
                allowed[0][0] = True
        layer_costs = costs if per_layer else [costs] * L
        least = sum(min(c for c, ok in zip(layer_costs[l], allowed[l]) if ok) for l in range(L))
        most = sum(max(c for c, ok in zip(layer_costs[l], allowed[l]) if ok) for l in range(L))
        budget = least + rng.random() * (most - least)
        check_against_brute_force(losses, costs, budget, allowed)
        check_against_brute_force(losses, costs, least, allowed)  # only the cheapest configurations fit


@pytest.mark.parametrize("seed", range(3))
def test_dp_equals_brute_force_on_the_kaizen_action_spaces(seed):
    rng = random.Random(100 + seed)
    gqa = Backbone(num_layers=4, kv_heads=2, head_dim=16)
    mla = Backbone(num_layers=3, kv_heads=2, head_dim=16, mla_rank=32, rope_dim=8)
    for backbone in (gqa, mla):
        space = action_space(backbone)
        costs = [action_bits(a, backbone, metadata=False) for a in space]
        allowed = action_mask(backbone)
        assert not allowed[0][-1] and space[-1].share  # layer 0 never shares
        losses = [[0.0 if a == 0 else rng.uniform(0.0, 1.0) for a in range(len(space))]
                  for _ in range(backbone.num_layers)]
        for target in (2.0, 3.0, 5.0):
            budget = backbone.reference_bits / target
            check_against_brute_force(losses, costs, budget, allowed)
            config, choice = choose(LossTable(space, torch.tensor(losses, dtype=torch.float64), 0.0), backbone,
                                    target)
            assert config.compression(metadata=False) >= target and not config.actions[0].share
            assert choice.bits == config.bits_per_token(metadata=False)


def test_ties_go_to_the_least_compressed_configuration():
    bb = Backbone(num_layers=3, kv_heads=2, head_dim=16)
    space = action_space(bb)
    zero = LossTable(space, torch.zeros(3, len(space), dtype=torch.float64), 0.0)
    for target in (1.0, 2.0, 4.0):  # the uniform configurations that meet these targets exactly
        config, choice = choose(zero, bb, target)
        assert choice.loss == 0.0
        assert choice.bits == static_config(bb, target).bits_per_token(metadata=False) == bb.reference_bits / target
    assert choose(zero, bb, 1.0)[0] == KaizenConfig.static(bb, 16)


def test_dp_bad_input_is_one_line():
    with pytest.raises(KVLearnError) as e:
        dp_search([[0.0, 1.0], [0.0, 1.0]], [8, 2], 3)
    assert "infeasible" in one_line(e) and "4 .. 16 bits per token" in one_line(e)
    with pytest.raises(KVLearnError) as e:
        dp_search([[0.0, 1.0]], [8, 2, 1], 10)
    assert "expected [2] or [1, 2]" in one_line(e)
    with pytest.raises(KVLearnError) as e:
        dp_search([[0.0, 1.0]], [8, -2], 10)
    assert "non-negative integers" in one_line(e)
    with pytest.raises(KVLearnError) as e:
        dp_search([[0.0, 1.0]], [8, 2.5], 10)
    assert "non-negative integers" in one_line(e)
    with pytest.raises(KVLearnError) as e:
        dp_search([[0.0, float("nan")]], [8, 2], 10)
    assert "finite" in one_line(e)
    with pytest.raises(KVLearnError) as e:
        dp_search([[0.0, 1.0]], [8, 2], 10, allowed=[[False, False]])
    assert "layer 0 allows no action" in one_line(e)
    with pytest.raises(KVLearnError) as e:
        dp_search([[0.0, 1.0]], [8, 2], -1)
    assert "budget=-1" in one_line(e)
    with pytest.raises(KVLearnError) as e:
        dp_search([[0.0, 1.0], [0.0]], [8, 2], 10)
    assert "losses" in one_line(e)
    assert dp_search([[0.0, float("inf")]], [8, 2], 10, allowed=[[True, False]]).indices == (0,)
    bb = Backbone(num_layers=2, kv_heads=2, head_dim=16)
    table = LossTable(action_space(bb), torch.zeros(2, 5, dtype=torch.float64), 0.0)
    with pytest.raises(KVLearnError) as e:
        choose(table, bb, 1000.0, axes=("precision", "depth"))
    assert "outside the feasible range [1x, 16x]" in one_line(e)
    with pytest.raises(KVLearnError) as e:
        choose(table, bb, 4.0, axes=("precision",))
    assert "another action space" in one_line(e)


# ----------------------------------------------------------------------------------------------------------------
# measurement and the method, on a tiny random GQA Qwen3 with the testbed vocabulary


def tiny(max_positions=512):
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=max_positions,
                      pad_token_id=0, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_norm.weight.uniform_(0.25, 2.0)
    return model


@pytest.fixture(scope="module")
def measured():
    model = sharing.attach(tiny())
    ids, labels = calibration_batch(2, 128, 0)
    return model, ids, labels, measure_layer_losses(model, ids, labels, batch_size=1)


def test_reference_action_measures_zero_and_base_is_the_plain_model(measured):
    model, ids, labels, table = measured
    bb = Backbone.from_model(model)
    assert table.actions == action_space(bb) and table.increases.shape == (3, 5)
    assert (table.increases[:, 0] == 0).all()
    assert table.increases[0, -1] == math.inf and table.increases[1:, -1].isfinite().all()  # no share at layer 0
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits[:, :-1]
    plain = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    assert table.base_loss == pytest.approx(float(plain), abs=1e-5)
    # one entry by hand: layer 2 at 2 bits, the others at 16
    space = action_space(bb)
    assert space[3].bits == 2 and not space[3].share
    cfg = KaizenConfig(bb, (space[0], space[0], space[3]))
    assert float(table.increases[2, 3]) == pytest.approx(config_loss(model, cfg, ids, labels, batch_size=1) - table.base_loss,
                                                         abs=1e-9)
    assert float(table.increases[:, 1:4].abs().max()) > 0  # quantizing a layer changes the loss


def test_searched_configuration_meets_the_target_and_beats_the_uniform_prediction(measured):
    model, ids, labels, table = measured
    bb = Backbone.from_model(model)
    for target in (2.0, 4.0, 8.0):
        config, choice = choose(table, bb, target)
        assert config.compression(metadata=False) >= target
        uniform = static_config(bb, target)
        index = {a: i for i, a in enumerate(table.actions)}
        predicted_uniform = sum(float(table.increases[l, index[a]]) for l, a in enumerate(uniform.actions))
        assert choice.loss <= predicted_uniform + 1e-12
    found = search(model, 4.0, examples=2, length=128, seed=0, batch_size=1)
    assert found.config == choose(table, bb, 4.0)[0]  # deterministic
    assert torch.equal(found.table.increases, table.increases)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("dp") / "qwen3"
    tiny(max_positions=2048).save_pretrained(path)
    return str(path)


def test_kaizen_dp_through_the_harness(model_path):
    from kvlearn.eval.accuracy import EvalConfig, evaluate

    model = kvlearn.load(model_path)
    config = EvalConfig(method="kaizen_dp", context=256, tasks=("vt",), n_per_task=2, batch_size=2, target=4.0,
                        options={"examples": 2, "length": 128})
    (row,) = evaluate(model, config, progress=False)
    assert row["method"] == "kaizen_dp" and row["target"] == 4.0 and row["n"] == 2 and row["factor"] >= 4.0
    assert row["options"] == {"examples": 2, "length": 128}
    saved = model.config.kaizen_dp
    assert saved["target"] == 4.0 and len(saved["indices"]) == 3 and len(saved["increases"]) == 3
    assert saved["increases"][0][-1] is None and saved["actions"][0] != "share"
    json.dumps(saved)  # written into config.json by save_pretrained


def test_kaizen_dp_cli(model_path, tmp_path):
    dest = tmp_path / "dp.json"
    assert main(["eval", "--method", "kaizen_dp", "--model", model_path, "--context", "256", "--n-per-task", "1",
                 "--tasks", "vt", "--target", "4", "--out", str(dest)]) == 0
    (row,) = json.loads(dest.read_text())["rows"]
    assert row["method"] == "kaizen_dp" and row["target"] == 4.0 and row["factor"] >= 4.0


def test_kaizen_dp_bad_settings_are_one_line(model_path):
    from kvlearn.kaizen.dp_method import apply

    with pytest.raises(KVLearnError) as e:
        make_config("kaizen_dp", budget=64)
    assert "--target" in one_line(e)
    with pytest.raises(KVLearnError) as e:
        DPConfig(length=10)
    assert "length=10" in one_line(e)
    with pytest.raises(KVLearnError) as e:
        DPConfig(examples=0)
    assert "examples=0" in one_line(e)
    model = tiny()
    with pytest.raises(KVLearnError) as e:
        apply(model, DPConfig(target=1000.0, examples=1, length=128))
    assert "outside the feasible range [1x, 24x]" in one_line(e)
    with pytest.raises(KVLearnError) as e:
        apply(model, DPConfig(target=4.0, examples=1, length=1024))
    assert "max_position_embeddings=512" in one_line(e)
    with pytest.raises(KVLearnError) as e:
        make_prompt_cache(DPConfig(), model, torch.ones(1, 8, dtype=torch.long), None, 4)
    assert "no search recorded" in one_line(e)
    apply(model, DPConfig(target=4.0, examples=1, length=128))
    cache = make_prompt_cache(DPConfig(target=4.0, examples=1, length=128), model, torch.ones(1, 8, dtype=torch.long),
                              None, 4)
    assert cache.config.compression(metadata=False) >= 4.0
    with pytest.raises(KVLearnError) as e:  # another target than the recorded search
        make_prompt_cache(DPConfig(target=2.0, examples=1, length=128), model, torch.ones(1, 8, dtype=torch.long),
                          None, 4)
    assert "no search recorded" in one_line(e)
