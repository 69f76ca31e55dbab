"""KV-Kaizen composed with eviction (``kaizen+snapkv``, ``kaizen+kvpop``; :mod:`kvlearn.kaizen.compose`) on a tiny
random GQA Qwen3 (float32, 3 layers, 2 KV heads, 2 query heads per KV head, head_dim 128, the testbed vocabulary).

(a) the composed cache's stores hold exactly the cost model's bytes (bits per token x slots) and its allocated
bytes are within 5% of bits per token x kept tokens; a sharing layer holds nothing and sees its anchor's tokens;
(b) with a budget that keeps every token it equals the plain Kaizen cache's logits;
(c) at 16 bits without sharing it equals the plain SnapKV / KVpop cache (an independent reference);
(d) the realised factor is the representation factor x context / budget (also through the harness rows);
(e) bad input is a one-line error naming the feasible range; and a left-padded harness batch answers as its rows
alone.
"""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from kvlearn import KVLearnError
from kvlearn.cache import BorrowedLayer, prefill
from kvlearn.config import KVpopConfig
from kvlearn.eviction import snapkv
from kvlearn.kaizen import sharing
from kvlearn.kaizen.actions import Backbone, KaizenConfig, LayerAction
from kvlearn.kaizen.cache import KaizenCache
from kvlearn.kaizen.compose import ComposedConfig, composed_cache, composed_choice, total_range
from kvlearn.kvpop.apply import apply_kvpop, kvpop_modules, make_kvpop_cache
from kvlearn.methods import get_method, make_config
from kvlearn.testbed.tokenizer import VOCAB_SIZE

S = LayerAction.shared()
HEAD_DIM = 128
METHODS = ("kaizen+snapkv", "kaizen+kvpop")


def tiny(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD_DIM, max_position_embeddings=512,
                      pad_token_id=0, bos_token_id=None, eos_token_id=None, dtype="float32")
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_norm.weight.uniform_(0.25, 2.0)
    return sharing.attach(model)


def with_kvpop(model, config: KVpopConfig):
    """KVpop modules with random scorer weights (zero-initialised ones rank by recency alone), Kaizen attention."""
    apply_kvpop(model, config)
    torch.manual_seed(1)
    with torch.no_grad():
        for scorer in kvpop_modules(model)[0]:
            for p in scorer.parameters():
                p.normal_(0, 0.5)
    return sharing.attach(model)


def eviction_config(name, budget, context, sinks=2, window=8):
    if name == "kaizen+snapkv":
        return snapkv.SnapKVConfig(budget=budget, sinks=sinks, window=window, context=context)
    return KVpopConfig(sinks=sinks, window=window, topk=budget - sinks - window, context=context, scorer="mlp")


def setup(name, budget, context, target, seed=0):
    """``(model, composed config, method)`` with the method's modules applied."""
    model = tiny(seed)
    config = ComposedConfig(target, eviction_config(name, budget, context))
    method = get_method(name)
    method.prepare(model, config)
    if name == "kaizen+kvpop":
        with_kvpop(model, config.eviction)
    return model, config, method


def run(model, cache, ids, prompt, dense):
    """Prefill ``ids[:, :prompt]`` (one dense forward, or chunks of 16), then decode the rest one token a forward;
    the logits of the last prompt column and of every decoded token ``[batch, 1 + n - prompt, vocab]``."""
    with torch.no_grad():
        out = [prefill(model, cache, ids[:, :prompt], chunk_size=16, dense=dense)[:, None]]
        out += [model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits
                for t in range(prompt, ids.shape[1])]
    return torch.cat(out, dim=1)


def ids_of(batch, n, seed=3):
    return torch.randint(1, VOCAB_SIZE, (batch, n), generator=torch.Generator().manual_seed(seed))


