"""Cache contract of the sinks + window cache against a dense-mask forward of the same policy."""

import pytest
import torch
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

from kvlearn import KVLearnError, StreamingConfig
from kvlearn.eviction.streaming import StreamingCache
from kvlearn.hf import attach


def tiny_model(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen3Config(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, attn_implementation="sdpa",
    )
    return Qwen3ForCausalLM(cfg).eval()


def streaming_dense_mask(valid: torch.Tensor, sinks: int, window: int) -> torch.Tensor:
    """Brute-force [batch, 1, T, T] bool mask of the streaming policy over real-token positions (pads see themselves)."""
    b, t = valid.shape
    mask = torch.zeros(b, 1, t, t, dtype=torch.bool)
    for i in range(b):
        pos = (valid[i].long().cumsum(0) - 1).tolist()
        for qi in range(t):
            if not valid[i, qi]:
                mask[i, 0, qi, qi] = True
                continue
            for kj in range(qi + 1):
                if valid[i, kj] and (pos[kj] < sinks or pos[qi] - pos[kj] < window):
                    mask[i, 0, qi, kj] = True
    return mask


def dense_logits(model, ids, valid, sinks, window):
    pos = (valid.long().cumsum(1) - 1).clamp(min=0)
    mask = streaming_dense_mask(valid, sinks, window)
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask, position_ids=pos).logits


@pytest.mark.parametrize("prefill", [1, 5, 23])
def test_decode_logits_equal_dense_mask_forward(prefill):
    model = attach(tiny_model())
    cfg = StreamingConfig(budget=9, sinks=3)
    torch.manual_seed(1)
    ids = torch.randint(1, 97, (1, 40))
    valid = torch.ones_like(ids, dtype=torch.bool)
    ref = dense_logits(model, ids, valid, cfg.sinks, cfg.window)
    cache = StreamingCache(cfg, model.config.num_hidden_layers)
    got = []
    with torch.no_grad():
        out = model(input_ids=ids[:, :prefill], past_key_values=cache, use_cache=True)
        got.append(out.logits)
        for t in range(prefill, ids.shape[1]):
            out = model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            got.append(out.logits)
    got = torch.cat(got, dim=1)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    assert cache.get_seq_length() == ids.shape[1]


def test_chunked_prefill_equals_dense():
    model = attach(tiny_model(1))
    cfg = StreamingConfig(budget=10, sinks=2)
    ids = torch.randint(1, 97, (2, 50))
    valid = torch.ones_like(ids, dtype=torch.bool)
    ref = dense_logits(model, ids, valid, cfg.sinks, cfg.window)
    cache = StreamingCache(cfg, 2)
    got = []
    with torch.no_grad():
        for a, b in [(0, 7), (7, 20), (20, 21), (21, 50)]:
            got.append(model(input_ids=ids[:, a:b], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(got, 1), ref, atol=1e-5, rtol=1e-4)


def test_left_padded_batch_of_three_matches_rows_alone():
    model = attach(tiny_model(2))
    cfg = StreamingConfig(budget=8, sinks=2)
    lengths = [30, 21, 12]
    t = max(lengths)
    torch.manual_seed(3)
    rows = [torch.randint(1, 97, (n,)) for n in lengths]
    ids = torch.zeros(3, t, dtype=torch.long)
    am = torch.zeros(3, t, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, t - len(r) :] = r
        am[i, t - len(r) :] = 1
    cache = StreamingCache(cfg, 2)
    with torch.no_grad():
        gen = model.generate(input_ids=ids, attention_mask=am, past_key_values=cache, max_new_tokens=12,
                             do_sample=False, pad_token_id=0)
    for i, r in enumerate(rows):
        solo_cache = StreamingCache(cfg, 2)
        with torch.no_grad():
            solo = model.generate(input_ids=r[None], past_key_values=solo_cache, max_new_tokens=12, do_sample=False,
                                  pad_token_id=0)
        assert gen[i, t:].tolist() == solo[0, len(r):].tolist()
        # and the dense-mask reference of the whole generated row agrees with the greedy choices
        full = solo[0][None]
        ref = dense_logits(model, full, torch.ones_like(full, dtype=torch.bool), cfg.sinks, cfg.window)
        assert ref[0, len(r) - 1 : -1].argmax(-1).tolist() == solo[0, len(r):].tolist()
    assert cache.get_seq_length() == t + 11  # the last generated token is never fed back


def test_update_returns_what_get_mask_sizes_promised_and_bytes_scale():
    cfg = StreamingConfig(budget=6, sinks=2)
    cache = StreamingCache(cfg, 1)
    layer = cache.layers[0]
    for q in (5, 1, 1, 9, 1):
        cache.begin_forward(None, 2, q, "cpu")
        kv_len, _ = cache.get_mask_sizes(q, 0)
        k = torch.randn(2, 3, q, 4)
        keys, values = cache.update(k, k.clone(), 0)
        assert keys.shape[2] == kv_len == values.shape[2]
    assert cache.get_seq_length() == 17
    # stored positions: 2 sinks + last 4 tokens
    stored = sorted(layer.slot_positions[0, 0].tolist())
    assert stored == [0, 1, 13, 14, 15, 16]
    assert layer.keys.shape == (2, 3, 6, 4)
    dense = DynamicCache()
    dense.update(torch.randn(2, 3, 17, 4), torch.randn(2, 3, 17, 4), 0)
    dense_bytes = sum(t.numel() * t.element_size() for t in (dense.layers[0].keys, dense.layers[0].values))
    assert cache.allocated_bytes() <= 6 / 17 * dense_bytes * 1.05


def test_bad_budget_and_missing_attach():
    with pytest.raises(KVLearnError, match="budget=4"):
        StreamingConfig(budget=4, sinks=4)
    with pytest.raises(KVLearnError, match="budget=4096"):
        StreamingConfig(budget=4096, sinks=4, context=4096)
    model = tiny_model()
    cache = StreamingCache(StreamingConfig(budget=8), 2)
    with pytest.raises(KVLearnError, match="attach"):
        model(input_ids=torch.ones(1, 3, dtype=torch.long), past_key_values=cache, use_cache=True)


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_other_supported_families_decode_like_dense_mask(family):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(4)
    cfg = AutoConfig.for_model(family, vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               max_position_embeddings=256, attn_implementation="sdpa")
    model = attach(AutoModelForCausalLM.from_config(cfg).eval())
    sc = StreamingConfig(budget=7, sinks=2)
    ids = torch.randint(1, 97, (2, 24))
    ref = dense_logits(model, ids, torch.ones_like(ids, dtype=torch.bool), sc.sinks, sc.window)
    cache = StreamingCache(sc, 2)
    with torch.no_grad():
        got = [model(input_ids=ids[:, :10], past_key_values=cache, use_cache=True).logits]
        got += [model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits for t in range(10, 24)]
    torch.testing.assert_close(torch.cat(got, 1), ref, atol=1e-5, rtol=1e-4)


def test_unsupported_family_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(KVLearnError, match="model type 'gpt2' is not supported"):
        attach(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50)))
