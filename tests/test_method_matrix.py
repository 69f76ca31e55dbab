"""The contract every registered method meets, on tiny random GQA models of three families (kvpress-style matrix).

For every method of :mod:`kvlearn.methods` (skipped, with the reason, only while its module is not in this
checkout), every model class (Qwen3, Qwen2, Llama: float32, 2 layers, 2 KV heads, 4 query heads, head_dim 64: slot bookkeeping, 8 bytes per slot and KV head, stays within the 5%) and
every protocol the method defines, through the harness's prefill + ``generate`` path:

(a) generation runs; (b) a left-padded batch of 3 generates exactly the tokens of three single runs;
(c) ``get_seq_length()`` is the number of tokens seen; (d) the cache allocates at most
``(budget + 1) / tokens seen`` of the dense cache's bytes (+5% for slot bookkeeping).
A protocol the method does not define is a one-line error. Exact logits equivalence per method is tested with
each method (tests/eviction/).
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from kvlearn.errors import KVLearnError
from kvlearn.eval.accuracy import EvalConfig, cache_bytes
from kvlearn.eval.protocols import layout, run_batch
from kvlearn.hf import attach
from kvlearn.methods import MODULES, PROTOCOLS, get_method, make_config, method_names
from kvlearn.testbed import tasks
from kvlearn.testbed.tokenizer import VOCAB_SIZE

CONTEXT = 256
BUDGET = 48  # much smaller than the context; knorm, random, snapkv, pyramidkv protect sinks 4 + window 32
CHUNK = 64  # several prefill chunks per prompt
NEW = 5  # generated tokens

MODELS = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
          "llama": (LlamaConfig, LlamaForCausalLM)}
_CACHE: dict[str, torch.nn.Module] = {}


def tiny_model(kind: str):
    if kind not in _CACHE:
        config_cls, model_cls = MODELS[kind]
        torch.manual_seed(0)
        cfg = config_cls(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
                         pad_token_id=0, bos_token_id=None, eos_token_id=None, dtype="float32")
        model = model_cls(cfg).eval()
        assert model.config.head_dim == 64 if hasattr(model.config, "head_dim") else True
        _CACHE[kind] = attach(model)
    return _CACHE[kind]


def method_or_skip(name: str):
    try:
        method = get_method(name)
    except KVLearnError as e:
        pytest.skip(str(e))
    if not method.token_budget:
        pytest.skip(f"{name} is budgeted by a compression target (a KV-Kaizen configuration per prompt; kivi: "
                    "16 / target bits; kaizen+snapkv/kvpop: under eviction): its harness rows and "
                    "cache equivalence are tested in tests/kaizen/ (test_selector_train.py, test_batched_eval.py, "
                    "test_dp_search.py, test_compose.py, test_untrained_backbone_and_kivi.py)")
    return method


def examples():
    """Three examples of different families, so prompts (and final questions) differ in length."""
    return [tasks.generate(f, tasks.example_seed(f, "eval", 0), CONTEXT) for f in ("niah", "recall", "trace")]


def run(model, name: str, protocol: str, exs):
    m = get_method(name)
    config = make_config(name, budget=None if name == "dense" else BUDGET, sinks=4, context=CONTEXT)
    m.prepare(model, config)  # kvpop and dms add their (untrained) modules; the others attach
    cache = m.new_cache(model, config)
    batch = layout(exs, protocol, pad_id=0, chunk_size=CHUNK)
    out = run_batch(model, cache, batch, protocol, NEW, chunk_size=CHUNK, pad_id=0, eos_id=None)
    return out, cache, batch


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("name", method_names())
def test_method_contract(name, protocol, kind):
    method = method_or_skip(name)
    if protocol not in method.protocols:
        with pytest.raises(KVLearnError, match=f"does not define protocol '{protocol}'") as err:
            EvalConfig(method=name, budget=None if name == "dense" else BUDGET, context=CONTEXT, protocol=protocol)
        assert len(str(err.value).splitlines()) == 1
        return
    model = tiny_model(kind)
    exs = examples()
    out, cache, batch = run(model, name, protocol, exs)
    # (a) it ran and generated NEW tokens per row
    assert out.shape == (3, NEW)
    assert (batch.mask == 0).any()  # the batch really is padded
    # (c) tokens seen: every prompt column and all generated tokens but the last
    assert cache.get_seq_length() == batch.ids.shape[1] + NEW - 1
    for i, ex in enumerate(exs):
        single, single_cache, single_batch = run(model, name, protocol, [ex])
        # (b) a left-padded batch of 3 equals three single runs
        assert out[i].tolist() == single[0].tolist(), f"row {i} ({ex.family}) differs from its single run"
        # tokens seen count the layout's padding columns too (transformers slices input_ids by them)
        assert single_cache.get_seq_length() == single_batch.ids.shape[1] + NEW - 1
        assert int(single_batch.mask.sum()) == len(ex.prompt_ids)
        # (d) allocated bytes follow the budget
        if name != "dense":
            dense_out, dense_cache, _ = run(model, "dense", protocol, [ex])
            assert isinstance(dense_cache, DynamicCache)
            # the dense cache holds the tokens seen (a little under CONTEXT: the answer is not fully generated)
            bound = (BUDGET + 1) / dense_cache.get_seq_length() * cache_bytes(dense_cache) * 1.05
            assert cache_bytes(single_cache) <= bound, (cache_bytes(single_cache), bound)
            # the keys/values alone, by hand: layers x kv heads x capacity slots x head_dim x (K, V) x float32
            capacity = single_cache.layers[0].capacity
            assert capacity in (BUDGET, BUDGET + 1)
            assert cache_bytes(single_cache, keys_values_only=True) == 2 * 2 * capacity * 64 * 2 * 4


def test_every_registered_method_is_listed_with_its_protocols():
    assert method_names()[:2] == ("dense", "streaming")
    assert set(method_names()) == {"dense", "streaming", "tova", "h2o", "snapkv", "pyramidkv", "knorm", "random",
                                   "kvpop", "streaming_plus", "dms", "kaizen", "kaizen_static", "kaizen_random",
                                   "kaizen_dp", "kaizen+snapkv", "kaizen+kvpop", "kivi"}
    for name in method_names():
        try:
            m = get_method(name)
        except KVLearnError as e:
            assert len(str(e).splitlines()) == 1 and MODULES[name] in str(e)
            continue
        assert m.name == name and m.summary and "\n" not in m.summary
        assert m.protocols and set(m.protocols) <= set(PROTOCOLS)
        if name in ("snapkv", "pyramidkv"):
            assert m.protocols == ("context",)


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize("name", method_names())
def test_harness_rows_for_every_method_and_protocol(name, protocol):
    from kvlearn.eval.accuracy import evaluate

    method = method_or_skip(name)
    if protocol not in method.protocols:
        pytest.skip(f"{name} does not define {protocol} (its one-line error is tested above)")
    config = EvalConfig(method=name, budget=None if name == "dense" else BUDGET, context=CONTEXT, protocol=protocol,
                        tasks=("vt",), n_per_task=2, batch_size=2, chunk_size=CHUNK)
    (row,) = evaluate(tiny_model("qwen3"), config, progress=False)
    assert (row["method"], row["protocol"], row["split"], row["task"], row["n"]) == (name, protocol, "eval", "vt", 2)
    assert row["compression"] == (0.0 if name == "dense" else pytest.approx(1 - BUDGET / CONTEXT))
    assert row["kv_bytes"] > 0 and "incomplete" not in row
    assert 0 < row["store_bytes"] <= row["kv_bytes"] and (name != "dense" or row["store_bytes"] == row["kv_bytes"])
