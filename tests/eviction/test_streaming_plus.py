"""StreamingLLM+ (the KVpop paper's baseline): the training attention is the streaming rule, so a model distilled
under it decodes through the streaming cache with the same logits.

References: the brute-force streaming mask of tests/eviction/test_streaming.py (Python loops) and the streaming
cache; a tiny random GQA Qwen3 (2 KV heads, 2 query heads per KV head)."""

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from kvlearn import KVLearnError, StreamingConfig
from kvlearn.eviction.streaming import StreamingCache
from kvlearn.eviction.streaming_plus import (streaming_mask_dense, streaming_mask_mod, streaming_train_attention,
                                             use_train_attention)
from kvlearn.hf import attach
from kvlearn.methods import get_method, make_config

VOCAB = 97


def tiny(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    return Qwen3ForCausalLM(cfg).eval()


def brute_mask(T, sinks, window):
    m = torch.zeros(T, T, dtype=torch.bool)
    for q in range(T):
        for k in range(q + 1):
            m[q, k] = k < sinks or q - k < window
    return m


@pytest.mark.parametrize("T,sinks,window", [(1, 0, 1), (17, 3, 5), (40, 0, 7), (33, 4, 40)])
def test_mask_mod_and_dense_twin_equal_brute_force(T, sinks, window):
    assert torch.equal(streaming_mask_dense(T, sinks, window), brute_mask(T, sinks, window))
    mod = streaming_mask_mod(sinks, window)
    for q in range(min(T, 12)):
        for k in range(T):
            assert bool(mod(0, 0, torch.tensor(q), torch.tensor(k))) == bool(brute_mask(T, sinks, window)[q, k])


@pytest.mark.parametrize("prefill", [1, 6, 23])
def test_training_attention_equals_the_streaming_cache(prefill):
    config = StreamingConfig(budget=9, sinks=3)
    model = tiny()
    ids = torch.randint(1, VOCAB, (2, 40))
    with torch.no_grad():
        dense_ref = model(input_ids=ids, attention_mask=brute_mask(40, 3, 6)[None, None].expand(2, 1, 40, 40)).logits
        full = model(input_ids=ids).logits
    use_train_attention(model)
    with torch.no_grad():
        trained = model(input_ids=ids, streaming_train=config).logits
        plain = model(input_ids=ids).logits  # without the keyword: plain SDPA
    torch.testing.assert_close(trained, dense_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(plain, full, atol=1e-6, rtol=1e-6)
    assert (trained - full).abs().max() > 1e-3  # the mask binds
    attach(model)
    cache = StreamingCache(config, 2)
    got = []
    with torch.no_grad():
        got.append(model(input_ids=ids[:, :prefill], past_key_values=cache, use_cache=True).logits)
        for t in range(prefill, 40):
            got.append(model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(got, 1), trained, atol=1e-4, rtol=1e-4)


def test_registry_entry_and_bad_input():
    m = get_method("streaming_plus")
    assert m.protocols == ("bounded", "context") and m.config_cls is StreamingConfig
    config = make_config("streaming_plus", budget=48, sinks=4, context=256)
    model = attach(tiny())
    m.prepare(model, config)
    assert model.config.streaming_plus == {"budget": 48, "sinks": 4, "window": 44}
    assert isinstance(m.new_cache(model, config), StreamingCache)
    with pytest.raises(KVLearnError) as err:
        make_config("streaming_plus", budget=4, sinks=4, context=256)
    msg = str(err.value)
    assert "\n" not in msg and "budget=4" in msg and ">= 5" in msg
    with pytest.raises(KVLearnError) as err:
        make_config("streaming_plus", budget=300, sinks=4, context=256)
    assert "budget=300" in str(err.value) and "context = 256" in str(err.value)
    with pytest.raises(KVLearnError) as err:
        streaming_train_attention(model.model.layers[0].self_attn, torch.zeros(1, 4, 3, 16), torch.zeros(1, 2, 3, 16),
                                  torch.zeros(1, 2, 3, 16), None, streaming_train={"budget": 9})
    assert "expected a StreamingConfig" in str(err.value)


def test_flex_execution_equals_the_dense_twin():
    from kvlearn.eviction.streaming_plus import streaming_attention

    torch.manual_seed(5)
    q, k, v = torch.randn(2, 4, 200, 16), torch.randn(2, 2, 200, 16), torch.randn(2, 2, 200, 16)
    with torch.no_grad():  # FlexAttention has no CPU backward
        dense = streaming_attention(q, k, v, 4, 60, backend="dense")
        flex = streaming_attention(q, k, v, 4, 60, backend="flex")
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_flex_execution_equals_the_dense_twin_with_gradients_on_cuda():
    from kvlearn.eviction.streaming_plus import streaming_attention

    torch.manual_seed(5)
    q, k, v = (torch.randn(2, h, 300, 16, device="cuda", requires_grad=True) for h in (4, 2, 2))
    outs = [streaming_attention(q, k, v, 4, 60, backend=b) for b in ("dense", "flex")]
    grads = [torch.autograd.grad(o.square().sum(), (q, k, v)) for o in outs]
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)
    for a, b in zip(grads[1], grads[0]):
        torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)
