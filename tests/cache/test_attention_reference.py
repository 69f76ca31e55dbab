"""Every scored method end to end against an independent reference. Attention-driven methods: against: a masking simulation (full K/V in a
``DynamicCache``, an eager attention function that keeps the alive set of every (layer, KV head) and applies the
method's rule after attending), written from the papers' rules with none of the cache code; the compact cache
(prefill in one forward, then token by token) must give the same logits. Static-score methods (knorm, random):
against the rule applied to every query of one full-sequence forward."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache

from kvlearn.eviction import h2o, snapkv, tova
from kvlearn.hf import attach

from test_policies import VOCAB, tiny_model

CASES = {
    "tova": (tova, dict(budget=7)),
    "h2o": (h2o, dict(budget=7, window=3)),
    "snapkv": (snapkv, dict(budget=9, window=3, kernel_size=5)),
}


class Reference:
    """The eviction rule as a masking simulation over the full sequence (batch 1)."""

    def __init__(self, name, cfg):
        self.name, self.cfg = name, cfg
        self.alive, self.acc, self.selected = {}, {}, {}

    def __call__(self, module, query, key, value, attention_mask, scaling=None, **kwargs):
        i, cfg = module.layer_idx, self.cfg
        b, hq, q, d = query.shape
        hkv, t = key.shape[1], key.shape[2]
        g = hq // hkv
        grow = lambda x, fill: torch.cat([x, torch.full((b, hkv, t - x.shape[2]), fill, dtype=x.dtype)], 2)
        alive = grow(self.alive.get(i, torch.ones(b, hkv, 0, dtype=torch.bool)), True)
        acc = grow(self.acc.get(i, torch.zeros(b, hkv, 0)), 0.0)
        selected = grow(self.selected.get(i, torch.zeros(b, hkv, 0, dtype=torch.bool)), False)
        kpos, qpos = torch.arange(t), torch.arange(t - q, t)
        vis = (kpos[None, :] <= qpos[:, None])[None, None] & alive[:, :, None, :]  # [b, hkv, q, t]
        logits = torch.einsum("bhgqd,bhkd->bhgqk", query.reshape(b, hkv, g, q, d), key) * scaling
        probs = logits.masked_fill(~vis[:, :, None], float("-inf")).softmax(-1)
        out = torch.einsum("bhgqk,bhkd->bhgqd", probs, value).reshape(b, hq, q, d)
        last = t - 1
        eligible = alive & (kpos >= cfg.sinks) & (kpos <= last - cfg.window)
        if self.name == "tova":
            score = probs[:, :, :, -1].mean(2)
        elif self.name == "h2o":
            acc = acc + probs.sum(3).sum(2)
            score = acc
        elif q > 1:  # snapkv prefill: window attention, prefix only, avg-pooled
            prefix = kpos <= last - cfg.window
            a = torch.where(prefix, probs[:, :, :, -cfg.window:].sum(3).mean(2), torch.zeros(()))
            score = F.avg_pool1d(a.reshape(b * hkv, 1, t), cfg.kernel_size, 1, cfg.kernel_size // 2).reshape(b, hkv, t)
        else:  # snapkv decoding: the oldest token the prefill did not select
            score = torch.where(selected, torch.full((), float("inf")), kpos.float().expand(b, hkv, t))
        if q == 1:
            if int(alive.sum(-1).max()) > cfg.budget:
                for bi in range(b):
                    for h in range(hkv):
                        cands = [j for j in range(t) if eligible[bi, h, j]]
                        victim = min(cands, key=lambda j: (float(score[bi, h, j]), -j))
                        alive[bi, h, victim] = False
        else:
            for bi in range(b):
                for h in range(hkv):
                    cands = sorted((j for j in range(t) if eligible[bi, h, j]), key=lambda j: -float(score[bi, h, j]))
                    n_protected = int((alive[bi, h] & ~eligible[bi, h]).sum())
                    for j in cands[cfg.budget - n_protected:]:
                        alive[bi, h, j] = False
                    selected[bi, h] = alive[bi, h] & eligible[bi, h]
        self.alive[i], self.acc[i], self.selected[i] = alive, acc, selected
        return out.transpose(1, 2).contiguous(), None


@pytest.mark.parametrize("name", list(CASES))
def test_cache_equals_masking_simulation(name):
    mod, kwargs = CASES[name]
    cfg = mod.CONFIG(**kwargs)
    model = attach(tiny_model(7))
    ids = torch.randint(1, VOCAB, (1, 30))
    n = 14
    AttentionInterface.register("kvlearn_reference_test", Reference(name, cfg))
    model.set_attn_implementation("kvlearn_reference_test")
    try:
        with torch.no_grad():
            cache = DynamicCache()
            ref = [model(input_ids=ids[:, :n], past_key_values=cache, use_cache=True).logits]
            ref += [model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(n, 30)]
    finally:
        attach(model)
    cache = mod.make_cache(cfg, model.config)
    with torch.no_grad():
        with cache.dense():
            got = [model(input_ids=ids[:, :n], past_key_values=cache, use_cache=True).logits]
        got += [model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(n, 30)]
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(ref, 1), atol=1e-4, rtol=1e-4)


def static_rule_attention(score_fn, cfg):
    """Reference for static-score methods over the full sequence: query p sees t <= p iff t is a sink, is in the
    window, or is among the top-k scores (earlier token first on ties) of the eligible set {sinks <= t <= p - w}."""

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        b, hq, t, d = query.shape
        hkv = key.shape[1]
        score = score_fn(module.layer_idx, key)  # [b, hkv, t]
        mask = torch.zeros(b, hkv, t, t, dtype=torch.bool)
        for p in range(t):
            mask[:, :, p, : p + 1] = True
            eligible = list(range(cfg.sinks, p - cfg.window + 1))
            for bi in range(b):
                for h in range(hkv):
                    ranked = sorted(eligible, key=lambda j: (-float(score[bi, h, j]), j))
                    for j in ranked[cfg.topk:]:
                        mask[bi, h, p, j] = False
        g = hq // hkv
        out = F.scaled_dot_product_attention(query, key.repeat_interleave(g, 1), value.repeat_interleave(g, 1),
                                             attn_mask=mask.repeat_interleave(g, 1), scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    return attention


@pytest.mark.parametrize("name", ["knorm", "random"])
def test_static_methods_equal_their_rule_over_the_full_sequence(name):
    """Bounded protocol: chunked prefill (chunks of 5) then decoding equals the rule applied per query."""
    from kvlearn.eviction import knorm
    from kvlearn.eviction import random as random_method

    if name == "knorm":
        mod, cfg = knorm, knorm.KnormConfig(budget=8, sinks=2, window=3)
        score_fn = lambda layer, key: -key.float().norm(dim=-1)
    else:
        mod, cfg = random_method, random_method.RandomConfig(budget=8, sinks=2, window=3, seed=5)
        score_fn = lambda layer, key: random_method.hashed_scores(5, layer, key.shape[1],
                                                                  torch.arange(key.shape[2])[None].expand(key.shape[0], -1))
    model = attach(tiny_model(8))
    ids = torch.randint(1, VOCAB, (2, 30))
    n = 14
    AttentionInterface.register("kvlearn_static_reference_test", static_rule_attention(score_fn, cfg))
    model.set_attn_implementation("kvlearn_static_reference_test")
    try:
        with torch.no_grad():
            ref = model(input_ids=ids).logits
    finally:
        attach(model)
    cache = mod.make_cache(cfg, model.config)
    with torch.no_grad():
        got = [model(input_ids=ids[:, a:min(a + 5, n)], past_key_values=cache, use_cache=True).logits for a in range(0, n, 5)]
        got += [model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(n, 30)]
    torch.testing.assert_close(torch.cat(got, 1), ref, atol=1e-4, rtol=1e-4)


def test_tova_chunked_prefill_with_sinks_keeps_what_the_literal_rule_keeps():
    """TOVA as evaluated (``bounded`` protocol: chunked prefill, then decoding; sinks > 0; GQA; 2 rows): after every
    forward, each (row, layer, KV head) holds exactly the alive set of the masking simulation, and the logits agree."""
    cfg = tova.TOVAConfig(budget=7, sinks=2)
    model = attach(tiny_model(9))
    ids = torch.randint(1, VOCAB, (2, 30))
    spans = [(a, min(a + 5, 14)) for a in range(0, 14, 5)] + [(t, t + 1) for t in range(14, 30)]
    reference = Reference("tova", cfg)
    AttentionInterface.register("kvlearn_tova_chunk_reference_test", reference)
    model.set_attn_implementation("kvlearn_tova_chunk_reference_test")
    ref_logits, ref_alive = [], []
    try:
        with torch.no_grad():
            dense = DynamicCache()
            for a, z in spans:
                ref_logits.append(model(input_ids=ids[:, a:z], past_key_values=dense, use_cache=True).logits)
                ref_alive.append([reference.alive[i].clone() for i in range(2)])  # [b, kv_heads, z] per layer
    finally:
        attach(model)
    cache = tova.make_cache(cfg, model.config)
    got_logits = []
    with torch.no_grad():
        for (a, z), alive in zip(spans, ref_alive):
            got_logits.append(model(input_ids=ids[:, a:z], past_key_values=cache, use_cache=True).logits)
            for layer, expect in zip(cache.layers, alive):
                pos = layer.slot_positions.long()  # [b, kv_heads, capacity], -1 = empty (goes to column z)
                held = torch.zeros(*expect.shape[:2], z + 1, dtype=torch.bool)
                held.scatter_(2, torch.where(pos >= 0, pos, z), True)
                assert torch.equal(held[..., :z], expect), (z, torch.nonzero(held[..., :z] != expect).tolist())
    torch.testing.assert_close(torch.cat(got_logits, 1), torch.cat(ref_logits, 1), atol=1e-4, rtol=1e-4)