# (a) bytes ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", METHODS)
@pytest.mark.parametrize("actions", [None, (LayerAction(8), S, LayerAction(16))], ids=["chosen", "mixed+share"])
def test_allocated_bytes_follow_the_cost_model(name, actions):
    budget, batch = 64, 2
    model, config, method = setup(name, budget, 256, 8.0)
    backbone = Backbone.from_config(model.config, scale_bits=32)  # float32 scales
    choice = composed_choice(config, backbone) if actions is None else KaizenConfig(backbone, actions)
    if actions is None:
        assert str(choice) == "b8 b8 b8"  # 8x total at keep 1/4: 2x representation, least compressed: 8 bits
    cache = method.make_choice_cache(config, model, choice, 999)
    run(model, cache, ids_of(batch, 100), 90, dense=True)
    assert cache.get_seq_length() == 100
    own = [layer for layer, a in zip(cache.layers, choice.actions) if not a.share]
    slots = own[0].capacity
    assert slots == (budget + 1 if name == "kaizen+snapkv" else budget)  # SnapKV evicts after attending
    assert all(int((layer.slot_positions >= 0).sum(dim=2).max()) <= slots for layer in own)
    assert cache.store_bytes() == choice.cache_bytes(batch, slots, dtype_bits=32)  # bits/token x slots, exactly
    bookkeeping = batch * 2 * slots * 8 * len(own)  # int32 position + float32 score per slot and KV head
    assert cache.allocated_bytes() == cache.store_bytes() + bookkeeping
    kept = choice.cache_bytes(batch, budget, dtype_bits=32)  # bits/token x kept tokens
    assert kept <= cache.allocated_bytes() <= 1.05 * kept
    for layer, action in zip(cache.layers, choice.actions):
        if action.share:
            anchor = cache.layers[choice.anchor_of(cache.layers.index(layer))]
            assert isinstance(layer, BorrowedLayer) and layer.allocated_bytes() == 0
            pos = torch.tensor([[5, 99]] * batch)
            assert torch.equal(layer.visibility_mask(pos), anchor.visibility_mask(pos))  # the anchor decides


# (b) keep-everything budget = the plain Kaizen cache -------------------------------------------------------------


@pytest.mark.parametrize("name", METHODS)
def test_a_budget_that_keeps_everything_equals_the_kaizen_cache(name):
    model, config, method = setup(name, 48, 64, 4.0, seed=4)
    # float64: the composed and the plain cache attend through different kernels, whose float32 roundings (they
    # differ between CPUs, e.g. AVX-512 and AVX2) can move a key across a 4-bit rounding boundary in one path only
    model = model.double()
    choice = KaizenConfig(Backbone.from_config(model.config), (LayerAction(8), S, LayerAction(4)))
    ids = ids_of(2, 40)
    for dense in ((True,) if name == "kaizen+snapkv" else (True, False)):
        got = run(model, method.make_choice_cache(config, model, choice, 0), ids, 30, dense)
        ref = run(model, KaizenCache(choice, capacity=41), ids, 30, dense)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


# (c) 16 bits, no sharing = the plain eviction cache -------------------------------------------------------------


@pytest.mark.parametrize("name", METHODS)
def test_sixteen_bits_without_sharing_equals_the_eviction_method(name):
    model, config, method = setup(name, 20, 64, 3.2, seed=5)
    choice = composed_choice(config, Backbone.from_config(model.config))
    assert str(choice) == "b16 b16 b16"  # 3.2x total at keep 20/64: 1x representation
    ids = ids_of(2, 56, seed=6)
    for dense in ((True,) if name == "kaizen+snapkv" else (True, False)):
        got = run(model, method.make_choice_cache(config, model, choice, 0), ids, 44, dense)
        if name == "kaizen+snapkv":
            plain = snapkv.make_cache(config.eviction, model.config)
        else:
            plain = make_kvpop_cache(model, config.eviction)
        ref = run(model, plain, ids, 44, dense)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        keep_all = run(model, KaizenCache(choice, capacity=57), ids, 44, dense)
        assert float((got - keep_all).abs().max()) > 1e-3  # eviction really happened


# (d) the realised factor ---------------------------------------------------------------------------------------


def test_realised_factor_is_representation_times_eviction():
    budget, context, batch = 64, 256, 1
    model, config, method = setup("kaizen+kvpop", budget, context, 6.0)
    choice = KaizenConfig(Backbone.from_config(model.config), (LayerAction(16), S, LayerAction(16)))  # 1.5x, no scales
    cache = method.make_choice_cache(config, model, choice, 0)
    assert cache.realised_factor() == pytest.approx(choice.compression(metadata=False) * context / budget) == 6.0
    run(model, cache, ids_of(batch, context), context - 4, dense=False)
    dense_bytes = 3 * 2 * 2 * HEAD_DIM * 4 * context * batch  # layers x (K, V) x kv heads x head_dim x float32
    assert dense_bytes / cache.store_bytes() == pytest.approx(cache.realised_factor())  # KVpop: budget slots


