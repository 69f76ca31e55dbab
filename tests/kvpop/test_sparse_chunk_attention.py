"""A multi-token forward of a static-score policy attended as sparse retention over one sequence
(``cache.chunk_attention = "sparse"``, :func:`kvlearn.hf.sparse_chunk_attention`) equals the same forward under the
layer's visibility mask, and both equal the KVpop training mask over the whole sequence (rule 4): prefill in one
forward (what ``generate`` does), chunked prefill into a non-empty cache, then decoding. The sparse path builds no
``[batch, P, q, capacity + q]`` mask; where it does not apply (padding in the forward, rows holding different
numbers of tokens) the mask path runs and the result is the same."""

import pytest
import torch

from kvlearn import KVLearnError, KVpopConfig
from kvlearn.cache import CompactLayer
from kvlearn.hf import attach
from kvlearn.ops import retention_attention
from kvlearn.kvpop.cache import KVpopCache
from kvlearn.kvpop.scorers import MLPScorer, MLSTMScorer

from tests.cache.test_policies import make as make_baseline_cache
from tests.cache.test_policies import tiny_model
from tests.kvpop.test_kvpop_cache import chunked_logits, make, reference_logits


@pytest.fixture
def calls(monkeypatch):
    """Counts the sparse attention calls and the multi-token visibility masks built."""
    counts = {"sparse": 0, "mask": 0}
    sparse, mask = retention_attention.sparse_retention_attention, CompactLayer.visibility_mask

    def counting_sparse(*args, **kwargs):
        counts["sparse"] += 1
        return sparse(*args, **kwargs)

    def counting_mask(self, query_positions, has_padding=None):
        if query_positions.shape[1] > 1:
            counts["mask"] += 1
        return mask(self, query_positions, has_padding)

    monkeypatch.setattr(retention_attention, "sparse_retention_attention", counting_sparse)
    monkeypatch.setattr(CompactLayer, "visibility_mask", counting_mask)
    return counts


def logits_with(model, cache, mode, ids, prefill, chunk, mask=None):
    cache.chunk_attention = mode
    if mask is None:
        return chunked_logits(model, cache, ids, prefill, chunk)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits
    return out


@pytest.mark.parametrize("scorer, chunk", [("mlp", 53), ("mlp", 11), ("mlstm", 53), ("mlstm", 11), ("mlstm", 2)])
def test_sparse_chunks_equal_the_mask_and_the_training_mask(calls, scorer, chunk):
    """KVpop (MLP; mLSTM with the delayed readout), float32, a 64-token sequence over a budget of 12: prefill of 53
    tokens in one forward or in chunks of 11 / 2 (into a non-empty cache), then decoding; GQA (2 KV heads, 4
    query heads)."""
    if scorer == "mlp":
        model, scorers, decays = make(7, MLPScorer)
        kv = KVpopConfig(sinks=2, window=4, topk=6, decay_min=0.6, decay_max=0.95)
    else:
        model, scorers, decays = make(8, MLSTMScorer, window=4, delayed_readout=True, chunk_size=8)
        kv = KVpopConfig(sinks=2, window=4, topk=6, decay_min=0.6, decay_max=0.95)
    ids = torch.randint(1, 71, (2, 64))
    ref = reference_logits(model, scorers, decays, kv, ids)
    attach(model)
    masked = logits_with(model, KVpopCache(kv, scorers, decays), "mask", ids, 53, chunk)
    assert calls["sparse"] == 0 and calls["mask"] > 0
    calls["mask"] = 0
    sparse = logits_with(model, KVpopCache(kv, scorers, decays), "sparse", ids, 53, chunk)
    forwards = sum(min(chunk, 53 - a) > 1 for a in range(0, 53, chunk))  # a one-token forward is a decode step
    assert calls["sparse"] == 2 * forwards and calls["mask"] == 0  # every multi-token forward of both layers
    torch.testing.assert_close(sparse, masked, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sparse, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["knorm", "random"])
