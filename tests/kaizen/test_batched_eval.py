"""Batched evaluation of the KV-Kaizen methods and their ``context`` protocol, on a tiny random GQA Qwen3 (float32,
3 layers, 2 KV heads, 4 query heads: 2 per KV head, head_dim 16, the testbed vocabulary) whose selector has random
head weights, so that prompts of one batch choose different configurations:

- a batch is run in groups of equal choice (:func:`kvlearn.eval.accuracy.answer_batch`), and generates, for every
  example, exactly the tokens (and the factor and target) of the example evaluated alone; ``evaluate`` with batches
  of 6 gives the rows of batches of 1 (accuracy, variants, factor, target), under both protocols;
- a row chooses from its prompt alone: the same in any batch, layout and protocol;
- ``context`` (every token kept: the context in one full-attention forward, then the question) generates what
  ``bounded`` generates, for ``kaizen``, ``kaizen_static`` and ``kaizen_random``; and its logits equal an
  independent reference, the no-cache forward with the configuration's fake-quantized K/V and sharing
  (``kaizen_config=``), to 1e-4;
- bad input is a one-line error (rows that choose differently in one cache; an all-padding row).
"""

import dataclasses

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from kvlearn import KVLearnError
from kvlearn.eval import accuracy
from kvlearn.eval.accuracy import EvalConfig, answer_batch, evaluate, examples_for, group_by_choice, new_tokens
from kvlearn.eval.protocols import layout, prefill_columns
from kvlearn.kaizen.actions import Backbone, KaizenConfig, LayerAction
from kvlearn.kaizen.apply import KaizenMethodConfig, apply_kaizen, make_prompt_cache, prompt_choices, selector_of
from kvlearn.kaizen.cache import KaizenCache
from kvlearn.methods import get_method
from kvlearn.testbed import tasks as testbed_tasks
from kvlearn.testbed.tokenizer import VOCAB_SIZE

CONTEXT = 256
CHUNK = 64  # several prefill chunks per prompt
TARGET = 2.0
TASKS = ("vt", "recall")  # with the selector below, 6 prompts of each choose 3-4 configurations, some shared


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                      pad_token_id=0, bos_token_id=None, eos_token_id=None, dtype="float32")
    m = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in m.model.layers:  # spread the key norms (an untrained k_norm makes every key norm equal)
            layer.self_attn.k_norm.weight.uniform_(0.25, 2.0)
            layer.self_attn.v_proj.weight.mul_(4.0)  # attention outputs dominate the residual: the first generated
            layer.self_attn.o_proj.weight.mul_(4.0)  # tokens depend on the cache configuration
    apply_kaizen(m, KaizenMethodConfig(target=TARGET))
    sel = selector_of(m)
    with torch.no_grad():  # random heads: the choice depends on the prompt
        sel.head_weight.copy_(torch.randn(sel.head_weight.shape, generator=torch.Generator().manual_seed(1)) * 3)
    return m


def eval_config(method="kaizen", protocol="bounded", batch_size=6, tasks=TASKS, n=6):
    options = {"examples": 1, "length": 128} if method == "kaizen_dp" else None  # a small calibration for the DP
    return EvalConfig(method=method, context=CONTEXT, tasks=tasks, n_per_task=n, batch_size=batch_size,
                      protocol=protocol, chunk_size=CHUNK, target=TARGET, options=options)


def choices_of(model, config, examples):
    batch = layout(examples, config.protocol, 0, config.chunk_size)
    return prompt_choices(config.method_config, model, batch.ids, batch.mask)


def answer_batch_with(model, config, examples, choice, monkeypatch):
    """The answers of ``examples`` with every row forced to ``choice`` (what one cache for all rows would give)."""
    forced = dataclasses.replace(get_method(config.method),
                                 prompt_choices=lambda c, m, ids, mask: [choice] * ids.shape[0])
    with monkeypatch.context() as patch:
        patch.setattr(accuracy, "get_method", lambda name: forced)
        return answer_batch(model, config, examples)


def test_group_by_choice_keeps_every_row_once_in_order():
    assert group_by_choice(["a", "b", "a", "c", "b"]) == [("a", [0, 2]), ("b", [1, 4]), ("c", [3])]
    assert group_by_choice([None, None]) == [(None, [0, 1])]


