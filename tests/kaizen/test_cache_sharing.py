"""The heterogeneous KV-Kaizen cache and cross-layer sharing on a tiny random GQA Qwen3 (float32, 4 layers, 2 KV
heads, 4 query heads, head_dim 16).

- a forward with ``use_cache=False`` (anchors' K/V fake-quantized, sharing through the per-forward anchor dictionary)
  equals prefill + token-by-token decoding through a :class:`KaizenCache` (sharing through the anchor's store), and
  equals ``generate()`` through the cache, to 1e-4; a left-padded batch equals its rows alone;
- the cache holds exactly the bytes of the cost model (hand-computed case), within 1% with the bookkeeping at
  8 KV heads of 128; a shared layer holds 0 bytes;
- training: gradients flow to a shared layer's anchor through the dictionary; bad input is a one-line error.
"""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from kvlearn import KVLearnError
from kvlearn.cache import BorrowedLayer, PackedStore, PlainStore
from kvlearn.kaizen import sharing
from kvlearn.kaizen.actions import Backbone, KaizenConfig, LayerAction
from kvlearn.kaizen.cache import KaizenCache, make_cache

VOCAB = 64
S = LayerAction.shared()


def tiny(seed=0, layers=4, kv_heads=2, heads=4, head_dim=16):
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=256, attn_implementation="sdpa")
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.k_norm.weight.uniform_(0.25, 2.0)
    return sharing.attach(model)


def config(model, *actions):
    return KaizenConfig(Backbone.from_config(model.config, scale_bits=32), actions)


CONFIGS = {
    "sharing, 16 bits": (LayerAction(16), S, LayerAction(16), S),
    "sharing, mixed bits": (LayerAction(8), S, S, LayerAction(4)),
    "mixed bits, no sharing": (LayerAction(2), LayerAction(16), LayerAction(4), LayerAction(8)),
    "one anchor": (LayerAction(4), S, S, S),
}