def test_the_training_free_static_policies_take_it_too(calls, name):
    model = tiny_model(3)
    attach(model)
    ids = torch.randint(1, 64, (2, 40))
    masked = logits_with(model, make_baseline_cache(name, model), "mask", ids, 30, 13)
    sparse = logits_with(model, make_baseline_cache(name, model), "sparse", ids, 30, 13)
    assert calls["sparse"] == 2 * 3
    torch.testing.assert_close(sparse, masked, atol=1e-5, rtol=1e-5)


def test_padding_and_unequal_rows_fall_back_to_the_mask(calls):
    """A padded forward takes the mask; a later unpadded chunk whose rows hold different numbers of tokens (one row
    had fewer real tokens) is refused by the sparse path after its count and takes the mask too."""
    model, scorers, decays = make(9, MLPScorer)
    kv = KVpopConfig(sinks=1, window=3, topk=20, decay_min=0.6, decay_max=0.95)  # budget 24: rows stay unequal
    attach(model)
    ids = torch.randint(1, 71, (2, 30))
    pad = torch.ones(2, 12, dtype=torch.long)
    pad[1, :5] = 0  # row 1: 7 real tokens in the first forward, row 0: 12

    def run(mode):
        cache = KVpopCache(kv, scorers, decays)
        cache.chunk_attention = mode
        with torch.no_grad():
            first = model(input_ids=ids[:, :12], attention_mask=pad, past_key_values=cache, use_cache=True).logits
            full = torch.cat([pad, torch.ones(2, 18, dtype=torch.long)], dim=1)
            second = model(input_ids=ids[:, 12:], attention_mask=full, past_key_values=cache, use_cache=True).logits
        return torch.cat([first, second], 1)

    masked = run("mask")
    calls["mask"] = 0
    sparse = run("sparse")
    assert calls["sparse"] == 0 and calls["mask"] == 4  # two layers, two forwards: all through the mask
    keep = torch.cat([pad, torch.ones(2, 18, dtype=torch.long)], 1).bool()
    torch.testing.assert_close(sparse[keep], masked[keep], atol=1e-5, rtol=1e-5)


def test_generate_prefills_a_long_prompt_without_the_mask(calls):
    """``generate`` prefills the prompt in one forward: under ``"sparse"`` no multi-token mask is built and the
    tokens equal the mask path's."""
    model, scorers, decays = make(11, MLSTMScorer, window=4, delayed_readout=True, chunk_size=8)
    kv = KVpopConfig(sinks=2, window=4, topk=6, decay_min=0.6, decay_max=0.95)
    attach(model)
    ids = torch.randint(1, 71, (1, 60))
    out = {}
    for mode in ("mask", "sparse"):
        cache = KVpopCache(kv, scorers, decays)
        cache.chunk_attention = mode
        with torch.no_grad():
            out[mode] = model.generate(input_ids=ids, past_key_values=cache, max_new_tokens=8, do_sample=False,
                                       pad_token_id=0)
        if mode == "mask":
            assert calls["mask"] == 2
            calls["mask"] = 0
    assert calls["mask"] == 0 and calls["sparse"] == 2
    assert out["sparse"].tolist() == out["mask"].tolist()


def test_a_bad_mode_is_a_one_line_error():
    _, scorers, decays = make(1, MLPScorer)
    cache = KVpopCache(KVpopConfig(sinks=1, window=2, topk=3), scorers, decays)
    with pytest.raises(KVLearnError, match=r"chunk_attention='fast' is invalid: expected one of \('auto', 'sparse', 'mask'\)"):
        cache.chunk_attention = "fast"


