"""Each baseline's rule on tiny hand-computed cases: one layer, one batch row, one KV head, driven directly.

Attention-driven methods get their attention by hand (what the attention function would hand back), so the test
checks the rule, not the attention; :func:`test_attention_summary_matches_a_naive_softmax` checks the attention.
"""

from types import SimpleNamespace

import pytest
import torch

from kvlearn.cache import AttentionRequest, attention_summary
from kvlearn.eviction import h2o, knorm, pyramidkv, snapkv, tova
from kvlearn.eviction import random as random_method

ONE_LAYER = SimpleNamespace(num_hidden_layers=1)


def feed(cache, k, attn=None):
    """One forward of ``k [1, 1, q, d]`` into layer 0; hand ``attn [1, 1, kv]`` back if the policy observes."""
    st = cache.begin_forward(None, k.shape[0], k.shape[2], "cpu")
    cache.update(k, k.clone(), 0)
    layer = cache.layers[0]
    if layer.policy.observes:
        layer.observe_attention(st, None if attn is None else torch.tensor(attn, dtype=torch.float32)[None, None])
    return layer


def held(layer):
    return sorted(p for p in layer.slot_positions[0, 0].tolist() if p >= 0)


def norm_keys(norms):
    return torch.tensor([[n, 0.0] for n in norms])[None, None]  # [1, 1, q, 2]


def test_knorm_keeps_lowest_norms_beyond_sinks_and_window():
    # budget 5 = 1 sink + window 2 + 2 ranked. Decoding: p=5 evicts 2 (norm 9), p=6 evicts 4 (8), p=7 evicts 5 (3).
    norms = [5, 1, 9, 2, 8, 3, 7, 4]
    cfg = knorm.KnormConfig(budget=5, sinks=1, window=2)
    cache = knorm.make_cache(cfg, ONE_LAYER)
    for n in norms:
        layer = feed(cache, norm_keys([n]))
    assert held(layer) == [0, 1, 3, 6, 7]
    # one 8-token forward: the same survivors, and each query saw exactly what decoding would have kept
    cache = knorm.make_cache(cfg, ONE_LAYER)
    layer = feed(cache, norm_keys(norms))
    assert held(layer) == [0, 1, 3, 6, 7]
    mask = layer.visibility_mask(cache.step.positions)[0, 0, :, layer.capacity:]  # [q, q] over the new keys
    ends = {2: 5, 4: 6, 5: 7}  # evicted token -> first query that no longer sees it
    for t in range(8):
        for p in range(8):
            assert bool(mask[p, t]) == (t <= p < ends.get(t, 99)), (p, t)


def test_random_keeps_the_top_hashed_scores_and_is_seeded():
    cfg = random_method.RandomConfig(budget=5, sinks=1, window=2, seed=3)
    cache = random_method.make_cache(cfg, ONE_LAYER)
    for _ in range(8):
        layer = feed(cache, torch.randn(1, 1, 1, 2))
    scores = random_method.hashed_scores(3, 0, 1, torch.arange(8)[None])[0, 0].tolist()
    top = sorted(range(1, 6), key=lambda t: -scores[t])[:2]  # eligible at p=7: positions 1..5
    assert held(layer) == sorted([0, 6, 7] + top)
    other = random_method.hashed_scores(4, 0, 1, torch.arange(64)[None])
    assert not torch.equal(other, random_method.hashed_scores(3, 0, 1, torch.arange(64)[None]))
    assert torch.equal(random_method.hashed_scores(3, 0, 1, torch.arange(64)[None]),
                       random_method.hashed_scores(3, 0, 1, torch.arange(64)[None]))


