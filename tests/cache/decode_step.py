"""A self-contained decode step of a compact cache, shared by the CPU no-sync test and the GPU compile test.

``decode_case(name, device, store_factory=None)`` builds a one-layer cache of the method ``name`` (on the store
``store_factory`` returns; the plain store by default), fills it past its budget with a
prefill and a few decode steps, and returns ``(cache, step_fn, inputs)``: ``step_fn(*inputs)`` runs one decode step
exactly as the model would (``begin_forward`` -> ``update`` -> :func:`kvlearn.hf.kvlearn_attention`) and returns the
attention output and the layer's slot positions after the step.
"""

import copy
from types import SimpleNamespace

import torch

from kvlearn.eviction import h2o, knorm, streaming, tova
from kvlearn.hf import kvlearn_attention

B, HKV, G, D = 2, 2, 2, 16


def kvpop_cache(scorer, num_layers=1, device="cpu"):
    """A KVpop cache (sinks 2, window 3, top-3) of a tiny random GQA Qwen3 with ``scorer`` (``mlp`` or ``mlstm``,
    delayed readout) applied: its shapes are the decode case's (2 KV heads of 16, 2 query heads per KV head)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kvlearn.config import KVpopConfig
    from kvlearn.kvpop.apply import apply_kvpop, make_kvpop_cache

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=num_layers,
                         num_attention_heads=HKV * G, num_key_value_heads=HKV, head_dim=D)
    model = Qwen3ForCausalLM(config)
    apply_kvpop(model, KVpopConfig(sinks=2, window=3, topk=3, scorer=scorer))
    model.to(device)  # the cache's scorers and decays run where the keys are
    return make_kvpop_cache(model)


def make_cache(name, num_layers=1, store_factory=None, device="cpu"):
    one = SimpleNamespace(num_hidden_layers=num_layers)
    if name.startswith("kvpop_"):  # kvpop_mlp, kvpop_mlstm: the model's own scorers (plain store only)
        assert store_factory is None, "the KVpop cache takes the plain store here"
        return kvpop_cache(name.removeprefix("kvpop_"), num_layers, device)
    if name == "streaming":
        return streaming.make_cache(streaming.StreamingConfig(budget=8, sinks=2), one, store_factory=store_factory)
    if name == "tova":
        return tova.make_cache(tova.TOVAConfig(budget=8), one, store_factory=store_factory)
    if name == "h2o":
        return h2o.make_cache(h2o.H2OConfig(budget=8, window=3), one, store_factory=store_factory)
    return knorm.make_cache(knorm.KnormConfig(budget=8, sinks=2, window=3), one, store_factory=store_factory)


def decode_case(name, device, seed=0, store_factory=None):
    gen = torch.Generator().manual_seed(seed)
    cache = make_cache(name, store_factory=store_factory, device=device)
    module = SimpleNamespace(layer_idx=0)
    seen = 0
    for q in (11, 1, 1, 1):  # past the budget: decoding evicts
        k = torch.randn(B, HKV, q, D, generator=gen).to(device)
        mask = torch.ones(B, seen + q, dtype=torch.long, device=device)
        mask[1, :2] = 0  # row 1 is left-padded
        cache.begin_forward(mask, B, q, device)
        keys, values = cache.update(k, k * 0.5, 0)
        kvlearn_attention(module, torch.randn(B, HKV * G, q, D, generator=gen).to(device), keys, values, None,
                          scaling=D ** -0.5, kvlearn_cache=cache)
        seen += q
    k = torch.randn(B, HKV, 1, D, generator=gen).to(device)
    query = torch.randn(B, HKV * G, 1, D, generator=gen).to(device)
    mask = torch.ones(B, seen + 1, dtype=torch.long, device=device)
    mask[1, :2] = 0

    def step_fn(cache, mask, k, query):
        cache.begin_forward(mask, B, 1, mask.device)
        keys, values = cache.update(k, k * 0.5, 0)
        out, _ = kvlearn_attention(module, query, keys, values, None, scaling=D ** -0.5, kvlearn_cache=cache)
        return out, cache.layers[0].slot_positions.clone()

    return cache, step_fn, (mask, k, query)


def clone_cache(cache):
    return copy.deepcopy(cache)
