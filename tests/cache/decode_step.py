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


def make_cache(name, num_layers=1, store_factory=None):
    one = SimpleNamespace(num_hidden_layers=num_layers)
    if name == "streaming":
        return streaming.make_cache(streaming.StreamingConfig(budget=8, sinks=2), one, store_factory=store_factory)
    if name == "tova":
        return tova.make_cache(tova.TOVAConfig(budget=8), one, store_factory=store_factory)
    if name == "h2o":
        return h2o.make_cache(h2o.H2OConfig(budget=8, window=3), one, store_factory=store_factory)
    return knorm.make_cache(knorm.KnormConfig(budget=8, sinks=2, window=3), one, store_factory=store_factory)


def decode_case(name, device, seed=0, store_factory=None):
    gen = torch.Generator().manual_seed(seed)
    cache = make_cache(name, store_factory=store_factory)
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
