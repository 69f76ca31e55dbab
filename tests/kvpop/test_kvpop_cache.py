"""Rule 4: the KVpop training mask (sinks, window, rank <= running cutoff over the full sequence) and the
decode-time KVpop cache implement the same function: full-sequence masked logits == prefill + token-by-token
decoding through the bounded cache."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, Qwen3Config, Qwen3ForCausalLM

from kvlearn import KVLearnError, KVpopConfig
from kvlearn.hf import attach
from kvlearn.kvpop.cache import KVpopCache
from kvlearn.kvpop.policy import LearnedDecay
from kvlearn.kvpop.scorers import LinearScorer, MLPScorer, MLSTMScorer
from kvlearn.ops.fenwick import running_topk_cutoff
from kvlearn.ops.masks import retention_mask_dense

LAYERS = 2


def make(seed, scorer_cls=LinearScorer, **scorer_kwargs):
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=71, hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      attn_implementation="sdpa")
    model = Qwen3ForCausalLM(cfg).eval()
    scorers = [scorer_cls(2, 16, **scorer_kwargs) for _ in range(LAYERS)]
    for sc in scorers:
        for prm in sc.parameters():
            torch.nn.init.normal_(prm, std=0.5 if scorer_cls is MLSTMScorer else 1.0)
    decays = [LearnedDecay(2, 0.6, 0.95) for _ in range(LAYERS)]
    for dc in decays:
        torch.nn.init.normal_(dc.alpha, std=1.0)
    return model, scorers, decays


def reference_logits(model, scorers, decays, kv: KVpopConfig, ids):
    """Full forward; each layer's mask = the ops retention mask from priorities of that layer's keys/values."""

    def kvpop_reference_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        i = module.layer_idx
        with torch.no_grad():
            raw = scorers[i](key, value)
            t = torch.arange(key.shape[2], dtype=torch.float32)
            prio = (raw - t * decays[i]()[None, :, None]).float().contiguous()
        ranks, cutoffs = running_topk_cutoff(prio, kv.sinks, kv.window, kv.topk, backend="torch")
        g = query.shape[1] // key.shape[1]
        mask = retention_mask_dense(ranks, cutoffs, kv.sinks, kv.window).repeat_interleave(g, dim=1)
        out = F.scaled_dot_product_attention(query, key.repeat_interleave(g, 1), value.repeat_interleave(g, 1),
                                             attn_mask=mask, scale=scaling)
        return out.transpose(1, 2).contiguous(), None

    AttentionInterface.register("kvpop_reference_test", kvpop_reference_attention)
    previous = model.config._attn_implementation
    model.set_attn_implementation("kvpop_reference_test")
    try:
        with torch.no_grad():
            return model(input_ids=ids).logits
    finally:
        model.set_attn_implementation(previous)


def decode_logits(model, cache, ids, prefill):
    """Prefill ``prefill`` tokens, then decode the rest one token per forward; all logits."""
    with torch.no_grad():
        got = [model(input_ids=ids[:, :prefill], past_key_values=cache, use_cache=True).logits]
        got += [model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits
                for t in range(prefill, ids.shape[1])]
    return torch.cat(got, 1)


def left_padded(lengths):
    rows = [torch.randint(1, 71, (n,)) for n in lengths]
    width = max(lengths)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    am = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        am[i, width - len(r):] = 1
    return rows, ids, am


def assert_batch_generates_like_rows_alone(model, kv, scorers, decays, lengths):
    rows, ids, am = left_padded(lengths)
    with torch.no_grad():
        gen = model.generate(input_ids=ids, attention_mask=am, past_key_values=KVpopCache(kv, scorers, decays),
                             max_new_tokens=10, do_sample=False, pad_token_id=0)
        for i, r in enumerate(rows):
            solo = model.generate(input_ids=r[None], past_key_values=KVpopCache(kv, scorers, decays),
                                  max_new_tokens=10, do_sample=False, pad_token_id=0)
            assert gen[i, ids.shape[1]:].tolist() == solo[0, len(r):].tolist()


def assert_decode_equals_training_mask(model, scorers, decays, sinks, window, topk, prefill):
    """Rule 4 for one budget: prefill + token-by-token logits through the cache == the full masked forward."""
    kv = KVpopConfig(sinks=sinks, window=window, topk=topk, decay_min=0.6, decay_max=0.95)
    ids = torch.randint(1, 71, (2, 40))
    ref = reference_logits(model, scorers, decays, kv, ids)
    attach(model)
    cache = KVpopCache(kv, scorers, decays)
    torch.testing.assert_close(decode_logits(model, cache, ids, prefill), ref, atol=1e-5, rtol=1e-4)
    return cache


@pytest.mark.parametrize("sinks, window, topk, prefill",
                         [(2, 3, 4, 12), (0, 1, 3, 5), (1, 4, 0, 9), (2, 2, 30, 20), (2, 2, 50, 20)])  # last: k > T
def test_decode_through_bounded_cache_equals_full_sequence_mask(sinks, window, topk, prefill):
    model, scorers, decays = make(sinks + window + topk)
    cache = assert_decode_equals_training_mask(model, scorers, decays, sinks, window, topk, prefill)
    layer, budget = cache.layers[0], sinks + window + topk
    assert layer.keys.shape[2] == budget  # bounded: the buffer is the budget, whatever the length
    held = (layer.slot_positions >= 0).sum(-1)
    assert bool((held == min(40, budget)).all())  # saturated: exactly s + w + k tokens per head


@pytest.mark.parametrize("scorer_cls", [LinearScorer, MLPScorer])
def test_chunked_prefill_with_a_stateless_scorer_equals_full_sequence_mask(scorer_cls):
    """Contract v2: the scored base continues a prefill into a non-empty cache with the exact running top-k."""
    model, scorers, decays = make(5, scorer_cls)
    kv = KVpopConfig(sinks=2, window=3, topk=4, decay_min=0.6, decay_max=0.95)
    ids = torch.randint(1, 71, (2, 40))
    ref = reference_logits(model, scorers, decays, kv, ids)
    attach(model)
    cache = KVpopCache(kv, scorers, decays)
    got = []
    with torch.no_grad():
        for a, z in [(0, 5), (5, 17), (17, 18), (18, 30)] + [(t, t + 1) for t in range(30, 40)]:
            got.append(model(input_ids=ids[:, a:z], past_key_values=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(got, 1), ref, atol=1e-5, rtol=1e-4)


def test_left_padded_batch_matches_rows_alone():
    model, scorers, decays = make(3, MLPScorer)
    attach(model)
    kv = KVpopConfig(sinks=1, window=3, topk=5, decay_min=0.6, decay_max=0.95)
    assert_batch_generates_like_rows_alone(model, kv, scorers, decays, (25, 14))


def test_unsupported_uses_are_refused():
    _, scorers, decays = make(0)
    kv = KVpopConfig(sinks=1, window=2, topk=3)
    with pytest.raises(KVLearnError, match="readout delay 5 is invalid"):
        KVpopCache(kv, [MLSTMScorer(2, 16, window=5)] * LAYERS, decays)
    with pytest.raises(KVLearnError, match="decay_step=2"):
        KVpopCache(KVpopConfig(decay_step=2), scorers, decays)


@pytest.mark.parametrize("delayed", [True, False])
@pytest.mark.parametrize("sinks, window, topk, prefill", [(2, 3, 4, 12), (1, 5, 6, 3), (0, 2, 2, 30)])
def test_mlstm_scorer_decode_equals_full_sequence_mask(delayed, sinks, window, topk, prefill):
    """The stateful scorer: its delayed score of token u is read when u + w arrives, in decoding exactly as in
    the full-sequence (training) pass, so the bounded cache still reproduces the training mask."""
    model, scorers, decays = make(7 + prefill, MLSTMScorer, window=window, delayed_readout=delayed, chunk_size=8)
    cache = assert_decode_equals_training_mask(model, scorers, decays, sinks, window, topk, prefill)
    layer = cache.layers[1]
    assert layer.allocated_state_bytes() == 2 * 2 * scorers[1].state_bytes_per_head()  # batch x kv heads


def test_mlstm_left_padded_batch_matches_rows_alone():
    model, scorers, decays = make(11, MLSTMScorer, window=3, chunk_size=8)
    attach(model)
    kv = KVpopConfig(sinks=1, window=3, topk=4, decay_min=0.6, decay_max=0.95)
    assert_batch_generates_like_rows_alone(model, kv, scorers, decays, (22, 13))


def test_mlstm_padding_leaves_the_scorer_memory_untouched():
    """After a left-padded prefill every row's mLSTM memory equals that row's memory run alone."""
    model, scorers, decays = make(13, MLSTMScorer, window=3, chunk_size=8)
    attach(model)
    kv = KVpopConfig(sinks=1, window=3, topk=4, decay_min=0.6, decay_max=0.95)
    rows, ids, am = left_padded((19, 8))
    batch_cache = KVpopCache(kv, scorers, decays)
    with torch.no_grad():
        pos = (am.cumsum(-1) - 1).clamp(min=0)  # what generate passes for left padding
        model(input_ids=ids, attention_mask=am, position_ids=pos, past_key_values=batch_cache, use_cache=True)
        for i, r in enumerate(rows):
            solo = KVpopCache(kv, scorers, decays)
            model(input_ids=r[None], past_key_values=solo, use_cache=True)
            for got, want in zip(batch_cache.layers[1].scorer_state, solo.layers[1].scorer_state):
                torch.testing.assert_close(got[i], want[0], atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# chunked prefill with the stateful mLSTM scorer (issue #10 item 3)

MLSTM_KV = dict(sinks=2, topk=6, decay_min=0.6, decay_max=0.95)
LENGTH, PREFILL = 64, 53  # the sequence is several times the budget (12 with window 4)


def chunked_logits(model, cache, ids, prefill, chunk):
    """Prefill ``prefill`` tokens in forwards of ``chunk`` tokens, then decode the rest; all logits."""
    got = []
    with torch.no_grad():
        for a in range(0, prefill, chunk):
            got.append(model(input_ids=ids[:, a : min(prefill, a + chunk)], past_key_values=cache, use_cache=True).logits)
        got += [model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits
                for t in range(prefill, ids.shape[1])]
    return torch.cat(got, 1)


def held(cache):
    """Per layer, row and KV head: the held positions and their slot priorities, in position order."""
    out = []
    for layer in cache.layers:
        pos = layer.slot_positions.long()
        order = torch.argsort(torch.where(pos >= 0, pos, torch.full_like(pos, 1 << 30)), dim=2)
        out.append((torch.gather(pos, 2, order), torch.gather(layer.slot_priority, 2, order)))
    return out


@pytest.mark.parametrize("delayed, window, chunk", [(True, 4, 1), (True, 4, 7), (True, 4, 11), (True, 4, 64),
                                                    (True, 1, 7), (True, 9, 7), (False, 4, 7), (False, 4, 11),
                                                    (False, 4, 64)])
def test_mlstm_chunked_prefill_equals_single_shot_and_training_mask(delayed, window, chunk):
    """Chunked prefill + decode == one-forward prefill + decode == the full forward under the KVpop training mask
    (chunks of 1 token, ones that divide nothing, shorter than the window, longer than the prompt); after the
    prefill both caches hold the same tokens with the same final priorities (a delayed readout's last ``w`` are
    provisional: a one-token forward leaves them unscored) and the same scorer memory."""
    model, scorers, decays = make(31 + window + chunk, MLSTMScorer, window=window, delayed_readout=delayed,
                                  chunk_size=8)
    kv = KVpopConfig(window=window, **MLSTM_KV)
    ids = torch.randint(1, 71, (2, LENGTH))
    ref = reference_logits(model, scorers, decays, kv, ids)
    attach(model)
    single = KVpopCache(kv, scorers, decays)
    torch.testing.assert_close(decode_logits(model, single, ids, PREFILL), ref, atol=1e-4, rtol=1e-4)
    chunked = KVpopCache(kv, scorers, decays)
    torch.testing.assert_close(chunked_logits(model, chunked, ids, PREFILL, chunk), ref, atol=1e-4, rtol=1e-4)
    # the same state after prefill
    single, chunked = KVpopCache(kv, scorers, decays), KVpopCache(kv, scorers, decays)
    decode_logits(model, single, ids[:, :PREFILL], PREFILL)
    chunked_logits(model, chunked, ids[:, :PREFILL], PREFILL, chunk)
    final = PREFILL - 1 - scorers[0].readout_delay  # last position whose score is final
    for (pos_a, prio_a), (pos_b, prio_b) in zip(held(single), held(chunked)):
        assert torch.equal(pos_a, pos_b)
        keep = (pos_a >= 0) & (pos_a <= final)
        torch.testing.assert_close(prio_a[keep], prio_b[keep], atol=1e-4, rtol=1e-5)
    for a, b in zip(single.layers[1].scorer_state, chunked.layers[1].scorer_state):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def padded_batch(lengths, gaps):
    """Rows of ``lengths`` real tokens; row ``i`` has ``gaps[i]`` padding columns inside it (after its first third)
    and left padding to the common width. The last column is real in every row."""
    rows, cols = [], []
    for n, g in zip(lengths, gaps):
        r = torch.randint(1, 71, (n,))
        cut = n // 3
        mask = torch.cat([torch.ones(cut), torch.zeros(g), torch.ones(n - cut)]).long()
        rows.append(r)
        cols.append(mask)
    width = max(len(m) for m in cols)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    am = torch.zeros(len(rows), width, dtype=torch.long)
    for i, (r, m) in enumerate(zip(rows, cols)):
        am[i, width - len(m):] = m
        ids[i, width - len(m):][m.bool()] = r
    return rows, ids, am


@pytest.mark.parametrize("delayed", [True, False])
@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_mlstm_chunked_prefill_of_a_padded_batch_equals_rows_alone(delayed, chunk):
    """A batch of 3 with left padding and padding inside rows (so inside later chunks, and chunks of padding only),
    prefilled in chunks through kvlearn.cache.prefill, then generate: every decoding step's logits, the generated
    tokens and the scorer memory equal each row's own run."""
    from kvlearn.cache import prefill

    model, scorers, decays = make(41 + chunk, MLSTMScorer, window=4, delayed_readout=delayed, chunk_size=8)
    attach(model)
    kv = KVpopConfig(window=4, **MLSTM_KV)
    rows, ids, am = padded_batch((50, 23, 37), (0, 9, 3))
    new = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    with torch.no_grad():
        cache = KVpopCache(kv, scorers, decays)
        prefill(model, cache, ids[:, :-1], am[:, :-1], chunk_size=chunk)
        out = model.generate(input_ids=ids, attention_mask=am, past_key_values=cache, **new)
        for i, r in enumerate(rows):
            solo = KVpopCache(kv, scorers, decays)
            prefill(model, solo, r[None, :-1], chunk_size=chunk)
            want = model.generate(input_ids=r[None], past_key_values=solo, **new)
            assert out.sequences[i, ids.shape[1]:].tolist() == want.sequences[0, len(r):].tolist()
            for got_step, want_step in zip(out.scores, want.scores):
                torch.testing.assert_close(got_step[i], want_step[0], atol=1e-4, rtol=1e-4)
            for got, ref in zip(cache.layers[1].scorer_state, solo.layers[1].scorer_state):
                torch.testing.assert_close(got[i], ref[0], atol=1e-5, rtol=1e-5)
