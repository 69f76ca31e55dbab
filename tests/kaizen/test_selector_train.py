"""The KV-Kaizen selector, its training forward, the trainer and the ``kaizen`` method, on tiny random GQA Qwen3
models (float32; 4 layers, 2 KV heads, 4 query heads, head_dim 16 for the forward; 2 layers with the testbed
vocabulary for training):

- at init the selector picks the least compressed action (16 bits, own cache) at every layer for every prompt and
  target; layer 0 never shares, even with every bias pushed towards share (argmax and Gumbel samples);
- with hard one-hot weights the training mixture forward equals, per row, the chosen :class:`KaizenConfig` run
  without a cache (``kaizen_config=``), through prefill + decoding in a :class:`KaizenCache`, and ``generate()``
  through it, to 1e-4;
- the budget penalty's gradient reaches the selector and points to cheaper actions; the KD loss reaches it through
  the mixture weights; budget conditioning changes the logits per sequence once FiLM is non-zero;
- a few training steps from factor 1.0 at target 4.0 with a high constant multiplier raise the realised factor; the
  final folder round-trips through ``kvlearn.load`` with identical logits and choices; ``kvlearn eval --method
  kaizen`` reports ``factor`` and ``target``; a resumed run equals an uninterrupted one;
- bad input is a one-line error (target outside the feasible range, naming it; unknown action index; a token budget
  for kaizen; CLI).
"""

import json
import sys
from pathlib import Path

import pytest
import torch

import kvlearn
from kvlearn import KVLearnError
from kvlearn.cli import main
from kvlearn.kaizen.actions import Backbone, KaizenConfig, action_space, check_budget
from kvlearn.kaizen.apply import KaizenMethodConfig, apply_kaizen, make_prompt_cache, select, selector_of
from kvlearn.kaizen.budget import BudgetMultiplier
from kvlearn.kaizen.cache import make_cache
from kvlearn.kaizen.selector import KaizenSelector, gumbel_straight_through, temperature_at
from kvlearn.kaizen.sharing import KaizenTrainForward
from kvlearn.methods import get_method
from kvlearn.methods import make_config as method_config
from kvlearn.testbed.tokenizer import VOCAB_SIZE
from kvlearn.train.kaizen_train import LOG_FILE, KaizenTrainConfig, kaizen_train, latest_checkpoint

sys.path.insert(0, str(Path(__file__).parent))
from test_cache_sharing import VOCAB, decode_through, tiny  # noqa: E402

SEQ = 128


def one_line(err) -> str:
    message = str(err.value)
    assert message and "\n" not in message
    return message


def ids_of(batch=3, length=30, seed=2, vocab=VOCAB):
    return torch.randint(1, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------------------------------------------
# selector


def test_init_picks_the_least_compressed_action_everywhere():
    model = tiny(0)
    bb = Backbone.from_config(model.config)
    sel = KaizenSelector(VOCAB, bb)
    space = action_space(bb)
    assert space[0].bits == 16 and not space[0].share and space[-1].share
    mask = torch.ones(3, 30, dtype=torch.long)
    mask[1, :7] = 0  # a left-padded row
    for target in (1.0, 4.0, torch.tensor([2.0, 8.0, 30.0])):
        logits = sel(ids_of(), mask, target)
        assert logits.shape == (3, 4, len(space))
        assert bool((logits[..., 0] > logits[..., 1:].max(-1).values).all())  # strictly: not a tie broken by index
        assert bool(torch.isinf(logits[:, 0, -1]).all()) and bool(torch.isfinite(logits[:, 1:]).all())
        for cfg in sel.configs(sel.choose(ids_of(), mask, target)):
            assert cfg == KaizenConfig.static(bb, 16) and cfg.compression() == 1.0


def test_layer_0_never_shares_even_when_pushed_towards_share():
    model = tiny(0)
    sel = KaizenSelector(VOCAB, Backbone.from_config(model.config))
    with torch.no_grad():
        sel.head_bias[:, -1] = 100.0  # share everywhere it is allowed
    logits = sel(ids_of())
    choice = logits.argmax(-1)
    assert bool((choice[:, 0] != sel.num_actions - 1).all()) and bool((choice[:, 1:] == sel.num_actions - 1).all())
    gen = torch.Generator().manual_seed(0)
    for tau in (2.0, 0.1):
        w = gumbel_straight_through(logits.expand(64, -1, -1) if logits.shape[0] == 1 else logits.repeat(20, 1, 1),
                                    tau, generator=gen)
        assert float(w.detach()[:, 0, -1].abs().max()) == 0.0
        assert torch.allclose(w.sum(-1), torch.ones_like(w.sum(-1)))
    configs = sel.configs(choice)
    assert all(not c.actions[0].share and all(a.share for a in c.actions[1:]) for c in configs)


def test_gumbel_straight_through_is_one_hot_forward_softmax_backward():
    logits = torch.tensor([[[1.0, 0.5, -1.0]]], requires_grad=True)
    w = gumbel_straight_through(logits, 1.0, noise=False)
    assert w.tolist() == [[[1.0, 0.0, 0.0]]]
    (w * torch.tensor([3.0, 2.0, 1.0])).sum().backward()
    p = torch.softmax(logits.detach(), -1)[0, 0]
    c = torch.tensor([3.0, 2.0, 1.0])
    torch.testing.assert_close(logits.grad[0, 0], p * (c - (p * c).sum()))  # d/dz sum(softmax(z) c)
    assert temperature_at(0.0) == 2.0 and abs(temperature_at(1.0) - 0.1) < 1e-12
    assert abs(temperature_at(0.5) - (2.0 * 0.1) ** 0.5) < 1e-12


def test_budget_conditioning_is_per_sequence_and_zero_at_init():
    model = tiny(0)
    sel = KaizenSelector(VOCAB, Backbone.from_config(model.config))
    ids = ids_of(1).repeat(2, 1)
    same = sel(ids, None, torch.tensor([1.0, 16.0]))
    torch.testing.assert_close(same[0], same[1])  # FiLM starts at zero
    with torch.no_grad():
        sel.film.weight.normal_()
        sel.head_weight.normal_()
    got = sel(ids, None, torch.tensor([1.0, 16.0]))
    assert float((got[0, 1:] - got[1, 1:]).detach().abs().max()) > 1e-3
    torch.testing.assert_close(got[0], sel(ids[:1], None, 1.0)[0])


# ----------------------------------------------------------------------------------------------------------------
# the training forward


INDICES = [[2, 4, 0, 4], [1, 3, 4, 2], [0, 4, 4, 4], [3, 0, 1, 2]]  # actions: b16 b8 b4 b2 share


def test_hard_one_hot_training_forward_equals_the_chosen_configs():
    model = tiny(1)
    bb = Backbone.from_config(model.config)
    space = action_space(bb)
    ids = ids_of(len(INDICES))
    idx = torch.tensor(INDICES)
    logits = torch.randn(len(INDICES), 4, len(space)) + 20 * torch.nn.functional.one_hot(idx, len(space))
    logits[:, 0, -1] = float("-inf")
    weights = gumbel_straight_through(logits, 0.5, generator=torch.Generator().manual_seed(0))
    assert bool((weights.argmax(-1) == idx).all())
    with torch.no_grad():
        got = model(input_ids=ids, use_cache=False, kaizen_train=KaizenTrainForward(space, weights)).logits
        plain = model(input_ids=ids, use_cache=False).logits
    for r, row in enumerate(INDICES):
        cfg = KaizenConfig.from_indices(bb, row)
        with torch.no_grad():
            ref = model(input_ids=ids[r:r + 1], use_cache=False, kaizen_config=cfg).logits
        torch.testing.assert_close(got[r:r + 1], ref, atol=1e-4, rtol=1e-4)
        cached = decode_through(model, make_cache(cfg, model.config, capacity=32), ids[r:r + 1], 11)
        torch.testing.assert_close(got[r:r + 1], cached, atol=1e-4, rtol=1e-4)
        assert float((got[r] - plain[r]).abs().max()) > 1e-3  # every configuration here changes the model
    # generate() through the chosen config's cache follows the training forward's greedy continuation
    cfg = KaizenConfig.from_indices(bb, INDICES[1])
    prompt = ids[1:2, :12]
    out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                         past_key_values=make_cache(cfg, model.config, capacity=20), pad_token_id=0)
    with torch.no_grad():
        full = model(input_ids=out[:, :-1], use_cache=False,
                     kaizen_train=KaizenTrainForward(space, weights[1:2])).logits
    assert out[0, 12:].tolist() == full[0, 11:].argmax(-1).tolist()


