"""apply_kvpop on tiny random GQA models of every supported family (float32, 2 layers, 2 KV heads, 4 query heads,
head_dim 16): generate through the KVpop cache built from the model's own modules, memory at the budget, decoding
logits == the masked full-sequence forward (rule 4), the save_pretrained -> load round trip, the method registry
entry, and one-line errors for bad input."""

import dataclasses
import json

import pytest
import torch
from test_kvpop_cache import decode_logits, reference_logits
from transformers import (
    DynamicCache,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

import kvlearn
from kvlearn import KVLearnError, KVpopConfig
from kvlearn.eval.accuracy import cache_bytes
from kvlearn.kvpop.apply import (
    KVpopModules,
    apply_kvpop,
    has_kvpop,
    kvpop_modules,
    load_kvpop,
    make_kvpop_cache,
)
from kvlearn.kvpop.cache import KVpopCache
from kvlearn.kvpop.scorers import LinearScorer, MLPScorer, MLSTMScorer
from kvlearn.methods import get_method, make_config

FAMILIES = {
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 16}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "llama": (LlamaConfig, LlamaForCausalLM, {"head_dim": 16}),
    "mistral": (MistralConfig, MistralForCausalLM, {"head_dim": 16, "sliding_window": None}),
}
VOCAB = 71
KV = dict(sinks=2, window=3, topk=4, decay_min=0.6, decay_max=0.95)  # budget 9; sequences of 40 tokens


def tiny(kind="qwen3", seed=0, layers=2, kv_heads=2):
    config_cls, model_cls, extra = FAMILIES[kind]
    torch.manual_seed(seed)
    cfg = config_cls(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                     num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=256,
                     pad_token_id=0, bos_token_id=None, eos_token_id=None, **extra)
    return model_cls(cfg).eval()


def kvpop_model(kind="qwen3", scorer="mlp", seed=0, **kv):
    """A tiny model with KVpop applied and non-trivial scorers/decays (random weights: rankings differ per head)."""
    model = tiny(kind, seed)
    config = KVpopConfig(**{**KV, **kv}, scorer=scorer)
    apply_kvpop(model, config)
    torch.manual_seed(seed + 1)
    scorers, decays = kvpop_modules(model)
    for sc in scorers:
        for prm in sc.parameters():
            torch.nn.init.normal_(prm, std=0.5 if scorer == "mlstm" else 1.0)
    for dc in decays:
        torch.nn.init.normal_(dc.alpha, std=1.0)
    return model, config


def one_line(err) -> str:
    message = str(err.value)
    assert "\n" not in message and message
    return message


# ----------------------------------------------------------------------------------------------------------------
# apply


def test_apply_registers_float32_modules_and_records_the_config():
    model, config = kvpop_model(scorer="mlstm")
    for layer in model.model.layers:
        assert isinstance(layer.self_attn.kvpop, KVpopModules)
        assert isinstance(layer.self_attn.kvpop.scorer, MLSTMScorer)
        assert layer.self_attn.kvpop.scorer.readout_delay == config.window
    names = [n for n, _ in model.named_parameters() if ".kvpop." in n]
    assert "model.layers.0.self_attn.kvpop.decay.alpha" in names and "model.layers.1.self_attn.kvpop.scorer.w_q" in names
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if ".kvpop." in n)
    assert model.config.kvpop["scorer"] == "mlstm" and KVpopConfig(**model.config.kvpop) == config
    assert model.config._attn_implementation == "kvlearn"
    scorers, decays = kvpop_modules(model)
    assert len(scorers) == len(decays) == 2 and scorers[1] is model.model.layers[1].self_attn.kvpop.scorer
    # the scorer classes and options follow the config
    for scorer, cls in (("linear", LinearScorer), ("mlp", MLPScorer)):
        assert isinstance(kvpop_modules(kvpop_model(scorer=scorer)[0])[0][0], cls)
    immediate = kvpop_model(scorer="mlstm", delayed_readout=False)[0]
    assert kvpop_modules(immediate)[0][0].readout_delay == 0


