"""A keep-all layer over live buffers (16-bit Kaizen layers, an MLA latent at 16 bits) writes a multi-token forward's
tokens into its store first and attends the filled prefix as a view (``CompactLayer.writes_in_place``): no copy of
the store per chunk. So does a packed (2/4/8-bit) Kaizen layer, which attends the stored form: it reads back
(dequantizes) only the filled prefix, never the whole store. Checked against the model's own forward without a
cache, in chunks, with left padding, and against the concatenating path it replaces."""

import pytest
import torch

from kvlearn.cache import CompactLayer, PackedStore
from kvlearn.cache.keepall import KeepAllPolicy
from kvlearn.cache.kivi import KIVIStore
from kvlearn.kaizen.actions import LayerAction
from kvlearn.kaizen.cache import make_cache

from tests.kaizen.test_cache_sharing import S, VOCAB, assert_padded_batch_equals_rows_alone, config, tiny


def prefill_in_chunks_then_decode(model, cache, ids, cuts):
    """Logits of ``ids [b, T]``: the prompt ``ids[:, :cuts[-1]]`` in the chunks between ``cuts``, then one token at a
    time."""
    out, start = [], 0
    with torch.no_grad():
        for end in cuts:
            out.append(model(input_ids=ids[:, start:end], past_key_values=cache, use_cache=True).logits)
            start = end
        out += [model(input_ids=ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits
                for t in range(start, ids.shape[1])]
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("actions", [(LayerAction(16),) * 4, (LayerAction(16), S, LayerAction(4), LayerAction(16))])
def test_chunked_prefill_in_place_equals_the_forward_without_a_cache(actions):
    model = tiny(3)
    cfg = config(model, *actions)
    ids = torch.randint(1, VOCAB, (2, 26), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False, kaizen_config=cfg).logits
    cache = make_cache(cfg, model.config, capacity=40)
    in_place = [layer for layer in cache.layers if isinstance(layer, CompactLayer) and layer.writes_in_place]
    assert len(in_place) == sum(not a.share for a in actions) > 0  # 16-bit and packed layers alike
    got = prefill_in_chunks_then_decode(model, cache, ids, (5, 12, 20))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert in_place[0].chunk_bytes(4096) == 0 and in_place[0].seen == 26  # no transient copy of the store


def test_a_multi_token_forward_attends_views_of_the_live_buffers():
    model = tiny(8)
    cfg = config(model, *(LayerAction(16),) * 4)
    cache = make_cache(cfg, model.config, capacity=30)
    layer = cache.layers[0]
    seen = []
    update = CompactLayer.update

    def spy(self, *args, **kwargs):
        keys, values = update(self, *args, **kwargs)
        seen.append((keys, values))
        return keys, values

    ids = torch.randint(1, VOCAB, (1, 12), generator=torch.Generator().manual_seed(9))
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(CompactLayer, "update", spy)
        model(input_ids=ids[:, :7], past_key_values=cache, use_cache=True)
        model(input_ids=ids[:, 7:], past_key_values=cache, use_cache=True)
    keys, values = seen[len(cache.layers)]  # layer 0 of the second forward
    assert keys.shape[2] == 12 and keys.data_ptr() == layer.store.keys.data_ptr()  # the filled prefix, no copy
    assert values.data_ptr() == layer.store.values.data_ptr()


def test_in_place_and_concatenating_paths_give_the_same_logits(monkeypatch):
    model = tiny(5)
    cfg = config(model, *(LayerAction(16),) * 4)
    ids = torch.randint(1, VOCAB, (2, 22), generator=torch.Generator().manual_seed(6))
    fast = prefill_in_chunks_then_decode(model, make_cache(cfg, model.config, capacity=24), ids, (9, 17))
    monkeypatch.setattr(CompactLayer, "writes_in_place", property(lambda self: False))
    slow_cache = make_cache(cfg, model.config, capacity=24)
    slow = prefill_in_chunks_then_decode(model, slow_cache, ids, (9, 17))
    assert slow_cache.layers[0].chunk_bytes(8) > 0
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


def test_left_padded_batch_in_place_equals_rows_alone():
    model = tiny(7)
    assert_padded_batch_equals_rows_alone(model, config(model, LayerAction(16), S, LayerAction(16), LayerAction(16)))


def test_packed_layers_read_back_only_the_filled_prefix(monkeypatch):
    """4- and 2-bit layers: a chunked prefill never reads the whole store (``PackedStore.read``), only the prefix of
    ``seen + q`` slots, and gives the logits of the concatenating path and of the forward without a cache."""
    model = tiny(11)
    cfg = config(model, LayerAction(4), LayerAction(2), S, LayerAction(8))
    ids = torch.randint(1, VOCAB, (2, 24), generator=torch.Generator().manual_seed(12))
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False, kaizen_config=cfg).logits
    lengths, whole = [], []
    read_prefix, read = PackedStore.read_prefix, PackedStore.read

    def spy_prefix(self, length):
        lengths.append(length)
        return read_prefix(self, length)

    def spy_read(self):
        whole.append(1)
        return read(self)

    cache = make_cache(cfg, model.config, capacity=40)
    with monkeypatch.context() as mp:
        mp.setattr(PackedStore, "read_prefix", spy_prefix)
        mp.setattr(PackedStore, "read", spy_read)
        with torch.no_grad():
            for start, end in ((0, 7), (7, 16), (16, 21)):
                fast_chunks = model(input_ids=ids[:, start:end], past_key_values=cache, use_cache=True).logits
    assert whole == [] and sorted(set(lengths)) == [7, 16, 21] and len(lengths) == 3 * 3  # three packed layers
    fast = prefill_in_chunks_then_decode(model, make_cache(cfg, model.config, capacity=40), ids, (7, 16, 21))
    monkeypatch.setattr(CompactLayer, "writes_in_place", property(lambda self: False))
    slow = prefill_in_chunks_then_decode(model, make_cache(cfg, model.config, capacity=40), ids, (7, 16, 21))
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fast, ref, atol=1e-4, rtol=1e-4)
    assert fast_chunks.shape[1] == 5


def test_packed_prefix_read_is_the_sliced_read_and_kivi_stays_concatenating():
    store = PackedStore(4)
    store.allocate(2, 2, 10, 16, 16, torch.float32, "cpu")
    k, v = torch.randn(2, 2, 6, 16), torch.randn(2, 2, 6, 16)
    store.write(torch.arange(6).expand(2, 2, 6).clone(), k, v)
    for got, full, new in zip(store.read_prefix(6), store.read(), store.round_trip(k, v)):
        assert torch.equal(got, full[:, :, :6]) and torch.equal(got, new)  # bit-exact: the stored form
    kivi = CompactLayer(KeepAllPolicy(64), KIVIStore(2, group_size=8, residual=16), attend_stored_form=True)
    assert not kivi.writes_in_place  # KIVI's groups and window depend on the neighbours: not write_read_exact
    plain_form = CompactLayer(KeepAllPolicy(64), PackedStore(4), attend_stored_form=False)
    assert not plain_form.writes_in_place  # its chunk attends the new tokens unquantized: the concatenating path