def test_penalty_and_kd_gradients_reach_the_selector():
    model = tiny(1)
    sel = KaizenSelector(VOCAB, Backbone.from_config(model.config))
    ids = ids_of(2)
    targets = torch.tensor([4.0, 4.0])
    logits = sel(ids, None, targets)
    weights = gumbel_straight_through(logits, 1.0, noise=False)  # the least compressed: 4x over budget
    cost = sel.cost(weights)
    assert cost.tolist() == [Backbone.from_config(model.config).reference_bits] * 2
    BudgetMultiplier(beta=10.0).penalty(cost, sel.target_bits(targets)).backward()
    g = sel.head_bias.grad
    assert float(g[:, 0].min()) > 0  # descending lowers the 16-bit logit ...
    assert float(g[:, 1:4].max()) < 0  # ... and raises the cheaper precisions'
    assert sel.head_weight.grad is not None and float(sel.head_weight.grad.abs().sum()) > 0
    sel.zero_grad()
    logits = sel(ids, None, targets)
    weights = gumbel_straight_through(logits, 1.0, generator=torch.Generator().manual_seed(1))
    out = model(input_ids=ids, use_cache=False, kaizen_train=KaizenTrainForward(sel.space, weights)).logits
    out.logsumexp(-1).mean().backward()  # any task loss: its gradient reaches the selector through the weights
    assert float(sel.head_bias.grad.abs().sum()) > 0


# ----------------------------------------------------------------------------------------------------------------
# training, checkpoints, evaluation


def train_config(teacher_path, out, **kw):
    base = dict(model=teacher_path, out=str(out), targets=(4.0,), steps=6, batch_size=2, seq_len=SEQ,
                save_interval=3, warmup_steps=0, lr=1e-3, lr_new=0.2, beta=50.0, eta=0.0)
    return KaizenTrainConfig(**{**base, **kw})


def _log(out) -> list[dict]:
    return [json.loads(ln) for ln in (Path(out) / LOG_FILE).read_text().splitlines()]


@pytest.fixture(scope="module")
def trained(teacher_path, tmp_path_factory):
    out = tmp_path_factory.mktemp("kaizen") / "run"
    result = kaizen_train(train_config(teacher_path, out), progress=False)
    return out, result


def test_training_raises_the_realised_factor_toward_the_target(trained):
    out, result = trained
    log = _log(out)
    assert result["step"] == 6 and [ln["step"] for ln in log] == list(range(1, 7))
    assert log[0]["factor"] == 1.0 and log[0]["penalty"] > 0  # starts uncompressed, over budget
    assert log[-1]["factor"] >= 2.0  # the selector moved to cheaper actions
    assert log[0]["tau"] == 2.0 and log[-1]["tau"] < log[0]["tau"]
    for ln in log:
        for key in ("loss", "kd", "penalty", "beta", "bits", "factor", "target", "grad_norm"):
            assert ln[key] == ln[key] and abs(ln[key]) < float("inf"), (key, ln)
        assert ln["target"] == 4.0 and ln["beta"] == 50.0
    assert latest_checkpoint(out).name == "step-6" and (out / "final" / "trainer_state.pt").is_file()