def test_apply_again_keeps_the_learned_modules_and_only_changes_the_budget():
    model, config = kvpop_model(scorer="mlp")
    before = {n: p.clone() for n, p in model.named_parameters() if ".kvpop." in n}
    wider = KVpopConfig(**{**KV, "topk": 20}, scorer="mlp")
    apply_kvpop(model, wider)
    after = {n: p for n, p in model.named_parameters() if ".kvpop." in n}
    assert before.keys() == after.keys() and all(torch.equal(before[n], after[n]) for n in before)
    assert model.config.kvpop["topk"] == 20
    assert make_kvpop_cache(model).config == wider
    with pytest.raises(KVLearnError, match="scorer='linear' but the model's KVpop modules were built with scorer='mlp'") as err:
        apply_kvpop(model, KVpopConfig(**KV, scorer="linear"))
    one_line(err)
    with pytest.raises(KVLearnError, match="decay_min") as err:
        make_kvpop_cache(model, KVpopConfig(**{**KV, "decay_min": 0.5}, scorer="mlp"))
    one_line(err)
    apply_kvpop(model, KVpopConfig(**KV, scorer="mlp", delayed_readout=False))  # no readout for a stateless scorer
    mlstm, _ = kvpop_model(scorer="mlstm")
    with pytest.raises(KVLearnError, match="delayed_readout=False but") as err:
        apply_kvpop(mlstm, KVpopConfig(**KV, scorer="mlstm", delayed_readout=False))
    one_line(err)
    with pytest.raises(KVLearnError, match="use window=3") as err:
        make_kvpop_cache(mlstm, KVpopConfig(**{**KV, "window": 5}, scorer="mlstm"))
    one_line(err)


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_decode_through_the_applied_model_equals_the_training_mask(kind):
    """Rule 4 through apply_kvpop: prefill + token-by-token logits through make_kvpop_cache(model) == the full
    forward under each layer's retention mask from the same modules, for sequences 4x the budget."""
    model, config = kvpop_model(kind, scorer="mlp", seed=3)
    scorers, decays = kvpop_modules(model)
    ids = torch.randint(1, VOCAB, (2, 40))
    ref = reference_logits(model, scorers, decays, config, ids)
    assert model.config._attn_implementation == "kvlearn"  # the reference restores the kvlearn attention
    cache = make_kvpop_cache(model)
    got = decode_logits(model, cache, ids, prefill=12)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    layer = cache.layers[0]
    assert layer.keys.shape[2] == config.budget and bool(((layer.slot_positions >= 0).sum(-1) == config.budget).all())


@pytest.mark.parametrize("kind", list(FAMILIES))
@pytest.mark.parametrize("scorer", ["mlp", "mlstm"])
def test_generate_runs_at_the_budget(kind, scorer):
    """generate through the KVpop cache; allocated bytes <= budget / tokens x dense bytes x 1.1 + the scorer state."""
    model, config = kvpop_model(kind, scorer=scorer, seed=5)
    ids = torch.randint(1, VOCAB, (2, 36))
    cache = make_kvpop_cache(model)
    with torch.no_grad():
        out = model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=8, do_sample=False, pad_token_id=0)
        dense = DynamicCache(config=model.config)
        model.generate(input_ids=ids, past_key_values=dense, max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 44)
    tokens = dense.get_seq_length()
    assert cache.get_seq_length() == tokens == 43
    state = sum(layer.allocated_state_bytes() for layer in cache.layers)
    assert (state > 0) == (scorer == "mlstm")
    bound = config.budget / tokens * cache_bytes(dense) * 1.1 + state
    assert cache.allocated_bytes() <= bound, (cache.allocated_bytes(), state, bound)  # allocated_bytes counts the state


# ----------------------------------------------------------------------------------------------------------------
# save_pretrained -> load


@pytest.mark.parametrize("scorer", ["mlp", "mlstm"])
def test_save_pretrained_and_load_give_identical_logits(scorer, tmp_path):
    model, config = kvpop_model(scorer=scorer, seed=7)
    ids = torch.randint(1, VOCAB, (2, 30))
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    before = decode_logits(model, make_kvpop_cache(model), ids, prefill=10)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["kvpop"]["scorer"] == scorer
    loaded = kvlearn.load(tmp_path)
    assert has_kvpop(loaded) and KVpopConfig(**loaded.config.kvpop) == config
    want = {k: v for k, v in model.state_dict().items() if ".kvpop." in k}
    got = {k: v for k, v in loaded.state_dict().items() if ".kvpop." in k}
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, plain, atol=0, rtol=0)
    after = decode_logits(loaded, make_kvpop_cache(loaded), ids, prefill=10)
    torch.testing.assert_close(after, before, atol=0, rtol=0)
    # kvlearn.load_model is the same entry point
    again = kvlearn.load_model(tmp_path)
    assert has_kvpop(again)


