"""The contract every eviction method keeps, parametrised over the methods (one tiny random GQA Qwen3).

- Decoding token by token through the cache equals a full-sequence forward under the dense mask of the same
  decisions: the visibility the cache used at every forward is recorded (``cache.start_trace()``) and replayed as a
  per-layer, per-KV-head dense mask over the recomputed full-sequence K/V. This checks that every slot holds the
  token the cache says it holds, at the RoPE position it claims, for rule-based and attention-driven methods alike.
- A padded batch of 3 equals three single runs (left padding, and padding between a context and a question).
- ``get_seq_length()`` = tokens seen; allocated bytes follow the budget; chunked prefill never holds more than the
  budget plus one chunk.
"""

import importlib

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, DynamicCache, Qwen3Config, Qwen3ForCausalLM

from kvlearn.cache import prefill
from kvlearn.errors import KVLearnError
from kvlearn.hf import attach

VOCAB = 64
METHODS = {
    "streaming": dict(budget=8, sinks=2),
    "knorm": dict(budget=8, sinks=2, window=3),
    "random": dict(budget=8, sinks=2, window=3, seed=1),
    "tova": dict(budget=8),
    "h2o": dict(budget=8, window=3),
    "snapkv": dict(budget=10, window=4),
    "pyramidkv": dict(budget=10, window=2, beta=2),
}


def method(name):
    return importlib.import_module(f"kvlearn.eviction.{name}")


def tiny_model(seed=0, head_dim=16):
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, max_position_embeddings=512,
                      attn_implementation="sdpa")
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():  # Qwen3's k_norm makes every key norm sqrt(head_dim) at init: spread them (knorm ties)
        for layer in model.model.layers:
            layer.self_attn.k_norm.weight.uniform_(0.25, 2.0)
    return model


def make(name, model, **overrides):
    mod = method(name)
    return mod.make_cache(mod.CONFIG(**{**METHODS[name], **overrides}), model.config)


def replay_masks(traces, batch, length):
    """Per layer: bool ``[batch, P, T, T]``, True where the cache let query position p see key position t."""
    masks = []
    for trace in traces:
        p = trace[0][1].shape[1]
        dense = torch.zeros(batch, p, length, length, dtype=torch.bool)
        for qp, kp, m in trace:
            ok = m & (qp[:, None, :, None] >= 0) & (kp[:, :, None, :] >= 0)
            bi, pi, qi, ki = torch.nonzero(ok, as_tuple=True)
            dense[bi, pi, qp[bi, qi], kp[bi, pi, ki]] = True
        masks.append(dense)
    return masks


