"""Attention-driven methods end to end against an independent reference: a masking simulation (full K/V in a
``DynamicCache``, an eager attention function that keeps the alive set of every (layer, KV head) and applies the
method's rule after attending), written from the papers' rules with none of the cache code. The compact cache
(prefill in one forward, then token by token) must give the same logits."""

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