def test_a_kvpop_checkpoint_on_a_mismatched_base_is_one_line(tmp_path):
    model, _ = kvpop_model(scorer="mlp")
    model.save_pretrained(tmp_path)
    for other in (tiny(layers=3), tiny(kv_heads=1)):
        with pytest.raises(KVLearnError, match="was trained on a base with") as err:
            load_kvpop(other, tmp_path)
        assert str(tmp_path) in one_line(err)
        assert not has_kvpop(other)
    base = tiny()
    base.save_pretrained(tmp_path / "base")
    with pytest.raises(KVLearnError, match="has no KVpop config") as err:
        load_kvpop(tiny(), tmp_path / "base")
    one_line(err)
    assert not has_kvpop(kvlearn.load(tmp_path / "base"))  # a plain checkpoint loads plain


# ----------------------------------------------------------------------------------------------------------------
# bad input


def test_bad_input_is_one_line():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64))
    with pytest.raises(KVLearnError, match="model type 'gpt2' is not supported") as err:
        apply_kvpop(gpt2, KVpopConfig(**KV, scorer="mlp"))
    one_line(err)
    with pytest.raises(KVLearnError, match=r"budget=9 .* expected budget < context = 9") as err:
        KVpopConfig(**KV, context=9)
    one_line(err)
    assert KVpopConfig(**KV, context=10).context == 10
    with pytest.raises(KVLearnError, match="expected a kvlearn.KVpopConfig") as err:
        apply_kvpop(tiny(), {"scorer": "mlp"})
    one_line(err)
    with pytest.raises(KVLearnError, match="has no KVpop modules|has no KVpop config") as err:
        make_kvpop_cache(tiny())
    one_line(err)


def test_a_cache_reused_across_models_is_one_line():
    a, _ = kvpop_model(scorer="mlp", seed=1)
    ids = torch.randint(1, VOCAB, (1, 12))
    cache = make_kvpop_cache(a)
    with torch.no_grad():
        a(input_ids=ids, past_key_values=cache, use_cache=True)
    same_shape, _ = kvpop_model(scorer="mlp", seed=2)
    fewer_heads = apply_kvpop(tiny(kv_heads=1), KVpopConfig(**KV, scorer="mlp"))
    deeper = apply_kvpop(tiny(layers=3), KVpopConfig(**KV, scorer="mlp"))
    for other, needle in ((same_shape, "another model's scorers"), (fewer_heads, "another model's scorers"),
                          (deeper, "3 decoder layers but this cache has 2")):
        for c in (cache, make_kvpop_cache(a)):  # used, and fresh
            with pytest.raises(KVLearnError, match=needle) as err, torch.no_grad():
                other(input_ids=ids, past_key_values=c, use_cache=True)
            one_line(err)
    # a cache of standalone modules (no KVpop on the model) on a model of other shapes: the shape check
    standalone = KVpopCache(KVpopConfig(**KV, scorer="mlp"), *kvpop_modules(a))
    with torch.no_grad():
        a(input_ids=ids, past_key_values=standalone, use_cache=True)
        plain = kvlearn.attach(tiny(kv_heads=1))
        with pytest.raises(KVLearnError, match="do not match this cache's") as err:
            plain(input_ids=ids[:, :1], past_key_values=standalone, use_cache=True)
    one_line(err)


# ----------------------------------------------------------------------------------------------------------------
# the method registry


def test_registry_entry():
    method = get_method("kvpop")
    assert method.protocols == ("bounded", "context") and method.apply is not None
    config = make_config("kvpop", budget=48, sinks=4, context=256)
    assert (config.sinks, config.window, config.topk, config.scorer, config.context) == (4, 32, 12, "mlp", 256)
    assert make_config("kvpop", budget=20, sinks=2, window=8, scorer="linear").topk == 10
    model = tiny()
    method.prepare(model, config)
    assert has_kvpop(model)
    cache = method.new_cache(model, config)
    assert isinstance(cache, KVpopCache) and cache.config == config
    mlstm = make_config("kvpop", budget=48, sinks=4, scorer="mlstm")  # the harness takes the stateful scorer
    assert (mlstm.scorer, mlstm.window, mlstm.topk, mlstm.delayed_readout) == ("mlstm", 32, 12, True)
    for kwargs, needle in ((dict(budget=30), "budget=30 is invalid"),
                           (dict(budget=300, context=256), "budget < context = 256"),
                           (dict(budget=48, topk=3), "has no option")):
        with pytest.raises(KVLearnError, match=needle) as err:
            make_config("kvpop", **kwargs)
        one_line(err)