@pytest.mark.parametrize("name,protocol", [("kaizen+snapkv", "context"), ("kaizen+kvpop", "bounded")])
def test_harness_rows_report_the_total_factor(name, protocol):
    from kvlearn.eval.accuracy import EvalConfig, evaluate

    config = EvalConfig(method=name, budget=64, context=256, target=8.0, protocol=protocol, tasks=("vt",),
                        n_per_task=2, batch_size=2, chunk_size=64)
    (row,) = evaluate(tiny(7), config, progress=False)
    assert (row["method"], row["protocol"], row["n"], row["budget"], row["sinks"]) == (name, protocol, 2, 64, 4)
    assert row["factor"] == pytest.approx(8.0) and row["target"] == pytest.approx(8.0)  # 8 bits x keep 1/4
    assert row["compression"] == pytest.approx(1 - 1 / 8)
    assert 0 < row["store_bytes"] < row["kv_bytes"]


# (e) bad input -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", METHODS)
def test_bad_input_is_one_line(name):
    model = tiny()
    backbone = Backbone.from_config(model.config)
    config = make_config(name, budget=64, sinks=4, context=256, target=8.0)
    assert total_range(config, backbone) == pytest.approx((4.0, 96.0))  # [1x, 24x] x 256/64
    cases = [
        (lambda: get_method(name).prepare(model, make_config(name, budget=64, sinks=4, context=256, target=100.0)),
         r"total target 100x is infeasible .* expected a total target in \[4x, 96x\]"),
        (lambda: composed_choice(make_config(name, budget=64, sinks=4, context=256, target=2.0), backbone),
         r"representation would need 0.5x, outside \[1x, 24x\]"),
        (lambda: make_config(name, budget=64, sinks=4, context=256), "needs --budget .* and --target"),
        (lambda: make_config(name, budget=None, sinks=4, context=256, target=8.0), "needs --budget"),
        (lambda: make_config(name, budget=300, sinks=4, context=256, target=8.0), "context = 256"),
        (lambda: make_config(name, budget=64, sinks=4, context=None, target=8.0), "context is missing"),
        (lambda: ComposedConfig(0.0, config.eviction), "target=0.0 is invalid"),
        (lambda: get_method(name).make_cache(config, model), "make_prompt_cache"),
    ]
    for fn, match in cases:
        with pytest.raises(KVLearnError, match=match) as err:
            fn()
        assert len(str(err.value).splitlines()) == 1


@pytest.mark.parametrize("name", METHODS)
def test_a_trained_selector_chooses_the_composed_configuration(name):
    """With a selector on the model (what ``kvlearn.load`` of a kaizen-train folder gives), the composed methods take
    its choice for each prompt at the representation target ``total x budget / context`` (here 8x x 64/256 = 2x),
    not the static one: a selector pushed to ``b8 share b16`` (exactly 2x) gets that configuration, the harness's
    rows report it and the total factor 8; without a selector the static uniform 8 bits; a representation target the
    selector's axes cannot reach is a one-line error."""
    from kvlearn.eval.accuracy import EvalConfig, evaluate
    from kvlearn.kaizen.apply import KaizenMethodConfig, apply_kaizen, selector_of
    from kvlearn.kaizen.compose import composed_prompt_choices

    budget, context, total = 64, 256, 8.0
    model, config, method = setup(name, budget, context, total)
    backbone = Backbone.from_config(model.config)
    assert composed_prompt_choices(config, model, ids_of(2, 40), None) == [KaizenConfig.static(backbone, 8)] * 2
    apply_kaizen(model, KaizenMethodConfig(target=2.0))
    sel = selector_of(model)
    wanted = KaizenConfig(backbone, (LayerAction(8), S, LayerAction(16)))
    index = {a: i for i, a in enumerate(sel.space)}
    with torch.no_grad():
        for layer, action in enumerate(wanted.actions):
            sel.head_bias[layer, index[action]] = 100.0
    assert wanted.compression(metadata=False) == 2.0 and KaizenConfig.static(backbone, 8) != wanted
    assert composed_prompt_choices(config, model, ids_of(3, 40), None) == [wanted] * 3
    eval_config = EvalConfig(method=name, budget=budget, context=context, target=total, tasks=("vt",), n_per_task=2,
                             batch_size=2, chunk_size=64, protocol="context" if name == "kaizen+snapkv" else "bounded")
    (row,) = evaluate(model, eval_config, progress=False)
    assert row["configurations"] == {"b8 share b16": 2} and row["factor"] == pytest.approx(total)
    narrow, narrow_config, _ = setup(name, budget, context, 64.0)  # representation 16x: past precision's 8x
    apply_kaizen(narrow, KaizenMethodConfig(target=8.0, axes=("precision",)))
    with pytest.raises(KVLearnError, match=r"16") as err:
        composed_prompt_choices(narrow_config, narrow, ids_of(1, 40), None)
    assert len(str(err.value).splitlines()) == 1