def test_tova_evicts_the_lowest_attention_of_the_current_query():
    cache = tova.make_cache(tova.TOVAConfig(budget=3), ONE_LAYER)  # capacity 4: budget + 1 while attending
    k = torch.randn(1, 1, 1, 2)
    feed(cache, k, [1, 0, 0, 0])
    feed(cache, k, [0.5, 0.5, 0, 0])
    feed(cache, k, [0.3, 0.3, 0.4, 0])
    layer = feed(cache, k, [0.4, 0.1, 0.3, 0.2])  # slots hold positions 0,1,2,3: evict 1
    assert held(layer) == [0, 2, 3]
    layer = feed(cache, k, [0.2, 0.5, 0.1, 0.2])  # 4 took slot 1: slots hold 0,4,2,3: evict 2 (0.1)
    assert held(layer) == [0, 3, 4]
    assert layer.capacity == 4 and cache.get_seq_length() == 5


def test_h2o_evicts_the_lowest_accumulated_attention():
    cache = h2o.make_cache(h2o.H2OConfig(budget=3, window=1), ONE_LAYER)
    k = torch.randn(1, 1, 1, 2)
    feed(cache, k, [1, 0, 0, 0])
    feed(cache, k, [0.6, 0.4, 0, 0])
    feed(cache, k, [0.2, 0.5, 0.3, 0])
    layer = feed(cache, k, [0.1, 0.2, 0.3, 0.4])  # sums 1.9, 1.1, 0.6, 0.4 (protected): evict 2 (TOVA would evict 0)
    assert held(layer) == [0, 1, 3]
    torch.testing.assert_close(layer.slot_state["score"][0, 0, [0, 1, 3]], torch.tensor([1.9, 1.1, 0.4]))
    # a 5-token forward into an empty cache: column sums 2.0, 0.5, 1.0, 0.7, 0.3 -> keep 4 (window) + 0 and 2
    cache = h2o.make_cache(h2o.H2OConfig(budget=3, window=1), ONE_LAYER)
    layer = feed(cache, torch.randn(1, 1, 5, 2), [0, 0, 0, 0, 2.0, 0.5, 1.0, 0.7, 0.3])
    assert held(layer) == [0, 2, 4]


def test_snapkv_pools_the_window_attention_then_keeps_its_selection_while_decoding():
    cfg = snapkv.SnapKVConfig(budget=4, window=2, kernel_size=3)
    cache = snapkv.make_cache(cfg, ONE_LAYER)
    # window = positions 6, 7. Prefix sums 0.05 .9 .2 0 .1 .6 -> avg-pooled (k=3, zero pad) .317 .383 .367 .1 .233 .233:
    # keep 1 and 2 (unpooled, 1 and 5 would win)
    attn = [0] * 5 + [0.05, 0.9, 0.2, 0.0, 0.1, 0.6, 0.5, 0.5]
    with cache.dense():
        layer = feed(cache, torch.randn(1, 1, 8, 2), attn)
    assert held(layer) == [1, 2, 6, 7]
    layer = feed(cache, torch.randn(1, 1, 1, 2))  # decoding: the oldest unselected token leaves
    assert held(layer) == [1, 2, 7, 8]
    layer = feed(cache, torch.randn(1, 1, 1, 2))
    assert held(layer) == [1, 2, 8, 9]
    pooled = snapkv.pool_scores(torch.tensor([[[0.05, 0.9, 0.2, 0.0, 0.1, 0.6, 0.0, 0.0]]]),
                                torch.arange(8)[None, None], 3, "avg")
    torch.testing.assert_close(pooled[0, 0, :6], torch.tensor([0.95, 1.15, 1.1, 0.3, 0.7, 0.7]) / 3)


def test_snapkv_selects_once_so_a_question_chunk_cannot_rescue_tokens():
    """Under the ``context`` protocol the question runs as a (non-dense) multi-token forward after the selection: it
    must not select again (kvpress: the question is never seen at compression time); it joins the recent window."""
    cfg = snapkv.SnapKVConfig(budget=4, window=2, kernel_size=1)
    cache = snapkv.make_cache(cfg, ONE_LAYER)
    with cache.dense():  # selection: prefix attention .9 at position 1, .8 at 3 -> keep 1, 3 + window 4, 5
        layer = feed(cache, torch.randn(1, 1, 6, 2), [0] * 5 + [0, 0.9, 0, 0.8, 0.5, 0.5])  # 5 empty slots first
    assert held(layer) == [1, 3, 4, 5]
    # a 3-token question chunk: the policy asks for no attention (so nothing can re-select) and keeps its selection
    layer = feed(cache, torch.randn(1, 1, 3, 2))
    assert layer.policy.attention_request(cache.step) is None
    assert held(layer) == [1, 3, 7, 8]  # selection kept, recent window = the newest tokens
    cache.reset()  # a new sequence selects again
    assert cache.layers[0].policy.attention_request(cache.begin_forward(None, 1, 6, "cpu")) is not None