def test_adaptive_multiplier_rises_while_over_budget(teacher_path, tmp_path):
    kaizen_train(train_config(teacher_path, tmp_path / "run", steps=3, beta=0.0, eta=1.0, lr_new=1e-6,
                             save_interval=10), progress=False)
    log = _log(tmp_path / "run")
    assert log[0]["beta"] == 0.0 and log[0]["penalty"] == 0.0
    assert log[1]["beta"] == pytest.approx(3.0)  # excess 4/1 - 1 = 3 at factor 1.0
    assert log[2]["beta"] > log[1]["beta"]


def test_backbone_cosine_schedule_decays_the_backbone_rate_only(teacher_path, tmp_path):
    """``lr_schedule="cosine"``: the backbone's rate of step s (fraction s/steps done before it) is the cosine
    ``lr * (r + (1 - r) * (1 + cos(pi * s / steps)) / 2)`` with r = min_lr_ratio, written out by hand (the logged rate
    is the one the step gives the backbone's parameter group); the default stays constant; a bad name is a one-line
    error."""
    import math

    steps, lr = 4, 1e-3
    kaizen_train(train_config(teacher_path, tmp_path / "cos", steps=steps, lr=lr, lr_schedule="cosine",
                              save_interval=10), progress=False)
    log = _log(tmp_path / "cos")
    want = [lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps))) for s in range(steps)]
    assert [ln["lr"] for ln in log] == pytest.approx(want, rel=1e-12)
    assert log[0]["lr"] == pytest.approx(lr) and log[-1]["lr"] < 0.25 * lr
    kaizen_train(train_config(teacher_path, tmp_path / "const", steps=2, lr=lr, save_interval=10), progress=False)
    assert [ln["lr"] for ln in _log(tmp_path / "const")] == [lr, lr]
    with pytest.raises(KVLearnError) as e:
        train_config(teacher_path, tmp_path / "x", lr_schedule="linear")
    msg = one_line(e)
    assert "'linear'" in msg and "constant, cosine" in msg