# ----------------------------------------------------------------------------------------------------------------
# the evaluation harness with the mLSTM scorer (chunked prefill from the scorer memory)


def mlstm_harness_model(delayed: bool):
    """A tiny Qwen3 on the testbed vocabulary (head_dim 64) with KVpop mLSTM modules of the harness's config
    (budget 48 = sinks 4 + window 32 + topk 12), randomised so that the rankings are not recency."""
    from kvlearn.testbed.tokenizer import VOCAB_SIZE

    torch.manual_seed(17)
    cfg = Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                      pad_token_id=0, bos_token_id=None, eos_token_id=None)
    model = Qwen3ForCausalLM(cfg).eval()
    options = {"scorer": "mlstm", "delayed_readout": delayed}
    config = make_config("kvpop", budget=48, sinks=4, context=256, **options)
    apply_kvpop(model, config)
    scorers, decays = kvpop_modules(model)
    for sc in scorers:
        for prm in sc.parameters():
            torch.nn.init.normal_(prm, std=0.5)
    for dc in decays:
        torch.nn.init.normal_(dc.alpha, std=1.0)
    return model, config, options


@pytest.mark.parametrize("protocol, delayed", [("bounded", True), ("context", True), ("bounded", False)])
def test_the_harness_evaluates_an_mlstm_kvpop_model(protocol, delayed):
    """Both protocols prefill in chunks (64 tokens; the testbed layout puts padding before and inside a row's
    chunks): a padded batch of 3 generates exactly what each example does alone, and kvlearn.eval's evaluate
    runs with scorer='mlstm' (EvalConfig.options) and records it."""
    from kvlearn.eval.accuracy import EvalConfig, evaluate
    from kvlearn.eval.protocols import layout, run_batch
    from kvlearn.testbed import tasks

    model, config, options = mlstm_harness_model(delayed)
    exs = [tasks.generate(f, tasks.example_seed(f, "eval", 0), 256) for f in ("niah", "recall", "trace")]

    def run(batch_examples):
        cache = make_kvpop_cache(model, config)
        batch = layout(batch_examples, protocol, pad_id=0, chunk_size=64)
        return run_batch(model, cache, batch, protocol, 5, chunk_size=64, pad_id=0), cache, batch

    out, cache, batch = run(exs)
    assert out.shape == (3, 5) and (batch.mask == 0).any()
    assert cache.get_seq_length() == batch.ids.shape[1] + 4
    assert all(layer.allocated_state_bytes() > 0 for layer in cache.layers)
    for i, ex in enumerate(exs):
        assert out[i].tolist() == run([ex])[0][0].tolist(), f"row {i} ({ex.family}) differs from its single run"
    eval_config = EvalConfig(method="kvpop", budget=48, sinks=4, context=256, protocol=protocol, tasks=("vt",),
                             n_per_task=2, batch_size=2, chunk_size=64, options=options)
    assert eval_config.method_config == config
    (row,) = evaluate(model, eval_config, progress=False)
    assert (row["method"], row["protocol"], row["n"], row["options"]) == ("kvpop", protocol, 2, options)
    assert row["kv_bytes"] > 0 and "incomplete" not in row


def test_kvlearn_eval_takes_an_mlstm_checkpoints_learned_fields(tmp_path, capsys):
    """``kvlearn eval --method kvpop`` on a saved mLSTM KVpop checkpoint: the scorer, readout, decay range and the
    delayed readout's window come from its config.json (the registry default would be the MLP scorer), so the
    bounded protocol evaluates the checkpoint's own mLSTM scorers through chunked prefill."""
    from kvlearn.cli import main
    from kvlearn.methods import trained_options

    model, config, _ = mlstm_harness_model(True)
    model.save_pretrained(tmp_path)
    options = trained_options("kvpop", tmp_path)
    assert options == {"scorer": "mlstm", "delayed_readout": True, "mlstm_skip": True, "decay_min": config.decay_min,
                       "decay_max": config.decay_max, "window": 32, "state_in_budget": False,
                       "mlstm_use_norm": False, "mlstm_value_dim": None, "mlstm_gate_softcap": 15.0}
    assert trained_options("kvpop", tmp_path / "nope") == {} and trained_options("streaming", tmp_path) == {}
    out = tmp_path / "rows.json"
    code = main(["eval", "--model", str(tmp_path), "--method", "kvpop", "--budget", "48", "--context", "256",
                 "--tasks", "vt", "--n-per-task", "1", "--batch-size", "1", "--chunk-size", "64", "--device", "cpu",
                 "--out", str(out)])
    assert code == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["method"] == "kvpop" and row["options"]["scorer"] == "mlstm" and row["n"] == 1