def decode_through(model, cache, ids, prompt):
    with torch.no_grad():
        out = [model(input_ids=ids[:, :prompt], past_key_values=cache, use_cache=True).logits]
        out += [model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits
                for t in range(prompt, ids.shape[1])]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_no_cache_forward_equals_decoding_through_the_cache(name):
    model = tiny(1)
    cfg = config(model, *CONFIGS[name])
    ids = torch.randint(1, VOCAB, (2, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False, kaizen_config=cfg).logits
        plain = model(input_ids=ids, use_cache=False).logits  # no configuration: the uncompressed model
    cache = make_cache(cfg, model.config, capacity=32)
    got = decode_through(model, cache, ids, 11)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert float((ref - plain).abs().max()) > 1e-3  # the configuration changes the model
    assert cache.get_seq_length() == 30
    for layer, action in zip(cache.layers, cfg.actions):
        if action.share:
            assert isinstance(layer, BorrowedLayer) and layer.allocated_bytes() == 0
        else:
            assert isinstance(layer.store, PlainStore if action.bits == 16 else PackedStore)


def test_generate_through_the_cache_equals_the_no_cache_forward():
    model = tiny(3)
    cfg = config(model, *CONFIGS["sharing, mixed bits"])
    ids = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = model.generate(input_ids=ids, past_key_values=make_cache(cfg, model.config, capacity=16),
                             max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True,
                             return_dict_in_generate=True)
        ref = model(input_ids=out.sequences[:, :-1], use_cache=False, kaizen_config=cfg).logits
    got = torch.stack(out.logits, dim=1)
    torch.testing.assert_close(got, ref[:, 8:], atol=1e-4, rtol=1e-4)


def test_sharing_without_quantization_is_reading_the_anchor():
    """A sharing layer attends its own queries over the anchor's K/V: replacing its k_proj/v_proj does nothing."""
    model = tiny(5)
    cfg = config(model, LayerAction(16), S, LayerAction(16), S)
    ids = torch.randint(1, VOCAB, (1, 12))
    with torch.no_grad():
        before = model(input_ids=ids, kaizen_config=cfg, use_cache=False).logits
        for l in (1, 3):
            model.model.layers[l].self_attn.k_proj.weight.normal_()
            model.model.layers[l].self_attn.v_proj.weight.normal_()
        after = model(input_ids=ids, kaizen_config=cfg, use_cache=False).logits
        changed = model(input_ids=ids, use_cache=False).logits
    torch.testing.assert_close(after, before, atol=1e-6, rtol=0)
    assert float((changed - before).abs().max()) > 1e-3


def test_gradients_reach_the_anchor_through_the_dictionary():
    model = tiny(6)
    model.train()
    cfg = config(model, LayerAction(4), S, S, S)
    ids = torch.randint(1, VOCAB, (2, 10))
    loss = model(input_ids=ids, labels=ids, kaizen_config=cfg, use_cache=False).loss
    loss.backward()
    attn = model.model.layers
    assert attn[0].self_attn.k_proj.weight.grad.abs().sum() > 0  # the anchor: straight-through fake quantization
    assert attn[1].self_attn.q_proj.weight.grad.abs().sum() > 0
    assert attn[1].self_attn.k_proj.weight.grad is None or attn[1].self_attn.k_proj.weight.grad.abs().sum() == 0


def test_allocated_bytes_equal_the_cost_model_exactly():
    model = tiny(7)
    cfg = config(model, LayerAction(4), S, LayerAction(16), LayerAction(2))
    cache = make_cache(cfg, model.config, capacity=40)
    with torch.no_grad():
        model(input_ids=torch.randint(1, VOCAB, (2, 13)), past_key_values=cache, use_cache=True)
    # per (batch row, KV head, slot), float32: b4 = 8 + 8 code bytes + 2 scales of 4; b16 = 2 x 16 x 4; b2 = 4 + 4 + 8
    per_slot = (8 + 8 + 8) + 0 + 128 + (4 + 4 + 8)
    assert cache.store_bytes() == 2 * 2 * 40 * per_slot == cfg.cache_bytes(batch=2, tokens=40, dtype_bits=32)
    assert cache.allocated_bytes() == cache.store_bytes() + 3 * 2 * 40 * 4  # + int32 slot positions, own layers
    assert cache.layers[1].allocated_bytes() == 0


def test_allocated_bytes_within_one_percent_at_real_head_sizes():
    model = tiny(8, kv_heads=8, heads=8, head_dim=128)
    cfg = config(model, LayerAction(4), S, LayerAction(8), LayerAction(2))
    cache = make_cache(cfg, model.config, capacity=64)
    with torch.no_grad():
        model(input_ids=torch.randint(1, VOCAB, (1, 5)), past_key_values=cache, use_cache=True)
    expected = cfg.cache_bytes(batch=1, tokens=64, dtype_bits=32)
    assert cache.store_bytes() == expected
    assert expected <= cache.allocated_bytes() <= 1.01 * expected
    assert cfg.compression(metadata=False) == pytest.approx(4 * 16 / (4 + 0 + 8 + 2))


def test_bad_input_is_refused_in_one_line():
    model = tiny(9)
    other = Backbone(num_layers=4, kv_heads=4, head_dim=16)
    cases = [
        (lambda: make_cache(KaizenConfig.static(other, 4), model.config, 8), "is for .* the model has"),
        (lambda: model(input_ids=torch.ones(1, 3, dtype=torch.long), kaizen_config="b4"), "is not a KaizenConfig"),
        (lambda: KaizenCache(config(model, *CONFIGS["one anchor"]), capacity=0), "capacity=0 is invalid"),
    ]
    for make, message in cases:
        with pytest.raises(KVLearnError, match=message) as err:
            make()
        assert "\n" not in str(err.value)
    cache = make_cache(config(model, *CONFIGS["one anchor"]), model.config, capacity=8)
    with torch.no_grad(), pytest.raises(KVLearnError, match="exceed the capacity of this full cache .8 slots"):
        model(input_ids=torch.ones(1, 9, dtype=torch.long), past_key_values=cache, use_cache=True)


def assert_padded_batch_equals_rows_alone(model, cfg, max_new_tokens: int = 5) -> None:
    """A left-padded batch of two prompts (11 and 6 tokens) generates, through KaizenCaches of ``cfg``, what each
    prompt generates alone: the same tokens and logits to 1e-4."""
    rows = [torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(n)) for n in (11, 6)]
    ids = torch.zeros(2, 11, dtype=torch.long)
    am = torch.zeros(2, 11, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, 11 - len(r):], am[i, 11 - len(r):] = r, 1
    kw = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, output_logits=True,
              return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=am, past_key_values=make_cache(cfg, model.config, 16), **kw)
        for i, r in enumerate(rows):
            solo = model.generate(input_ids=r[None], past_key_values=make_cache(cfg, model.config, 16), **kw)
            assert out.sequences[i, 11:].tolist() == solo.sequences[0, len(r):].tolist()
            for a, b in zip(out.logits, solo.logits):
                torch.testing.assert_close(a[i], b[0], atol=1e-4, rtol=1e-4)


def test_padded_batch_equals_rows_alone():
    model = tiny(10)
    assert_padded_batch_equals_rows_alone(model, config(model, *CONFIGS["sharing, mixed bits"]))


def test_eviction_composes_with_the_configuration():
    """``policy_factory``: a streaming policy under every own layer. Token by token (every forward attends the store)
    a 4-bit configuration equals a streaming cache on PackedStore(4); with sharing, the sharing layers follow their
    anchor's evictions and hold nothing."""
    from kvlearn.eviction import streaming

    model = tiny(11)
    scfg = streaming.StreamingConfig(budget=9, sinks=2)
    ids = torch.randint(1, VOCAB, (2, 24), generator=torch.Generator().manual_seed(5))
    policy = lambda l: streaming.StreamingPolicy(scfg)  # noqa: E731
    got = decode_through(model, KaizenCache(KaizenConfig.static(Backbone.from_config(model.config), 4), 9, policy),
                         ids, 1)
    ref = decode_through(model, streaming.make_cache(scfg, model.config, store_factory=lambda: PackedStore(4)), ids, 1)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    cache = KaizenCache(config(model, LayerAction(8), S, LayerAction(4), S), 9, policy)
    shared = decode_through(model, cache, ids, 10)
    assert bool(torch.isfinite(shared).all()) and cache.get_seq_length() == 24
    assert cache.layers[1].allocated_bytes() == 0 and cache.layers[0].store.shape[2] == 9