def test_family_weights_reach_the_training_stream(teacher_path, tmp_path, monkeypatch, capsys):
    """``family_weights`` (``--family-weights``): the run's stream is built with them (trace only here, and the
    stream's row builder then gives trace rows only), the resume check covers them, and bad weights are one line in
    the config and on the command line."""
    import kvlearn.train.kaizen_train as kt
    from kvlearn.cli import main
    from kvlearn.testbed.data import TestbedStream, batch_examples

    seen = []

    class Spy(TestbedStream):
        def __init__(self, *args, **kwargs):
            seen.append(kwargs.get("weights"))
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(kt, "TestbedStream", Spy)
    kaizen_train(train_config(teacher_path, tmp_path / "w", steps=1, save_interval=10, family_weights=(1, 0, 0, 0)),
                 progress=False)
    assert seen == [(1.0, 0.0, 0.0, 0.0)]
    rows = batch_examples(8, SEQ, 0, weights=seen[0], dense=0.0)  # what such a stream's batches hold
    assert {ex.family for ex in rows} == {"trace"}
    assert "family_weights" in kt.RESUME_FIELDS and kt.RESUME_DEFAULTS["family_weights"] is None
    for bad in ((1, 1, 1), (0, 0, 0, 0), (1, -1, 1, 1)):
        with pytest.raises(KVLearnError) as e:
            train_config(teacher_path, tmp_path / "x", family_weights=bad)
        assert "trace, niah, vt, recall" in one_line(e)
    capsys.readouterr()
    code = main(["kaizen-train", "--model", teacher_path, "--out", str(tmp_path / "c"), "--family-weights", "a,b",
                 "--steps", "1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and "--family-weights 'a,b'" in err


def test_budget_scope_reaches_the_training_step_and_the_command_line(teacher_path, tmp_path, monkeypatch):
    """``--budget-scope batch`` becomes the config's ``budget_scope``, every training step's penalty is built with it
    (a spy on ``budget_terms``), and a resume must keep it (a resume field, ``sequence`` for older checkpoints)."""
    import kvlearn.train.kaizen_train as kt

    scopes, configs = [], []
    real = kt.budget_terms
    monkeypatch.setattr(kt, "budget_terms", lambda *a: scopes.append(a[-1]) or real(*a))
    kaizen_train(train_config(teacher_path, tmp_path / "b", steps=2, save_interval=10, budget_scope="batch"),
                 progress=False)
    assert scopes == ["batch", "batch"]
    assert "budget_scope" in kt.RESUME_FIELDS and kt.RESUME_DEFAULTS["budget_scope"] == "sequence"
    monkeypatch.setattr(kt, "kaizen_train", lambda config: configs.append(config) or {"step": 0, "final": "f"})
    assert main(["kaizen-train", "--model", teacher_path, "--out", str(tmp_path / "c"), "--budget-scope", "batch",
                 "--steps", "1", "--seq-len", str(SEQ)]) == 0
    assert configs and configs[0].budget_scope == "batch"


def test_final_checkpoint_round_trips_with_identical_choices(trained):
    out, result = trained
    model = kvlearn.load(result["final"])
    sel = selector_of(model)
    assert model.config.kaizen["train_targets"] == [4.0]
    ids = ids_of(3, 40, seed=5, vocab=VOCAB_SIZE)
    # the trained student, rebuilt independently from its safetensors
    from safetensors.torch import load_file

    state = load_file(str(Path(result["final"]) / "model.safetensors"))
    ref = KaizenSelector(VOCAB_SIZE, Backbone.from_config(model.config), max_positions=8192)
    ref.load_state_dict({k[len("kaizen_selector."):]: v for k, v in state.items() if k.startswith("kaizen_selector.")})
    for target in (4.0, torch.tensor([2.0, 4.0, 6.0])):
        torch.testing.assert_close(sel(ids, None, target), ref(ids, None, target), atol=0, rtol=0)
    configs, logits = select(model, ids)
    assert [c.compression(metadata=False) for c in configs] == [sel.backbone.reference_bits / float(b)
                                                                 for b in sel.cost(torch.nn.functional.one_hot(
                                                                     logits.argmax(-1), sel.num_actions).float())]
    assert float(sel.head_bias.detach()[:, 0].max()) < 2.0  # trained away from its init


def test_eval_reports_factor_and_target(trained, tmp_path, capsys):
    out, result = trained
    dest = tmp_path / "k.json"
    assert main(["eval", "--method", "kaizen", "--model", result["final"], "--context", "256", "--n-per-task", "2",
                 "--tasks", "niah", "--batch-size", "2", "--out", str(dest)]) == 0
    (row,) = json.loads(dest.read_text())["rows"]
    model = kvlearn.load(result["final"])
    assert row["method"] == "kaizen" and row["target"] == 4.0 and row["n"] == 2
    from kvlearn.eval.accuracy import EvalConfig, examples_for
    from kvlearn.eval.protocols import layout

    config = EvalConfig(method="kaizen", context=256, tasks=("niah",), n_per_task=2)
    get_method("kaizen").prepare(model, config.method_config)
    factors = []
    for ex in examples_for(config, "niah"):
        batch = layout([ex], "bounded", 0, config.chunk_size)
        cache = make_prompt_cache(config.method_config, model, batch.ids, batch.mask, 8)
        factors.append(cache.config.compression(metadata=False))
    assert row["factor"] == pytest.approx(sum(factors) / 2) and row["factor"] > 1.0
    assert row["compression"] == pytest.approx(1 - 1 / row["factor"])


def test_resume_matches_uninterrupted(teacher_path, tmp_path):
    full = kaizen_train(train_config(teacher_path, tmp_path / "a", steps=4, save_interval=2), progress=False)
    kaizen_train(train_config(teacher_path, tmp_path / "b", steps=4, save_interval=2), stop_after=2, progress=False)
    resumed = kaizen_train(train_config(teacher_path, tmp_path / "b", steps=4, save_interval=2, resume=True),
                           progress=False)
    assert resumed["step"] == 4
    a, b = _log(tmp_path / "a"), _log(tmp_path / "b")
    assert [ln["step"] for ln in b] == [1, 2, 3, 4]
    for x, y in zip(a, b):
        assert x["factor"] == y["factor"] and x["kd"] == pytest.approx(y["kd"], rel=1e-5, abs=1e-6)
    from safetensors.torch import load_file

    sa = load_file(str(Path(full["final"]) / "model.safetensors"))
    sb = load_file(str(Path(resumed["final"]) / "model.safetensors"))
    for k in sa:
        torch.testing.assert_close(sa[k], sb[k], atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------------------------------------------
# bad input


def test_bad_input_is_one_line(teacher_path, tmp_path):
    bb = Backbone(num_layers=2, kv_heads=2, head_dim=16)
    with pytest.raises(KVLearnError) as e:
        check_budget(9.0, bb, ("precision",))
    assert "[1x, 8x]" in one_line(e)
    with pytest.raises(KVLearnError) as e:
        train_config(teacher_path, tmp_path / "x", targets=(100.0,))
    msg = one_line(e)
    assert "100.0" in msg and "[1x, 16x]" in msg
    with pytest.raises(KVLearnError) as e:
        train_config(teacher_path, tmp_path / "x", targets=(9.0,), axes=("precision",))
    assert "[1x, 8x]" in one_line(e)
    with pytest.raises(KVLearnError) as e:
        KaizenConfig.from_indices(bb, [0, 7])
    assert "0 .. 4" in one_line(e)
    with pytest.raises(KVLearnError) as e:
        train_config(teacher_path, tmp_path / "x", axes=("colour",))
    one_line(e)
    with pytest.raises(KVLearnError) as e:
        train_config(teacher_path, tmp_path / "x", targets=())
    one_line(e)
    with pytest.raises(KVLearnError) as e:
        method_config("kaizen", budget=64)
    assert "--target" in one_line(e)
    model = tiny(0)
    with pytest.raises(KVLearnError) as e:
        apply_kaizen(model, KaizenMethodConfig(target=50.0))
    assert "[1x, 32x]" in one_line(e)  # 4 layers: 16 bits / one 2-bit layer
    with pytest.raises(KVLearnError) as e:
        selector_of(tiny(0))
    one_line(e)


def test_cli_one_line_errors(teacher_path, tmp_path, capsys):
    def run(*args):
        code = main(list(args))
        err = capsys.readouterr().err.strip()
        return code, err

    code, err = run("kaizen-train", "--model", teacher_path, "--out", str(tmp_path / "o"), "--target", "100",
                    "--seq-len", "128", "--steps", "1")
    assert code == 2 and "\n" not in err and "feasible range" in err
    code, err = run("kaizen-train", "--model", teacher_path, "--out", str(tmp_path / "o"), "--target", "four")
    assert code == 2 and "\n" not in err and "--target" in err
    code, err = run("kaizen-train", "--model", teacher_path, "--out", str(tmp_path / "o"), "--share-threshold", "0.1")
    assert code == 2 and "\n" not in err and err.endswith(
        "--share-threshold 0.1 is read only by the sensitivity pass: expected --share-layers auto with it (got "
        "--share-layers all)"), err
    code, err = run("kaizen-train", "--model", teacher_path, "--out", str(tmp_path / "o"), "--share-rows", "64")
    assert code == 2 and "\n" not in err and err.endswith(
        "--share-rows 64 is read only by the sensitivity pass: expected --share-layers auto with it (got "
        "--share-layers all)"), err
    code, err = run("kaizen-train", "--model", teacher_path, "--out", str(tmp_path / "o"), "--select-n", "8",
                    "--select-from", "0.9")  # ignored without --select-every: refused, not run without them
    assert code == 2 and "\n" not in err and err.endswith(
        "--select-n 8, --select-from 0.9: options of checkpoint selection, read only with --select-every N (N >= 1): "
        "give it, or leave them out"), err
    code, err = run("eval", "--method", "kaizen", "--model", teacher_path, "--budget", "64", "--context", "256")
    assert code == 2 and "\n" not in err and "--target" in err
    code, err = run("eval", "--method", "streaming", "--model", teacher_path, "--budget", "64", "--context", "256",
                    "--target", "4")
    assert code == 2 and "\n" not in err and "token budget" in err


# ----------------------------------------------------------------------------------------------------------------
# the baselines kaizen_static and kaizen_random


def test_static_config_by_hand():
    from kvlearn.kaizen.fixed import static_config

    bb = Backbone(num_layers=4, kv_heads=2, head_dim=16)
    assert static_config(bb, 4.0) == KaizenConfig.static(bb, 4)  # ties (b8 g2, b16 g4) go to less sharing
    assert static_config(bb, 2.0) == KaizenConfig.static(bb, 8)
    assert static_config(bb, 5.0) == KaizenConfig.static(bb, 2)  # 8x: the least compressed uniform choice >= 5
    assert static_config(bb, 9.0) == KaizenConfig.evenly_shared(bb, 2, 2)  # 16x
    assert static_config(bb, 1.5) == KaizenConfig.static(bb, 8)
    assert static_config(bb, 3.0, axes=("depth",)) == KaizenConfig.evenly_shared(bb, 4, 16)  # 4x
    with pytest.raises(KVLearnError) as e:
        static_config(bb, 9.0, axes=("precision",))
    assert "[1x, 8x]" in one_line(e)


@pytest.mark.parametrize("name", ["kaizen_static", "kaizen_random"])
def test_baselines_through_the_harness(teacher_path, name):
    from kvlearn.eval.accuracy import EvalConfig, evaluate

    model = kvlearn.load(teacher_path)
    config = EvalConfig(method=name, context=256, tasks=("vt",), n_per_task=2, batch_size=2, target=4.0)
    (row,) = evaluate(model, config, progress=False)
    assert row["method"] == name and row["target"] == 4.0 and row["n"] == 2
    assert 4.0 <= row["factor"] < 4.0 * 1.35
    if name == "kaizen_static":  # 2 layers at 4 bits: a quarter of the dense cache's codes, plus the scales
        assert row["factor"] == 4.0


def test_static_with_a_given_configuration(make_teacher, tmp_path, capsys):
    """``kvlearn eval --method kaizen_static --configuration 'b4 share b2'`` serves exactly that configuration (the
    one a KVpop student was retrofitted under, say) for every prompt: the row records it, its realised factor is the
    cost model's by hand (3 layers x 16 bits over 4 + 0 + 2 = 8x) and the target defaults to it; a uniform
    configuration given so is the static choice at its factor; a target above the configuration's compression, a bad
    word, layer 0 sharing, another layer count and the field on another method are one-line errors."""
    from kvlearn.kaizen import static_method
    from kvlearn.kaizen.fixed import static_config
    from kvlearn.kaizen.static_method import StaticConfig
    from kvlearn.methods import make_config

    path = make_teacher(3, 1)
    rows = tmp_path / "rows.json"
    args = ["eval", "--method", "kaizen_static", "--model", path, "--context", "256", "--tasks", "vt",
            "--n-per-task", "2", "--batch-size", "2", "--device", "cpu"]
    assert main([*args, "--configuration", "b4 share b2", "--out", str(rows)]) == 0
    (row,) = json.loads(rows.read_text())["rows"]
    assert row["configurations"] == {"b4 share b2": 2}
    assert row["factor"] == pytest.approx(16 * 3 / (4 + 2)) and row["target"] == pytest.approx(8.0)
    assert main([*args, "--configuration", "b4 share b2", "--target", "6", "--out", str(rows)]) == 0
    (row,) = json.loads(rows.read_text())["rows"]
    assert row["target"] == 6.0 and row["factor"] == pytest.approx(8.0)
    bb = Backbone(num_layers=3, kv_heads=2, head_dim=16)
    assert static_method.configuration(bb, StaticConfig(target=None, configuration="b4 b4 b4")) == static_config(bb, 4.0)
    capsys.readouterr()
    for extra, expect in ((["--configuration", "b4 share b2", "--target", "10"], "compresses 8x, below target=10"),
                          (["--configuration", "b4 b5x b2"], "'b5x' is invalid"),
                          (["--configuration", "share b4 b4"], "layer 0 cannot share"),
                          (["--configuration", "b4 b4"], "2 actions given for a backbone of 3 layers"),
                          (["--configuration", "b4 b4 b4", "--method", "kaizen_random"], "is for --method kaizen_static")):
        code = main([*args, *extra])
        err = capsys.readouterr().err  # progress bars (loading the weights), then one error line
        lines = [ln for ln in err.splitlines() if "kvlearn: error:" in ln]
        assert code == 2 and len(lines) == 1 and expect in lines[0] and "Traceback" not in err, err
    for build, expect in ((lambda: StaticConfig(target=None), "target=None is invalid without a configuration"),
                          (lambda: StaticConfig(configuration="  "), "configuration='  ' is invalid"),
                          (lambda: make_config("kaizen_dp", target=4.0, configuration="b4 b4 b4"),
                           "unexpected keyword argument 'configuration'"),
                          (lambda: make_config("kaizen_random", target=4.0, configuration="b4 b4 b4"),
                           "unexpected keyword argument 'configuration'")):
        with pytest.raises(KVLearnError) as e:
            build()
        assert expect in one_line(e)


def test_static_prompt_cache_of_a_configuration_without_a_target(make_teacher):
    """``kaizen_static``'s ``make_prompt_cache`` (the Python route, as the README builds a composed cache) with only a
    configuration: the cache records the configuration's own factor (3 layers x 16 bits over 4 + 0 + 2 = 8x by hand),
    as the harness's ``make_choice_cache`` does, and a prompt plus a decode step through it gives the logits of one
    made by ``make_choice_cache`` (it raised a TypeError from deep inside before session 57)."""
    from kvlearn.kaizen.prompt import prompt_capacity

    model = kvlearn.load(make_teacher(3, 1)).eval()
    method = get_method("kaizen_static")
    config = method_config("kaizen_static", configuration="b4 share b2", context=256)
    assert config.target is None
    method.apply(model, config)
    ids = torch.randint(3, VOCAB_SIZE, (2, 65), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids[:, :64])
    by_prompt = method.make_prompt_cache(config, model, ids[:, :64], mask, 4)
    (choice,) = set(method.prompt_choices(config, model, ids[:, :64], mask))
    by_choice = method.make_choice_cache(config, model, choice, prompt_capacity(64, 4))
    assert by_prompt.target == by_choice.target == pytest.approx(8.0)
    logits = []
    with torch.no_grad():
        for cache in (by_prompt, by_choice):
            model(input_ids=ids[:, :64], attention_mask=mask, past_key_values=cache, use_cache=True)
            out = model(input_ids=ids[:, 64:], attention_mask=torch.ones_like(ids), past_key_values=cache,
                        use_cache=True)
            logits.append(out.logits)
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)


def test_cli_run_with_several_targets_then_eval(teacher_path, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["kaizen-train", "--model", teacher_path, "--out", str(out), "--target", "2,8", "--steps", "3",
                 "--seq-len", str(SEQ), "--batch-size", "4", "--save-interval", "2", "--warmup-steps", "0",
                 "--lr-new", "0.05", "--beta", "5", "--device", "cpu"])
    printed = capsys.readouterr().out
    assert code == 0 and "--method kaizen --target 2.0" in printed
    log = _log(out)
    assert {ln["target"] for ln in log} <= {2.0, 3.5, 5.0, 6.5, 8.0}  # per-step mean of 4 draws from {2, 8}
    from kvlearn.train.kaizen_train import sample_targets

    draws = sample_targets(train_config(teacher_path, tmp_path / "x", targets=(2.0, 8.0)), 64,
                           torch.Generator().manual_seed(0))
    assert set(draws.tolist()) == {2.0, 8.0}
    model = kvlearn.load(out / "final")
    assert model.config.kaizen["train_targets"] == [2.0, 8.0]
    sel = selector_of(model)
    assert float(sel.film.weight.detach().abs().sum()) > 0  # the budget conditioning was trained
    for target in ("2", "8"):
        dest = tmp_path / f"k{target}.json"
        assert main(["eval", "--method", "kaizen", "--model", str(out / "final"), "--context", "256",
                     "--n-per-task", "1", "--tasks", "vt", "--target", target, "--out", str(dest)]) == 0
        (row,) = json.loads(dest.read_text())["rows"]
        assert row["target"] == float(target) and row["factor"] >= 1.0


def test_training_selector_reads_the_prompt_only():
    """On an evaluation-format row (prompt, then its supervised answer), the selector's training input (answers
    masked out, as kaizen_train gives it) has the logits of the prompt alone, whatever the answer tokens are."""
    from kvlearn.train.kaizen_train import step_losses

    model = tiny(0)
    sel = apply_kaizen(model, KaizenMethodConfig(target=4.0)) and selector_of(model)
    torch.manual_seed(1)
    with torch.no_grad():  # away from the init, so the logits depend on the input
        for p in sel.parameters():
            p.normal_(0.0, 0.3)
    row = ids_of(batch=1, length=40, seed=5)
    labels = torch.full_like(row, -100)
    labels[:, 30:] = row[:, 30:]  # the last 10 tokens are the answer
    prompt_logits = sel(row[:, :30], None, 4.0)
    torch.testing.assert_close(sel(row, labels == -100, 4.0), prompt_logits, rtol=1e-5, atol=1e-5)
    other = row.clone()
    other[:, 30:] = (other[:, 30:] + 1) % VOCAB  # other answer tokens: the same logits
    torch.testing.assert_close(sel(other, labels == -100, 4.0), prompt_logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(sel(row, None, 4.0), prompt_logits)  # reading the answer would change them
    # and the trainer's step gives its selector exactly that input
    teacher_logits = torch.randn(1, 40, model.config.vocab_size)
    out = step_losses(model, teacher_logits, other, labels, torch.tensor([4.0]), 1.0, BudgetMultiplier(), 8)
    torch.testing.assert_close(out["logits"], prompt_logits, rtol=1e-5, atol=1e-5)


def penalty_batch(model, sel):
    """Two rows of 24 tokens whose last 4 are supervised, random teacher logits, a constant multiplier (5.0) and
    the selector's per-action costs: the inputs of the penalty tests below."""
    row = ids_of(batch=2, length=24, seed=4)
    labels = torch.full_like(row, -100)
    labels[:, 20:] = row[:, 20:]
    teacher_logits = torch.randn(2, 24, model.config.vocab_size)
    return row, labels, teacher_logits, BudgetMultiplier(eta=0.0, beta=5.0), torch.tensor([float(c) for c in sel.costs])


def test_expected_penalty_cost_is_the_softmax_mean_and_noise_free():
    """``penalty_cost="expected"``: the penalty reads ``Σ softmax(logits) c`` (by hand, from the action costs), the
    same for any Gumbel draw, and its gradient on the logits is that hand expression's; the sampled cost is the
    draw's one-hot cost. A row whose expected cost is within budget is not penalised, though a draw may lie over
    it (the hinge on samples would push it)."""
    from kvlearn.train.kaizen_train import KaizenTrainConfig, penalised_cost, step_losses

    model = tiny(0)
    sel = apply_kaizen(model, KaizenMethodConfig(target=4.0)) and selector_of(model)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in sel.parameters():
            p.normal_(0.0, 0.3)
    row, labels, teacher_logits, beta, costs = penalty_batch(model, sel)
    logits = sel(row, labels == -100, 4.0)
    by_hand = (torch.softmax(logits, -1) * costs).sum((-1, -2))  # [2] bits per token
    pens = []
    for seed in (0, 1):
        u = torch.rand(logits.shape, generator=torch.Generator().manual_seed(seed))
        out = step_losses(model, teacher_logits, row, labels, torch.tensor([4.0, 4.0]), 1.0, beta, 8, uniforms=u,
                          penalty_cost="expected")
        hard = torch.nn.functional.one_hot((out["logits"] - torch.log(-torch.log(u))).argmax(-1), logits.shape[-1])
        torch.testing.assert_close(out["sampled_bits"], (hard * costs).sum((-1, -2)).float())
        pens.append(out["penalty"])
    target_bits = sel.target_bits(torch.tensor([4.0, 4.0]))
    torch.testing.assert_close(pens[0], 5.0 * torch.relu(by_hand / target_bits - 1).mean(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pens[0], pens[1])
    # "sampled": the penalty reads the draw's one-hot cost instead
    u = torch.rand(logits.shape, generator=torch.Generator().manual_seed(0))
    sampled = step_losses(model, teacher_logits, row, labels, torch.tensor([4.0, 4.0]), 1.0, beta, 8, uniforms=u,
                          penalty_cost="sampled")
    torch.testing.assert_close(sampled["penalty"], 5.0 * torch.relu(sampled["sampled_bits"] / target_bits - 1).mean(),
                               rtol=1e-5, atol=1e-6)
    # gradient on the logits: autograd of the hand expression
    leaf = logits.detach().requires_grad_(True)
    weights = torch.zeros_like(leaf)
    penalised_cost(sel, leaf, weights, "expected").sum().backward()
    expected_grad = torch.autograd.grad((torch.softmax(leaf, -1) * costs).sum(), leaf)[0]
    torch.testing.assert_close(leaf.grad, expected_grad)
    # within budget in expectation: no penalty, whatever the draw
    generous = step_losses(model, teacher_logits, row, labels, torch.tensor([1.0, 1.0]), 1.0, beta, 8,
                           generator=torch.Generator().manual_seed(0), penalty_cost="expected")
    assert float(generous["penalty"].detach()) == 0.0
    with pytest.raises(ValueError, match="penalty_cost=.mean. is invalid: expected one of expected, sampled"):
        penalised_cost(sel, logits, weights, "mean")
    with pytest.raises(ValueError, match="penalty_cost='mean' is invalid"):
        KaizenTrainConfig(model="unused", penalty_cost="mean")


def test_underuse_penalty_pushes_a_cheaper_than_target_choice_back_up():
    """``underuse_weight`` w: the penalty gains ``w · mean relu(1 - Ĉ / C*)`` (by hand from the expected cost), so a
    row compressed past its target (here every layer at 2 bits, 8x, asked for 1x) is charged and the gradient
    lowers the cheap actions' logits; w = 0 leaves the penalty as before (none under budget); a negative w is a
    one-line error."""
    from kvlearn.train.kaizen_train import KaizenTrainConfig, step_losses, underuse_penalty

    model = tiny(0)
    sel = apply_kaizen(model, KaizenMethodConfig(target=1.0)) and selector_of(model)
    names = [str(a) for a in sel.space]
    with torch.no_grad():
        sel.head_bias.zero_()
        sel.head_bias[:, names.index("b2")] = 8.0  # every layer prefers 2 bits: 8x
    row, labels, teacher_logits, beta, costs = penalty_batch(model, sel)
    targets = torch.tensor([1.0, 1.0])
    by_hand = (torch.softmax(sel(row, labels == -100, targets), -1) * costs).sum((-1, -2)).detach()
    target_bits = sel.target_bits(targets)
    assert float(by_hand.max()) < float(target_bits.min()) / 7  # about 8x cheaper than asked
    plain = step_losses(model, teacher_logits, row, labels, targets, 1.0, beta, 8,
                        generator=torch.Generator().manual_seed(0))
    assert float(plain["penalty"].detach()) == 0.0  # under budget: the cap-only penalty is silent
    out = step_losses(model, teacher_logits, row, labels, targets, 1.0, beta, 8,
                      generator=torch.Generator().manual_seed(0), underuse_weight=2.0)
    torch.testing.assert_close(out["penalty"], 2.0 * torch.relu(1 - by_hand / target_bits).mean(), rtol=1e-5, atol=1e-6)
    sel.zero_grad()
    out["penalty"].backward()
    g = sel.head_bias.grad
    assert float(g[:, names.index("b2")].min()) > 0 and float(g[:, names.index("b16")].max()) < 0
    zero = underuse_penalty(by_hand, target_bits, 0.0)
    assert float(zero) == 0.0 and not zero.requires_grad
    with pytest.raises(ValueError, match="underuse_weight"):
        KaizenTrainConfig(model="unused", underuse_weight=-1.0)


def test_batch_budget_scope_holds_the_mean_ratio_where_sequence_scope_holds_each_row():
    """``budget_terms`` by hand: two rows at 1.5 and 0.5 times their targets (costs 24 and 4 bits per token against
    16 and 8). Sequence scope: ``β mean relu(r - 1) = β · 0.25`` and the under-use term
    ``w · 0.25``; batch scope: the mean ratio is 1.0, so both hinges are 0, and the gradient is 0 too. A batch over
    budget on average (costs 24 and 12: mean ratio 1.5) is charged ``β · 0.5`` and pushes both rows down by the same
    ``β / (2 C*_i)``, the cheap row included. An unknown scope is a one-line error (function and config)."""
    from kvlearn.kaizen.budget import BudgetMultiplier
    from kvlearn.train.kaizen_train import KaizenTrainConfig, budget_terms

    beta, w = BudgetMultiplier(beta=4.0), 2.0
    target = torch.tensor([16.0, 8.0])
    cost = torch.tensor([24.0, 4.0], requires_grad=True)  # ratios 1.5 and 0.5
    seq = budget_terms(cost, target, beta, w, "sequence")
    torch.testing.assert_close(seq, torch.tensor(4.0 * 0.25 + 2.0 * 0.25))
    batch = budget_terms(cost, target, beta, w, "batch")
    assert float(batch) == 0.0
    batch.backward()
    assert float(cost.grad.abs().max()) == 0.0
    over = torch.tensor([24.0, 12.0], requires_grad=True)  # ratios 1.5 and 1.5
    charged = budget_terms(over, target, beta, w, "batch")
    torch.testing.assert_close(charged, torch.tensor(4.0 * 0.5))
    charged.backward()
    torch.testing.assert_close(over.grad, 4.0 / (2 * target))
    with pytest.raises(KVLearnError, match="scope='row' is invalid"):
        budget_terms(cost, target, beta, w, "row")
    with pytest.raises(ValueError, match="budget_scope='row' is invalid: expected one of sequence, batch"):
        KaizenTrainConfig(model="unused", budget_scope="row")


def test_direct_target_term_gets_a_gradient_where_film_gets_none():
    """At init (head weights and FiLM zero) the FiLM layer's gradient is exactly zero, so the target cannot reach the
    logits until the head weights grow; the direct target term ``T log2(t)`` gets ``log2(t)`` times the logits'
    gradient from the first step (by hand), and changes nothing at init (zero) or at target 1 (log2 1 = 0)."""
    model = tiny(0)
    backbone = Backbone.from_config(model.config)
    torch.manual_seed(0)
    plain = KaizenSelector(VOCAB, backbone)
    torch.manual_seed(0)
    sel = KaizenSelector(VOCAB, backbone, target_head=True)
    assert plain.target_weight is None and tuple(sel.target_weight.shape) == (backbone.num_layers, len(sel.space))
    ids = ids_of(2)
    targets = torch.tensor([1.0, 4.0])
    torch.testing.assert_close(sel(ids, None, targets), plain(ids, None, targets))  # zero at init
    upstream = torch.randn(2, backbone.num_layers, len(sel.space))
    for s in (plain, sel):
        logits = s(ids, None, targets)
        (logits.masked_fill(~s.mask, 0.0) * upstream).sum().backward()
    assert float(plain.film.weight.grad.abs().max()) == 0.0 and float(plain.film.bias.grad.abs().max()) == 0.0
    expected = sel.target_gain * (torch.log2(targets)[:, None, None] * upstream).sum(0) * sel.mask
    assert sel.target_gain == 64.0  # the width
    torch.testing.assert_close(sel.target_weight.grad, expected)
    with torch.no_grad():
        sel.target_weight.normal_()
    at_one = sel(ids, None, torch.tensor([1.0, 1.0]))
    torch.testing.assert_close(at_one, plain(ids, None, torch.tensor([1.0, 1.0])))


def test_target_head_round_trips_and_old_records_load_without_it(teacher_path, tmp_path):
    """kaizen-train with several targets builds the direct target term (recorded ``target_head``) and ``kvlearn.load``
    restores it bit-exactly; a record written before the field existed loads as ``target_head=False``."""
    import json as _json

    result = kaizen_train(train_config(teacher_path, tmp_path / "run", targets=(1.0, 4.0), steps=2, save_interval=10),
                          progress=False)
    model = kvlearn.load(result["final"])
    sel = selector_of(model)
    assert model.config.kaizen["target_head"] is True and sel.target_weight is not None
    from safetensors.torch import load_file

    state = load_file(str(Path(result["final"]) / "model.safetensors"))
    torch.testing.assert_close(sel.target_weight.detach(), state["kaizen_selector.target_weight"], atol=0, rtol=0)
    single = kaizen_train(train_config(teacher_path, tmp_path / "one", steps=1, save_interval=10), progress=False)
    cfg_path = Path(single["final"]) / "config.json"
    cfg = _json.loads(cfg_path.read_text())
    assert cfg["kaizen"].pop("target_head") is False
    cfg_path.write_text(_json.dumps(cfg))
    assert selector_of(kvlearn.load(single["final"])).target_weight is None


def test_a_run_from_before_the_share_fields_resumes(teacher_path, tmp_path):
    """A checkpoint written before ``share_rows`` / ``share_seed`` existed (its state records neither) resumes when
    the run does not use the sensitivity pass, although the fields' defaults changed (16 rows of the run's seed
    then, 64 of seed 0 now): only ``--share-layers auto`` reads them."""
    from kvlearn.train.distill import STATE_FILE

    out = tmp_path / "old"
    kaizen_train(train_config(teacher_path, out, steps=4, save_interval=2), stop_after=2, progress=False)
    state_path = out / "step-2" / STATE_FILE
    state = torch.load(state_path, weights_only=False)
    assert state["config"]["share_rows"] == 64 and state["config"]["share_seed"] == 0
    del state["config"]["share_rows"], state["config"]["share_seed"]
    torch.save(state, state_path)
    resumed = kaizen_train(train_config(teacher_path, out, steps=4, save_interval=2, resume=True), progress=False)
    assert resumed["step"] == 4
