"""Sharing MLA layers that attend their anchor's latent absorbed (:mod:`kvlearn.kaizen.mla_attention`, "Share
(depth)"), float32 tiny 4-layer models of :mod:`test_mla_conversion` (2 KV heads, 2 query heads per KV head,
head_dim 16; r = 64, d_R = 16).

- through a cache (a :class:`KaizenCache`, or a ``DynamicCache`` with ``kaizen_config=``), an anchor without
  ``k_norm`` (Llama, Qwen2 with biases) hands its sharers a :class:`SharedLatent`; prefill + token-by-token decoding
  with it equals the same decode with the old decompressed sharing (the anchor's ``full_keys`` ``(K, V, mask)``,
  forced) to 1e-5, at full rank and at ``d < r``, at 16 and 4 bits, and equals the no-cache forward to 1e-4;
- that path never expands the latent (``full_keys``/``expand`` raise there) and uses the anchor's projections only
  (perturbing the sharer's ``kv_down``, ``up_k``, ``up_v`` and ``E`` changes nothing);
- an anchor with ``k_norm`` (Qwen3) still shares decompressed (``full_keys`` is called, no ``SharedLatent``), and so
  does every anchor without a cache; both still equal the forward.
"""

import pytest
import torch
from transformers import DynamicCache

from kvlearn.kaizen import sharing
from kvlearn.kaizen.cache import make_cache
from kvlearn.kaizen.mla import convert_to_mla
from kvlearn.kaizen.mla_attention import MLAAttention

from test_mla_cache import ROPE, A, S, config, decode_through
from test_mla_conversion import FULL_RANK, VOCAB, calibration, tiny

SHARED = {  # 4-layer models; widths of r = 64: 8, 16, 32, 64
    "full rank, 16 bits": (A(16), S, A(16), S),
    "rank 16 < r, 16 bits": (A(16, 16), S, S, A(8, 32)),
    "full rank, 4 bits": (A(4), S, S, S),
    "rank 32 < r, 4 bits": (A(4, 32), S, A(16, 8), S),
}


def converted4(kind, seed=13):
    return sharing.attach(convert_to_mla(tiny(kind, seed, layers=4), ROPE, calibration()[0], rank=FULL_RANK))


def decompressed_sharing(monkeypatch):
    """Force the old sharing: the anchor (still attending absorbed itself) hands its expanded ``(K, V, mask)``."""
    monkeypatch.setattr(MLAAttention, "shared_latent", lambda self, k_r, c, mask: (*self.full_keys(k_r, c), mask))


def count_calls(monkeypatch, name):
    """Wrap ``MLAAttention.<name>``; returns the list its calls append to."""
    calls, original = [], getattr(MLAAttention, name)

    def wrapped(self, *args, **kwargs):
        calls.append(self.layer_idx)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(MLAAttention, name, wrapped)
    return calls


def decode_dynamic(model, cfg, ids, prompt):
    """Prefill + decoding through a plain ``DynamicCache`` under ``kaizen_config=`` (16 bits only)."""
    cache = DynamicCache()
    with torch.no_grad():
        out = [model(input_ids=ids[:, :prompt], past_key_values=cache, use_cache=True, kaizen_config=cfg).logits]
        out += [model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True, kaizen_config=cfg).logits
                for t in range(prompt, ids.shape[1])]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("name", list(SHARED))
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_absorbed_sharing_equals_decompressed_sharing_and_the_forward(kind, name, monkeypatch):
    model = converted4(kind)
    assert all(layer.self_attn.absorb for layer in model.model.layers)
    cfg = config(model, *SHARED[name])
    sharers = [l for l, a in enumerate(cfg.actions) if a.share]
    ids = torch.randint(1, VOCAB, (2, 16), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False, kaizen_config=cfg).logits
    steps = 1 + 16 - 6
    with monkeypatch.context() as m:
        calls = count_calls(m, "attend_shared")
        absorbed = decode_through(model, make_cache(cfg, model.config, capacity=20), ids, 6)
        assert sorted(calls) == sorted(sharers * steps)  # every sharer, every forward, took the absorbed path
        if all(a.bits == 16 for a in cfg.actions):
            torch.testing.assert_close(decode_dynamic(model, cfg, ids, 6), absorbed, atol=1e-5, rtol=1e-5)
    with monkeypatch.context() as m:
        decompressed_sharing(m)
        calls = count_calls(m, "attend_shared")
        decompressed = decode_through(model, make_cache(cfg, model.config, capacity=20), ids, 6)
        assert calls == []
    torch.testing.assert_close(absorbed, decompressed, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(absorbed, ref, atol=1e-4, rtol=1e-4)


def test_the_absorbed_sharer_never_expands_the_latent_and_uses_the_anchors_projections(monkeypatch):
    model = converted4("llama", 21)
    cfg = config(model, *SHARED["rank 16 < r, 16 bits"])
    ids = torch.randint(1, VOCAB, (2, 14), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False, kaizen_config=cfg).logits  # decompressed (no cache): expands

    def refuse(self, *args, **kwargs):
        raise AssertionError(f"layer {self.layer_idx} expanded the latent")

    with monkeypatch.context() as m:
        m.setattr(MLAAttention, "full_keys", refuse)
        m.setattr(MLAAttention, "expand", refuse)
        got = decode_through(model, make_cache(cfg, model.config, capacity=16), ids, 5)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        with torch.no_grad():  # the sharer's own latent projections and RoPE mixing are unused
            for l, a in enumerate(cfg.actions):
                if a.share:
                    attn = model.model.layers[l].self_attn
                    for p in (attn.kv_down.weight, attn.up_k, attn.up_v, attn.rope_mix):
                        p.normal_()
        after = decode_through(model, make_cache(cfg, model.config, capacity=16), ids, 5)
    torch.testing.assert_close(after, got, atol=1e-6, rtol=0)


def test_an_anchor_with_k_norm_still_shares_decompressed(monkeypatch):
    model = converted4("qwen3", 22)
    assert not any(layer.self_attn.absorb for layer in model.model.layers)
    cfg = config(model, *SHARED["rank 32 < r, 4 bits"])
    ids = torch.randint(1, VOCAB, (2, 14), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False, kaizen_config=cfg).logits
    full_keys = count_calls(monkeypatch, "full_keys")
    shared = count_calls(monkeypatch, "attend_shared")
    got = decode_through(model, make_cache(cfg, model.config, capacity=16), ids, 5)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert full_keys == [0, 2] * (1 + 14 - 5) and shared == []  # both anchors expand at every step


def test_without_a_cache_an_absorbing_model_still_shares_decompressed(monkeypatch):
    """``use_cache=False`` (fake-quantized, the training path) keeps the decompressed sharing."""
    model = converted4("llama", 23)
    cfg = config(model, *SHARED["full rank, 4 bits"])
    full_keys = count_calls(monkeypatch, "full_keys")
    shared = count_calls(monkeypatch, "attend_shared")
    with torch.no_grad():
        model(input_ids=torch.randint(1, VOCAB, (1, 8)), use_cache=False, kaizen_config=cfg)
    assert full_keys == [0] and shared == []