def test_pyramidkv_layer_budgets_follow_kvpress():
    cfg = pyramidkv.PyramidKVConfig(budget=1024)  # window 32, beta 20: min 51.2, max 1996.8
    assert pyramidkv.layer_budgets(cfg, 4) == [1997, 1348, 700, 51]
    clamped = pyramidkv.PyramidKVConfig(budget=1024, context=1500)  # max -> 1500 - 32, min -> 2048 - 1468
    assert pyramidkv.layer_budgets(clamped, 4) == [1468, 1172, 876, 580]
    assert pyramidkv.layer_budgets(pyramidkv.PyramidKVConfig(budget=40), 4) == [40] * 4  # min < window: SnapKV
    cache = pyramidkv.make_cache(cfg, SimpleNamespace(num_hidden_layers=4))
    assert [layer.capacity for layer in cache.layers] == [1998, 1349, 701, 52]


@pytest.mark.parametrize("queries, n, group", [("all", 1, "sum"), ("last", 1, "mean"), ("last", 3, "mean")])
def test_attention_summary_matches_a_naive_softmax(queries, n, group):
    torch.manual_seed(0)
    b, hkv, g, q, kv, d = 2, 2, 3, 7, 11, 4
    query, key = torch.randn(b, hkv * g, q, d), torch.randn(b, hkv, kv, d)
    mask = torch.rand(b, hkv, q, kv) < 0.7
    mask[..., 0] = True
    positions = torch.tensor([[-1, -1, 0, 1, 2, 3, 4], [0, 1, -1, 2, 3, 4, 5]])
    got = attention_summary(query, key, mask, 0.5, AttentionRequest(queries, n, group), positions, block=3)
    logits = torch.einsum("bhqd,bhkd->bhqk", query, key.repeat_interleave(g, 1)) * 0.5
    probs = logits.masked_fill(~mask.repeat_interleave(g, 1), float("-inf")).softmax(-1)
    last = positions.max(1, keepdim=True).values
    sel = (positions >= 0) & ((positions > last - n) if queries == "last" else True)
    per_head = (probs * sel[:, None, :, None]).sum(2).reshape(b, hkv, g, kv)
    want = per_head.mean(2) if group == "mean" else per_head.sum(2)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("name", ["streaming", "knorm"])
def test_dense_forward_sees_everything_then_compresses_once(name):
    """The context protocol on rule-based policies: full causal attention inside the forward, then the rule's
    survivors (streaming: sinks + the last window; knorm: sinks + window + the lowest norms)."""
    from kvlearn.eviction import streaming

    if name == "streaming":
        cache, want = streaming.make_cache(streaming.StreamingConfig(budget=6, sinks=2), ONE_LAYER), [0, 1, 8, 9, 10, 11]
    else:  # norms: eligible 1..9 -> the two lowest are 3 (0.5) and 7 (1.5)
        cache, want = knorm.make_cache(knorm.KnormConfig(budget=5, sinks=1, window=2), ONE_LAYER), [0, 3, 7, 10, 11]
    norms = [5, 4, 6, 0.5, 8, 3, 7, 1.5, 9, 2, 2.5, 6.5]
    with cache.dense():
        layer = feed(cache, norm_keys(norms))
    assert held(layer) == want
    mask = layer.visibility_mask(cache.step.positions)[0, 0, :, layer.capacity:]
    assert torch.equal(mask, torch.ones(12, 12, dtype=torch.bool).tril())