def test_cli_composes_a_kaizen_checkpoint_with_grafted_kvpop_scorers(tmp_path, capsys):
    """``kvlearn eval --method kaizen+kvpop --model <Kaizen checkpoint> --kvpop-scorers <KVpop checkpoint>``: the
    Kaizen folder's backbone and selector (pushed to ``b8 share b16``: 2x), the KVpop folder's scorers (a decay range
    the harness's default would not pick) and trained fields, at total 8x with budget 64 of 256; the file names the
    scorers. ``--kvpop-scorers`` with another method, or a folder without config.json, is one line."""
    import json

    from kvlearn.cli import main
    from kvlearn.kaizen.apply import KaizenMethodConfig, apply_kaizen, selector_of

    base = tiny(4)
    kvpop = tiny(4)
    apply_kvpop(kvpop, KVpopConfig(sinks=4, window=16, topk=44, scorer="mlp", decay_min=0.99, decay_max=0.9999))
    kvpop.save_pretrained(tmp_path / "kvpop")
    apply_kaizen(base, KaizenMethodConfig(target=2.0))
    sel = selector_of(base)
    backbone = Backbone.from_config(base.config)
    wanted = KaizenConfig(backbone, (LayerAction(8), S, LayerAction(16)))
    with torch.no_grad():
        for layer, action in enumerate(wanted.actions):
            sel.head_bias[layer, sel.space.index(action)] = 100.0
    base.save_pretrained(tmp_path / "kaizen")
    out = tmp_path / "rows.json"
    assert main(["eval", "--method", "kaizen+kvpop", "--model", str(tmp_path / "kaizen"), "--kvpop-scorers",
                 str(tmp_path / "kvpop"), "--budget", "64", "--target", "8", "--context", "256", "--tasks", "vt",
                 "--n-per-task", "2", "--device", "cpu", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert row["configurations"] == {"b8 share b16": 2} and row["factor"] == pytest.approx(8.0)
    assert (row["options"]["decay_min"], row["options"]["window"]) == (0.99, 16)
    assert data["kvpop_scorers"].endswith("kvpop")
    capsys.readouterr()
    for argv, match in ((["--method", "kaizen+snapkv", "--kvpop-scorers", str(tmp_path / "kvpop")], "kaizen+snapkv"),
                        (["--method", "kaizen+kvpop", "--kvpop-scorers", str(tmp_path)], "no config.json")):
        code = main(["eval", "--model", str(tmp_path / "kaizen"), "--budget", "64", "--target", "8", "--context",
                     "256", "--device", "cpu", *argv])
        err = capsys.readouterr().err.strip()
        assert code == 2 and "\n" not in err and match in err, err


def test_composed_cache_is_refused_on_an_mla_backbone():
    mla = Backbone(num_layers=2, kv_heads=2, head_dim=16, mla_rank=32, rope_dim=16)
    config = ComposedConfig(8.0, eviction_config("kaizen+snapkv", 64, 256))
    with pytest.raises(KVLearnError, match="GQA backbones only") as err:
        composed_choice(config, mla)
    assert len(str(err.value).splitlines()) == 1
    with pytest.raises(KVLearnError, match="policy_factory"):
        composed_cache(config, KaizenConfig.static(mla), lambda l: None)


@pytest.mark.parametrize("name,protocol", [("kaizen+snapkv", "context"), ("kaizen+kvpop", "bounded")])
def test_a_padded_batch_answers_as_its_rows_alone(name, protocol):
    from kvlearn.eval.accuracy import EvalConfig, answer_batch
    from kvlearn.testbed import tasks

    model = tiny(8)
    config = EvalConfig(method=name, budget=64, context=256, target=8.0, protocol=protocol, chunk_size=64)
    get_method(name).prepare(model, config.method_config)
    exs = [tasks.generate(f, tasks.example_seed(f, "eval", 0), 256) for f in ("niah", "recall", "trace")]
    batch = answer_batch(model, config, exs)
    for ex, got in zip(exs, batch):
        (alone,) = answer_batch(model, config, [ex])
        assert got.tokens == alone.tokens and got.factor == alone.factor == pytest.approx(8.0)