def test_a_row_lists_each_configurations_accuracy():
    """A hand-made case: five prompts under two configurations, three right; each configuration's accuracy is that of
    the prompts that took it, listed in the order of ``configurations`` (most prompts first)."""
    result = accuracy.TaskResult("niah", correct=3, n=5, choices=["A", "B", "A", "A", "B"],
                                 choice_correct=[True, False, False, True, True])
    row = accuracy._row(eval_config(), result)
    assert row["configurations"] == {"A": 3, "B": 2}
    assert row["configuration_accuracy"] == {"A": 2 / 3, "B": 1 / 2}


def test_a_row_chooses_from_its_prompt_alone(model):
    config = eval_config()
    exs = examples_for(config, "vt")
    alone = [choices_of(model, config, [ex])[0] for ex in exs]
    assert choices_of(model, config, exs) == alone  # any batch
    assert choices_of(model, eval_config(protocol="context"), exs) == alone  # any layout
    assert choices_of(model, config, exs[::-1]) == alone[::-1]


@pytest.mark.parametrize("protocol", ["bounded", "context"])
def test_batched_rows_equal_rows_alone(model, protocol, monkeypatch):
    config = eval_config(protocol=protocol)
    get_method("kaizen").prepare(model, config.method_config)
    scored = {}  # task -> each prompt's answer alone, scored
    for task in TASKS:
        exs = examples_for(config, task)
        groups = group_by_choice(choices_of(model, config, exs))
        assert len(groups) >= 2 and max(len(rows) for _, rows in groups) >= 2  # differing rows, a padded group
        batched = answer_batch(model, config, exs)
        # the configurations matter: one cache of the first choice for every row would answer differently
        wrong = [a.tokens for a in answer_batch_with(model, config, exs, groups[0][0], monkeypatch)]
        assert wrong != [a.tokens for a in batched]
        for ex, got in zip(exs, batched):
            (alone,) = answer_batch(model, config, [ex])
            scored.setdefault(task, []).append(bool(testbed_tasks.score(ex, alone.tokens)))
            assert got.tokens == alone.tokens and len(got.tokens) == new_tokens(ex)
            assert (got.factor, got.target) == (alone.factor, alone.target) and got.target == TARGET
    rows = evaluate(model, config, progress=False)
    single = evaluate(model, eval_config(protocol=protocol, batch_size=1), progress=False)
    keys = ("method", "protocol", "task", "accuracy", "n", "variants", "factor", "target", "compression", "budget",
            "distinct_configurations")
    assert [{k: r[k] for k in keys} for r in rows] == [{k: r[k] for k in keys} for r in single]
    assert len({r["factor"] for r in rows}) >= 1 and all(r["factor"] > 1.0 for r in rows)
    # the count of different configurations per task: a direct count of each prompt's own choice
    for r in rows:
        per_prompt = [choices_of(model, config, [ex])[0] for ex in examples_for(config, r["task"])]
        distinct = []
        for c in per_prompt:
            if all(c != d for d in distinct):
                distinct.append(c)
        assert r["distinct_configurations"] == len(distinct) >= 2
        # which configurations, with their prompt counts: the same direct count, as "b4 b8 share ..." strings
        counts = {str(d): sum(c == d for c in per_prompt) for d in distinct}
        assert r["configurations"] == dict(sorted(counts.items(), key=lambda kv: -kv[1])[:8])
        assert sum(r["configurations"].values()) <= r["n"] and all(" " in k for k in r["configurations"])
        # each configuration's accuracy: the prompts that chose it, each answered alone and scored
        ok = scored[r["task"]]
        assert r["configuration_accuracy"] == {
            str(d): sum(o for o, c in zip(ok, per_prompt) if c == d) / sum(c == d for c in per_prompt)
            for d in distinct if str(d) in r["configurations"]}
        assert sum(r["configuration_accuracy"][k] * n for k, n in r["configurations"].items()) == pytest.approx(
            r["accuracy"] * r["n"])  # every prompt's configuration is listed here (fewer than 8)


@pytest.mark.parametrize("method", ["kaizen", "kaizen_static", "kaizen_random", "kaizen_dp"])
def test_context_generates_what_bounded_generates(model, method):
    """Every token kept: both protocols attend the same stored (quantized, shared) keys and values."""
    for protocol in ("bounded", "context"):
        assert protocol in get_method(method).protocols
    bounded, context = eval_config(method, "bounded", tasks=("vt",), n=4), eval_config(method, "context",
                                                                                       tasks=("vt",), n=4)
    get_method(method).prepare(model, bounded.method_config)
    exs = examples_for(bounded, "vt")
    for a, b in zip(answer_batch(model, bounded, exs), answer_batch(model, context, exs)):
        assert a.tokens == b.tokens and a.factor == b.factor
    rb, rc = evaluate(model, bounded, progress=False), evaluate(model, context, progress=False)
    assert [(r["accuracy"], r["factor"]) for r in rb] == [(r["accuracy"], r["factor"]) for r in rc]
    if method != "kaizen":  # a prompt-independent configuration: one per task
        assert all(r["distinct_configurations"] == 1 for r in rb + rc)
    assert rc[0]["protocol"] == "context" and rc[0]["peak_kv_bytes"] > 0