def replay_logits(model, ids, masks):
    """Full forward of ``ids`` where layer i attends under ``masks[i]`` (expanded to the query heads)."""

    def replay_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        g = query.shape[1] // key.shape[1]
        m = masks[module.layer_idx]
        m = m.repeat_interleave(query.shape[1] // m.shape[1], dim=1)
        out = F.scaled_dot_product_attention(query, key.repeat_interleave(g, 1), value.repeat_interleave(g, 1),
                                             attn_mask=m, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("kvlearn_replay_test", replay_attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation("kvlearn_replay_test")
    try:
        with torch.no_grad():
            return model(input_ids=ids).logits
    finally:
        model.set_attn_implementation(previous)


def run_through_cache(model, cache, ids, n_prompt, dense):
    """Prefill ``n_prompt`` tokens (bounded chunks of 7, or one dense forward), then decode one token per forward."""
    with torch.no_grad():
        if dense:
            with cache.dense():
                got = [model(input_ids=ids[:, :n_prompt], past_key_values=cache, use_cache=True).logits]
        else:
            got = [model(input_ids=ids[:, a : min(a + 7, n_prompt)], past_key_values=cache, use_cache=True).logits
                   for a in range(0, n_prompt, 7)]
        got += [model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits
                for t in range(n_prompt, ids.shape[1])]
    return torch.cat(got, dim=1)


@pytest.mark.parametrize("name", list(METHODS))
@pytest.mark.parametrize("dense", [False, True])
def test_decode_equals_dense_replay_of_the_cache_decisions(name, dense):
    if not dense and "bounded" not in method(name).PROTOCOLS:
        pytest.skip(f"{name} is defined for the context protocol only")
    model = attach(tiny_model(1))
    ids = torch.randint(1, VOCAB, (2, 36))
    cache = make(name, model)
    traces = cache.start_trace()
    got = run_through_cache(model, cache, ids, 20, dense)
    ref = replay_logits(model, ids, replay_masks(traces, 2, ids.shape[1]))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert cache.get_seq_length() == ids.shape[1]
    for layer in cache.layers:  # bounded: never more than the budget held after a forward
        held = (layer.slot_positions >= 0).sum(-1)
        assert int(held.max()) <= layer.policy.capacity and layer.store.shape[2] == layer.capacity
        budget = getattr(layer.policy, "budget", layer.capacity)
        assert int(held.max()) == budget  # saturated


@pytest.mark.parametrize("name", list(METHODS))
def test_padded_batch_of_three_equals_rows_alone(name):
    model = attach(tiny_model(2))
    lengths = [26, 17, 12]
    rows = [torch.randint(1, VOCAB, (n,)) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(3, width, dtype=torch.long)
    am = torch.zeros(3, width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        am[i, width - len(r):] = 1
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=am, past_key_values=make(name, model), **kw)
        for i, r in enumerate(rows):
            solo = model.generate(input_ids=r[None], past_key_values=make(name, model), **kw)
            assert out.sequences[i, width:].tolist() == solo.sequences[0, len(r):].tolist()
            for a, b in zip(out.logits, solo.logits):
                torch.testing.assert_close(a[i], b[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", list(METHODS))
def test_padding_between_context_and_question_is_invisible(name):
    """prefill(): a row with padding inside it equals the row without the padding; chunks of 5 and dense."""
    model = attach(tiny_model(3))
    # chunk boundaries fall on the same real tokens (attention-driven methods compress after every chunk)
    ctx, question = torch.randint(1, VOCAB, (1, 20)), torch.randint(1, VOCAB, (1, 6))
    pad = torch.zeros(1, 5, dtype=torch.long)
    ids = torch.cat([ctx, pad, question], 1)
    am = torch.cat([torch.ones_like(ctx), pad, torch.ones_like(question)], 1)
    for dense in (False, True):
        padded = prefill(model, make(name, model), ids, am, chunk_size=5, dense=dense)
        plain = prefill(model, make(name, model), torch.cat([ctx, question], 1), chunk_size=5, dense=dense)
        torch.testing.assert_close(padded, plain, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", list(METHODS))
def test_allocated_bytes_follow_the_budget(name):
    """Bookkeeping is 8 bytes per slot and KV head (position int32 + score float32): at head_dim 64 in float32 it
    is 1.6% of the K/V bytes (at head_dim 16, 6%), so the bound is checked at head_dim 64."""
    model = attach(tiny_model(4, head_dim=64))
    context = 240
    cache = make(name, model)
    ids = torch.randint(1, VOCAB, (1, context))
    prefill(model, cache, ids, chunk_size=64, dense="bounded" not in method(name).PROTOCOLS)
    assert cache.get_seq_length() == context
    dense = DynamicCache()
    k = torch.zeros(1, 2, context, 64)
    for i in range(2):
        dense.update(k, k, i)
    dense_bytes = sum(t.numel() * t.element_size() for layer in dense.layers for t in (layer.keys, layer.values))
    budget = METHODS[name]["budget"]
    assert cache.allocated_bytes() <= (budget + 1) / context * dense_bytes * 1.05
    assert cache.peak_bytes(64) > cache.allocated_bytes()
    # budget + one chunk: the transient copy of one layer is (capacity + chunk) tokens
    per_token = 2 * 64 * 4 * 2  # kv heads x (k + v) x float32 ... x 2 kv heads
    assert cache.peak_bytes(64) - cache.allocated_bytes() <= (max(l.capacity for l in cache.layers) + 64) * per_token


@pytest.mark.parametrize("name", list(METHODS))
def test_bad_input_is_refused_in_one_line(name):
    model = attach(tiny_model(5))
    cache = make(name, model)
    with torch.no_grad():
        model(input_ids=torch.randint(1, VOCAB, (2, 9)), past_key_values=cache, use_cache=True)
        with pytest.raises(KVLearnError, match="batch size 1 differs"):
            model(input_ids=torch.randint(1, VOCAB, (1, 1)), past_key_values=cache, use_cache=True)
    other = attach(tiny_model(5, head_dim=32))
    cache = make(name, model)
    with torch.no_grad():
        model(input_ids=torch.randint(1, VOCAB, (1, 9)), past_key_values=cache, use_cache=True)
        with pytest.raises(KVLearnError, match="do not match this cache"):
            other(input_ids=torch.randint(1, VOCAB, (1, 1)), past_key_values=cache, use_cache=True)
    mod = method(name)
    short = mod.make_cache(mod.CONFIG(**METHODS[name]), Qwen3Config(num_hidden_layers=1))
    with pytest.raises(KVLearnError, match="2 decoder layers but this cache has 1"):
        model(input_ids=torch.randint(1, VOCAB, (1, 3)), past_key_values=short, use_cache=True)
    with pytest.raises(KVLearnError, match="budget=1 is invalid") as err:
        mod.CONFIG(**{**METHODS[name], "budget": 1})
    assert "\n" not in str(err.value)