def test_kvlearn_eval_serves_a_state_in_budget_student_with_its_state_counted(tmp_path, capsys):
    """An mLSTM student trained with its recurrent state counted in the budget (``state_in_budget``, Table 1's
    rule) is evaluated so by ``kvlearn eval``: its top-k gives up ``ceil(state bytes / token bytes)`` slots, so the
    stored keys and values are smaller than the same weights' without the flag by exactly those slots in every
    layer and KV head (the budget's other tokens are all filled: the context is longer than the budget)."""
    from kvlearn.cli import main
    from kvlearn.kvpop.apply import state_budget_config
    from kvlearn.methods import trained_options

    model, _, _ = mlstm_harness_model(True)
    store = {}
    for flag in (True, False):
        folder = tmp_path / f"state_{int(flag)}"
        model.save_pretrained(folder)
        record = json.loads((folder / "config.json").read_text())
        record["kvpop"]["state_in_budget"] = flag  # as `kvlearn retrofit --state-in-budget` records it
        (folder / "config.json").write_text(json.dumps(record))
        assert trained_options("kvpop", folder)["state_in_budget"] is flag
        out = tmp_path / f"rows_{int(flag)}.json"
        assert main(["eval", "--model", str(folder), "--method", "kvpop", "--budget", "200", "--context", "256",
                     "--tasks", "vt", "--n-per-task", "1", "--batch-size", "1", "--chunk-size", "64", "--device",
                     "cpu", "--out", str(out)]) == 0
        (row,) = json.loads(out.read_text())["rows"]
        assert row["options"]["state_in_budget"] is flag
        store[flag] = row["store_bytes"]
    scorers, _ = kvpop_modules(model)
    token_bytes = 2 * 64 * 4  # one token's float32 key and value (head_dim 64) in one KV head
    full = KVpopConfig(sinks=4, window=32, topk=164, scorer="mlstm", state_in_budget=True)
    slots = full.topk - state_budget_config(full, scorers[0], token_bytes).topk
    assert slots >= 1
    assert store[False] - store[True] == slots * token_bytes * 2 * 2  # 2 layers, 2 KV heads