def test_context_protocol_equals_dense_attention_on_the_stored_keys_and_values(model):
    """The independent reference: the no-cache forward of the configuration (anchors' K/V fake-quantized, sharing
    layers reading their anchor), i.e. full attention over the dequantized keys and values."""
    s = LayerAction.shared()
    cfg = KaizenConfig(Backbone.from_config(model.config), (LayerAction(4), s, LayerAction(8)))
    (ex,) = examples_for(eval_config(tasks=("vt",), n=1), "vt")
    batch = layout([ex], "context", 0, CHUNK)
    new = 6
    cache = KaizenCache(cfg, capacity=batch.ids.shape[1] + new + 1)
    width = batch.ids.shape[1]
    with torch.no_grad():
        prefill_columns(model, cache, batch, 0, batch.split, CHUNK, dense=True)
        prefill_columns(model, cache, batch, batch.split, width - 1, CHUNK, dense=False)
        out = model.generate(input_ids=batch.ids, attention_mask=batch.mask, past_key_values=cache,
                             max_new_tokens=new, do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
        real = torch.cat([torch.tensor(ex.prompt_ids), out.sequences[0, width:-1]])[None]
        ref = model(input_ids=real, use_cache=False, kaizen_config=cfg).logits
        plain = model(input_ids=real, use_cache=False).logits
    got = torch.stack(out.logits, dim=1)
    torch.testing.assert_close(got, ref[:, len(ex.prompt_ids) - 1:], atol=1e-4, rtol=1e-4)
    assert float((plain - ref).abs().max()) > 1e-3  # the configuration changes the model


def test_bad_input_is_one_line(model, monkeypatch):
    config = eval_config()
    exs = examples_for(config, "vt")
    choices = choices_of(model, config, exs)
    i = next(k for k, c in enumerate(choices) if c != choices[0])
    batch = layout([exs[0], exs[i]], "bounded", 0, CHUNK)
    with pytest.raises(KVLearnError, match="choose different KV-Kaizen configurations") as err:
        make_prompt_cache(config.method_config, model, batch.ids, batch.mask, 4)
    assert "\n" not in str(err.value)
    same = [k for k, c in enumerate(choices) if c == choices[0]]
    batch = layout([exs[k] for k in same], "bounded", 0, CHUNK)
    cache = make_prompt_cache(config.method_config, model, batch.ids, batch.mask, 4)  # rows that agree share one
    assert cache.config == choices[0] and cache.capacity == batch.ids.shape[1] + 5
    mask = batch.mask.clone()
    mask[0] = 0
    with pytest.raises(KVLearnError, match="at least one non-pad token") as err:
        prompt_choices(config.method_config, model, batch.ids, mask)
    assert "\n" not in str(err.value)
    # a negative number of new tokens would size the cache below the prompt's need: one line, for the learned
    # selector, a prompt-independent baseline and a composition (whose budget sizes its stores) alike
    from kvlearn.methods import get_method, make_config

    import kvlearn.kaizen.apply as kaizen_apply

    with monkeypatch.context() as m:  # refused before the selector reads the prompt
        m.setattr(kaizen_apply, "prompt_choices", lambda *a: pytest.fail("the selector ran before the check"))
        with pytest.raises(KVLearnError, match=r"max_new_tokens=-1 is invalid: expected an integer >= 0") as err:
            make_prompt_cache(config.method_config, model, batch.ids, batch.mask, -1)
    assert "\n" not in str(err.value)
    for name, options in (("kaizen_static", {"target": 4.0}),
                          ("kaizen+snapkv", {"budget": 64, "sinks": 4, "target": 16.0, "context": CONTEXT})):
        method = get_method(name)
        with pytest.raises(KVLearnError, match=r"max_new_tokens=-1 is invalid") as err:
            method.make_prompt_cache(make_config(name, **options), model, batch.ids, batch.mask, -1)
        assert "\n" not in str(err.value)