@pytest.mark.gpu
def test_cuda_auto_takes_the_fused_kernel_for_a_long_forward(calls, monkeypatch):
    """On CUDA, ``"auto"`` runs a forward of >= SPARSE_CHUNK_MIN_QUERIES tokens through the fused Triton forward
    (float32, exact dot products) and equals the mask path; a shorter chunk keeps the mask."""
    pytest.importorskip("triton")
    import kvlearn.ops.gathered_triton as gt
    from kvlearn.hf import SPARSE_CHUNK_MIN_QUERIES

    fused = []
    real = gt.gathered_attention_forward
    monkeypatch.setattr(gt, "gathered_attention_forward", lambda *a, **kw: fused.append(1) or real(*a, **kw))
    model, scorers, decays = make(12, MLSTMScorer, window=16, delayed_readout=True, chunk_size=64)
    kv = KVpopConfig(sinks=4, window=16, topk=44, decay_min=0.6, decay_max=0.95)
    model, scorers, decays = model.cuda(), [s.cuda() for s in scorers], [d.cuda() for d in decays]
    attach(model)
    T = SPARSE_CHUNK_MIN_QUERIES + 200
    ids = torch.randint(1, 71, (2, T), device="cuda")
    out = {}
    for mode in ("mask", "auto"):
        cache = KVpopCache(kv, scorers, decays)
        cache.chunk_attention = mode
        with torch.no_grad():
            first = model(input_ids=ids[:, :T - 100], past_key_values=cache, use_cache=True).logits  # long: fused
            rest = model(input_ids=ids[:, T - 100:], past_key_values=cache, use_cache=True).logits  # short: mask
        out[mode] = torch.cat([first, rest], 1)
    assert calls["sparse"] == 2 and len(fused) == 2
    torch.testing.assert_close(out["auto"], out["mask"], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bits", [(4, 4, 4), (4, "share", 2)], ids=["b4", "b4-share-b2"])
def test_the_composed_kaizen_kvpop_cache_takes_it_with_its_sharers(calls, bits):
    """``kaizen+kvpop`` (KVpop's policy over packed stores; a ``"share"`` layer attends its anchor's keys under the
    anchor's retention), mLSTM with the delayed readout, float64: prefill in chunks of 4, 16 and 64 (the first into
    an empty cache, the rest into a non-empty one) through the sparse path equals the training forward, as the mask
    path does (``tests/kvpop/test_quantized_retrofit.py``), and every multi-token forward of every layer, the sharer
    included, went through it."""
    from kvlearn.config import KVpopConfig as Config
    from tests.kvpop.test_quantized_retrofit import assert_chunked_decoding_equals_training, composed_student

    evict = Config(sinks=2, window=8, topk=30, context=256, scorer="mlstm")
    model, evict, new_cache, ids = composed_student(bits, evict, torch.float64)

    def each_cache(cache, chunk):
        if cache is not None:  # before the chunk size's run
            calls["sparse"] = calls["mask"] = 0
            cache.chunk_attention = "sparse"
        else:  # after it: every multi-token forward of all three layers took the sparse path
            assert calls["sparse"] == 3 * -(-60 // chunk) and calls["mask"] == 0

    assert_chunked_decoding_equals_training(model, evict, new_cache, ids, bits, 60, each_cache)


def test_transformers_builds_no_mask_for_a_kvlearn_cache():
    """The attach hook consumes the padding mask, so transformers builds no ``[batch, 1, q, capacity + q]`` mask
    for a forward with a kvlearn cache (a 4-D placeholder passes through); with a transformers cache it builds its
    own mask as before. Logits of a padded batch through the cache (with real-token positions, as
    ``kvlearn.cache.prefill`` and ``generate`` give them) still equal the rows run alone."""
    from transformers import AttentionInterface, DynamicCache

    import kvlearn.hf as hf

    model, scorers, decays = make(13, MLPScorer)
    kv = KVpopConfig(sinks=1, window=3, topk=5, decay_min=0.6, decay_max=0.95)
    attach(model)
    seen = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        seen.append(None if attention_mask is None else tuple(attention_mask.shape))
        return hf.kvlearn_attention(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("kvlearn", recording)
    try:
        ids = torch.randint(1, 71, (2, 20))
        mask = torch.ones(2, 20, dtype=torch.long)
        mask[1, :6] = 0
        with torch.no_grad():
            cache = KVpopCache(kv, scorers, decays)
            positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # real-token RoPE positions (the scorers read them)
            both = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                         use_cache=True).logits
            assert seen == [(2, 1, 1, 1)] * 2  # both layers: the placeholder, not [2, 1, 20, 29]
            seen.clear()
            model(input_ids=ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config), use_cache=True)
            assert seen == [(2, 1, 20, 20)] * 2
            alone = model(input_ids=ids[1:, 6:], past_key_values=KVpopCache(kv, scorers, decays), use_cache=True).logits
    finally:
        hf.register_attention()
    torch.testing.assert_close(both[1, 6:], alone[0], atol=1e-5, rtol=1e-5)