def test_kvlearn_eval_window_option(tmp_path, capsys):
    """``--window`` sets the protected window of a KVpop evaluation (recorded in the row; the ranked slots are the
    rest of the budget); a delayed mLSTM checkpoint refuses another window than its own; a method without a free
    window says so in one line."""
    from kvlearn.cli import main

    model, _, _ = mlstm_harness_model(False)  # an immediate readout: any window
    model.save_pretrained(tmp_path / "mlp")
    out = tmp_path / "rows.json"
    args = ["--context", "256", "--tasks", "vt", "--n-per-task", "1", "--batch-size", "1", "--device", "cpu"]
    assert main(["eval", "--model", str(tmp_path / "mlp"), "--method", "kvpop", "--budget", "48", "--window", "20",
                 "--out", str(out), *args]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["options"]["window"] == 20 and row["budget"] == 48
    mlstm, _, _ = mlstm_harness_model(True)
    mlstm.save_pretrained(tmp_path / "mlstm")
    capsys.readouterr()
    assert main(["eval", "--model", str(tmp_path / "mlstm"), "--method", "kvpop", "--budget", "48", "--window", "20",
                 *args]) != 0
    err = capsys.readouterr().err
    assert "--window 20 is invalid" in err and "tied to the window it was trained with (32)" in err
    assert main(["eval", "--method", "streaming", "--budget", "48", "--window", "20", *args]) != 0
    assert "window=20 is invalid" in capsys.readouterr().err


def test_decay_init_sets_every_heads_initial_gamma(capsys):
    """``KVpopConfig.decay_init``: every new head starts at that gamma (default: the log-midpoint of the range,
    sqrt(decay_min * decay_max) = 0.9995 for the paper's range); values outside the open range are one line, in the
    config and in ``kvlearn retrofit --decay-init``."""
    import math

    from kvlearn.cli import main

    paper = {**KV, "decay_min": 0.999, "decay_max": 0.999999}  # the paper's range
    model = apply_kvpop(tiny(), KVpopConfig(**paper, scorer="mlp", decay_init=0.99999))
    for decay in kvpop_modules(model)[1]:
        torch.testing.assert_close(torch.exp(decay()), torch.full((2,), 0.99999), atol=1e-9, rtol=0)
    default = kvpop_modules(apply_kvpop(tiny(), KVpopConfig(**paper, scorer="mlp")))[1][0]
    torch.testing.assert_close(torch.exp(default()), torch.full((2,), math.sqrt(0.999 * 0.999999)), atol=1e-9, rtol=0)
    for bad in (0.999, 0.999999, 0.5, True):
        with pytest.raises(KVLearnError, match="decay_init") as err:
            KVpopConfig(decay_init=bad)
        one_line(err)
    capsys.readouterr()
    assert main(["retrofit", "--model", "nowhere", "--out", "nowhere2", "--decay-init", "0.2"]) == 2
    err = capsys.readouterr().err
    assert "decay_init=0.2 is invalid" in err and err.count("\n") == 1


def test_the_mlstm_skip_variant_decodes_like_its_mask_round_trips_and_must_match(tmp_path):
    """KVpopConfig(mlstm_skip=True): every layer's mLSTM scorer has the skip path; decoding through the cache equals
    the masked full forward (rule 4); save_pretrained -> load keeps it (identical decode logits); loading it under a
    config without the skip is a one-line error naming the field."""
    model, config = kvpop_model(scorer="mlstm", seed=3, mlstm_skip=True)
    scorers, decays = kvpop_modules(model)
    assert all(s.skip and s.skip_w1 is not None for s in scorers)
    ids = torch.randint(1, VOCAB, (2, 40))
    ref = reference_logits(model, scorers, decays, config, ids)
    got = decode_logits(model, make_kvpop_cache(model), ids, prefill=12)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    model.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["kvpop"]["mlstm_skip"] is True
    loaded = kvlearn.load(tmp_path)
    assert all(s.skip for s in kvpop_modules(loaded)[0])
    torch.testing.assert_close(decode_logits(loaded, make_kvpop_cache(loaded), ids, prefill=12), got, atol=0, rtol=0)
    with pytest.raises(KVLearnError, match="mlstm_skip=False but the model's KVpop modules were built with mlstm_skip=True") as err:
        make_kvpop_cache(model, KVpopConfig(**{**KV}, scorer="mlstm", mlstm_skip=False))
    one_line(err)
    with pytest.raises(KVLearnError, match="mlstm_skip=1 is invalid"):
        KVpopConfig(scorer="mlstm", mlstm_skip=1)


def test_a_record_from_before_mlstm_skip_loads_without_the_skip(tmp_path):
    """mlstm_skip defaults to True, but a checkpoint saved before the field existed (no "mlstm_skip" in its
    config.json) was built without the skip: it loads as such, with identical logits, and its trained options say so."""
    from kvlearn.methods import trained_options

    assert KVpopConfig().mlstm_skip is True and KVpopConfig.from_record({"scorer": "mlstm"}).mlstm_skip is False
    model, _ = kvpop_model(scorer="mlstm", seed=4, mlstm_skip=False)
    model.save_pretrained(tmp_path)
    record = json.loads((tmp_path / "config.json").read_text())
    del record["kvpop"]["mlstm_skip"]  # as written before the field existed
    (tmp_path / "config.json").write_text(json.dumps(record))
    assert trained_options("kvpop", tmp_path)["mlstm_skip"] is False
    loaded = kvlearn.load(tmp_path)
    assert not any(s.skip for s in kvpop_modules(loaded)[0])
    ids = torch.randint(1, VOCAB, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=0, rtol=0)


def test_state_in_budget_trades_the_mlstm_state_for_long_range_slots():
    """KVpopConfig(state_in_budget=True): the mLSTM cache keeps topk - ceil(state bytes / one token's K+V bytes)
    long-range tokens, so its K/V plus state stay within the MLP cache's bytes at the same budget (hand count: the
    tiny model's head_dim 16, float32, state 4 * (16 * 8 + 16 + 1) = 580 bytes per KV head, a token 2 * 16 * 4 = 128
    bytes: 5 slots); stateless scorers are unchanged; a budget whose top-k the state would fill is one line."""
    from kvlearn.kvpop.apply import state_budget_config

    ids = torch.randint(1, VOCAB, (2, 40))
    caches = {}
    for scorer, flag in (("mlstm", True), ("mlstm", False), ("mlp", True)):
        model, config = kvpop_model(scorer=scorer, seed=5, topk=12)
        cache = make_kvpop_cache(model, dataclasses.replace(config, state_in_budget=flag))
        decode_logits(model, cache, ids, prefill=12)
        caches[scorer, flag] = cache
    model, config = kvpop_model(scorer="mlstm", seed=5, topk=12)
    scorer = kvpop_modules(model)[0][0]
    assert scorer.state_bytes_per_head() == 4 * (16 * 8 + 16 + 1)
    assert caches["mlstm", True].layers[0].keys.shape[2] == config.budget - 5
    assert caches["mlstm", False].layers[0].keys.shape[2] == config.budget
    assert caches["mlp", True].layers[0].keys.shape[2] == config.budget
    assert caches["mlstm", True].allocated_bytes() <= caches["mlp", True].allocated_bytes()
    assert caches["mlstm", False].allocated_bytes() > caches["mlp", True].allocated_bytes()
    with pytest.raises(KVLearnError, match="takes 5 of topk=5 long-range slots") as err:
        state_budget_config(dataclasses.replace(config, topk=5, state_in_budget=True), scorer, 128)
    one_line(err)


# ----------------------------------------------------------------------------------------------------------------
# the mLSTM scorer's other options (use_norm, chunk_size, value_dim, gate_softcap)

MLSTM_OPTIONS = dict(mlstm_use_norm=True, mlstm_value_dim=12, mlstm_gate_softcap=None, mlstm_chunk_size=16)


def test_mlstm_option_defaults_are_the_scorers_and_bad_values_are_one_line():
    """KVpopConfig's mlstm_use_norm / mlstm_chunk_size / mlstm_value_dim / mlstm_gate_softcap default to
    MLSTMScorer's own defaults (so every earlier record builds the same scorer); each bad value is one line naming it."""
    import inspect
    import re

    params = inspect.signature(MLSTMScorer.__init__).parameters
    config = KVpopConfig()
    for field, arg in (("mlstm_use_norm", "use_norm"), ("mlstm_chunk_size", "chunk_size"),
                       ("mlstm_value_dim", "value_dim"), ("mlstm_gate_softcap", "gate_softcap")):
        assert getattr(config, field) == params[arg].default, field
    bad = {"mlstm_use_norm": (1, "yes", None), "mlstm_chunk_size": (0, -4, 16.0, True, None),
           "mlstm_value_dim": (0, -1, 8.0, True, "8"),
           "mlstm_gate_softcap": (0, -1.0, True, float("inf"), float("nan"), "15")}
    for field, values in bad.items():
        for value in values:
            with pytest.raises(KVLearnError, match=rf"^{field}={re.escape(repr(value))} is invalid: expected ") as err:
                KVpopConfig(**{field: value})
            one_line(err)
    assert KVpopConfig(mlstm_gate_softcap=5).mlstm_gate_softcap == 5 and KVpopConfig(mlstm_chunk_size=3).mlstm_chunk_size == 3


def test_apply_builds_the_configured_mlstm_options():
    """apply_kvpop with non-default mLSTM options builds the scorer that MLSTMScorer with the same arguments and seed
    builds (same state-dict keys, shapes and values: W_v and a of width value_dim, the RMSNorm weight); the state's
    bytes (and so state_in_budget's slots) follow value_dim; re-applying with another learned option is one line,
    with another chunk size (numerics only) it is not."""
    from kvlearn.kvpop.apply import model_budget_config

    config = KVpopConfig(**KV, scorer="mlstm", mlstm_use_norm=True, mlstm_value_dim=5, mlstm_gate_softcap=None,
                         mlstm_chunk_size=8)
    model = tiny()
    torch.manual_seed(11)
    apply_kvpop(model, config)
    torch.manual_seed(11)
    direct = MLSTMScorer(2, 16, window=3, delayed_readout=True, use_norm=True, chunk_size=8, value_dim=5,
                         gate_softcap=None, skip=config.mlstm_skip)
    scorer = kvpop_modules(model)[0][0]
    assert (scorer.use_norm, scorer.chunk_size, scorer.value_dim, scorer.gate_softcap) == (True, 8, 5, None)
    want, got = direct.state_dict(), scorer.state_dict()
    assert want.keys() == got.keys() and "norm_weight" in got
    assert all(got[k].shape == want[k].shape and torch.equal(got[k], want[k]) for k in want)
    assert got["w_v"].shape == (2, 32, 5) and got["a"].shape == (2, 5) and got["norm_weight"].shape == (2, 5)
    # the state: float32 C [16, 5] + n [16] + m = 4 * (16 * 5 + 16 + 1) = 388 bytes per KV head, ceil(388 / 128) = 4
    # float32 tokens' worth of top-k slots (580 bytes and 5 slots at the default width 8)
    assert scorer.state_bytes_per_head() == 388
    kv = dataclasses.replace(config, topk=12, state_in_budget=True)
    assert model_budget_config(model, kv).topk == 12 - 4
    default = kvpop_modules(apply_kvpop(tiny(), KVpopConfig(**KV, scorer="mlstm")))[0][0]
    assert (default.use_norm, default.chunk_size, default.value_dim, default.gate_softcap) == (False, 64, 8, 15.0)
    assert default.norm_weight is None and default.state_bytes_per_head() == 580
    for field, value in (("mlstm_value_dim", None), ("mlstm_use_norm", False), ("mlstm_gate_softcap", 15.0)):
        with pytest.raises(KVLearnError, match=f"{field}={value!r} but the model's KVpop modules were built with "
                                               f"{field}=") as err:
            apply_kvpop(model, dataclasses.replace(config, **{field: value}))
        one_line(err)
    apply_kvpop(model, dataclasses.replace(config, mlstm_chunk_size=64))  # numerics only: the modules are kept
    assert scorer.chunk_size == 8 and kvpop_modules(model)[0][0] is scorer
    # value_dim None means head_dim / 2: an explicit 8 fits the default scorer and the other way round
    default_model = apply_kvpop(tiny(), KVpopConfig(**KV, scorer="mlstm", mlstm_value_dim=8))
    apply_kvpop(default_model, KVpopConfig(**KV, scorer="mlstm"))


def test_mlstm_options_decode_like_their_mask_and_round_trip(tmp_path):
    """Rule 4 with the norm, value width 12, no gate cap and chunks of 16 (the 40-token reference forward runs two
    chunks and a remainder, the 20-token prefill one chunk and a remainder): prefill + token-by-token decoding equals
    the masked full forward; save_pretrained -> kvlearn.load keeps the options (config equality, trained_options)
    and gives identical logits."""
    from kvlearn.methods import trained_options

    model, config = kvpop_model(scorer="mlstm", seed=3, **MLSTM_OPTIONS)
    scorers, decays = kvpop_modules(model)
    assert all((s.use_norm, s.value_dim, s.gate_softcap, s.chunk_size) == (True, 12, None, 16) for s in scorers)
    ids = torch.randint(1, VOCAB, (2, 40))
    ref = reference_logits(model, scorers, decays, config, ids)
    got = decode_logits(model, make_kvpop_cache(model), ids, prefill=20)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    model.save_pretrained(tmp_path)
    loaded = kvlearn.load(tmp_path)
    assert KVpopConfig(**loaded.config.kvpop) == config
    assert all((s.use_norm, s.value_dim, s.gate_softcap, s.chunk_size) == (True, 12, None, 16)
               for s in kvpop_modules(loaded)[0])
    options = trained_options("kvpop", tmp_path)
    assert (options["mlstm_use_norm"], options["mlstm_value_dim"], options["mlstm_gate_softcap"]) == (True, 12, None)
    assert "mlstm_chunk_size" not in options  # numerics only: not fixed by the checkpoint
    make_kvpop_cache(loaded, make_config("kvpop", budget=9, sinks=2, **options))  # fits the modules
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, plain, atol=0, rtol=0)
    torch.testing.assert_close(decode_logits(loaded, make_kvpop_cache(loaded), ids, prefill=20), got, atol=0, rtol=0)


def test_a_record_from_before_the_mlstm_options_loads_with_their_defaults(tmp_path):
    """A config.json written before mlstm_use_norm / mlstm_chunk_size / mlstm_value_dim / mlstm_gate_softcap existed
    reads as their defaults (KVpopConfig.from_record), loads with identical logits, and its trained options lack them."""
    from kvlearn.methods import trained_options

    model, config = kvpop_model(scorer="mlstm", seed=4)
    model.save_pretrained(tmp_path)
    record = json.loads((tmp_path / "config.json").read_text())
    for field in MLSTM_OPTIONS:
        del record["kvpop"][field]  # as written before the fields existed
    (tmp_path / "config.json").write_text(json.dumps(record))
    assert KVpopConfig.from_record(record["kvpop"]) == config
    assert not set(MLSTM_OPTIONS) & set(trained_options("kvpop", tmp_path))
    loaded = kvlearn.load(tmp_path)
    assert KVpopConfig(**loaded.config.kvpop) == config
    ids = torch.randint(1, VOCAB, (2, 30))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=0, rtol=0)
