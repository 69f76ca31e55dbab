"""kvlearn.hf.masked_attention: GQA under per-head or shared boolean masks, with the query axis in chunks when the
float mask SDPA builds would be too large (a 4096-token prefill at batch 8 ran out of GPU memory), against a
brute-force softmax written here."""

import pytest
import torch
import torch.nn.functional as F

from kvlearn.errors import KVLearnError
from kvlearn.hf import masked_attention, query_rows_per_chunk

B, HKV, G, Q, KV, D, DV = 2, 2, 2, 7, 9, 8, 6  # 2 KV heads, 2 query heads per KV head; value dim != key dim


def reference(query, key, value, mask, scaling):
    """Per (batch, query head, query row): softmax over the visible keys of that head's KV head, then the values.
    ``query [B, HQ, Q, D]``, ``key [B, HKV, KV, D]``, ``value [B, HKV, KV, DV]``, ``mask [B, P, Q or 1, KV]`` ->
    ``[B, Q, HQ, DV]``."""
    b, hq, q, _ = query.shape
    g = hq // key.shape[1]
    out = torch.zeros(b, q, hq, value.shape[-1], dtype=torch.float64)
    for i in range(b):
        for h in range(hq):
            kvh = h // g
            p = 0 if mask.shape[1] == 1 else kvh
            for t in range(q):
                row = mask[i, p, t if mask.shape[2] > 1 else 0]
                scores = (key[i, kvh].double() @ query[i, h, t].double()) * scaling
                scores[~row] = float("-inf")
                out[i, t, h] = torch.softmax(scores, dim=0) @ value[i, kvh].double()
    return out.float()


def make_mask(heads: int, rows: int) -> torch.Tensor:
    """``[B, heads, rows, KV]``: random visibility, every row with a key, some rows with exactly one key."""
    mask = torch.rand(B, heads, rows, KV) < 0.5
    mask[..., 0] |= ~mask.any(-1)  # no fully masked row (SDPA's result is undefined there)
    single = torch.zeros(KV, dtype=torch.bool)
    single[KV // 2] = True
    mask[0, :, 0] = single  # fully masked except one key
    mask[-1, -1, rows - 1] = single
    return mask


@pytest.mark.parametrize("mask_heads", [1, HKV])
@pytest.mark.parametrize("mask_rows", [Q, 1])
@pytest.mark.parametrize("limit", [1, 3 * B * HKV * G * KV * 4])  # one query row per chunk; 3 rows (7 = 3 + 3 + 1)
def test_chunked_queries_match_unchunked_and_the_brute_force_reference(mask_heads, mask_rows, limit, monkeypatch):
    query = torch.randn(B, HKV * G, Q, D)
    key, value = torch.randn(B, HKV, KV, D), torch.randn(B, HKV, KV, DV)
    mask = make_mask(mask_heads, mask_rows)
    scaling = D ** -0.5
    expected = reference(query, key, value, mask, scaling)

    whole = masked_attention(query, key, value, mask, scaling)
    sdpa, seen = F.scaled_dot_product_attention, []

    keys_seen = []

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append((q.shape[2], attn_mask.shape[2]))
        keys_seen.append(k)  # kept alive, so a new tensor per chunk cannot reuse the last one's memory
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    chunked = masked_attention(query, key, value, mask, scaling, max_mask_bytes=limit)

    rows = 1 if limit == 1 else 3
    sizes = [min(rows, Q - s) for s in range(0, Q, rows)]
    assert [n for n, _ in seen] == [G * n for n in sizes]  # each KV head's query heads folded into the query axis
    # every chunk attends the caller's K/V themselves: never expanded to the query heads, never copied
    assert {k.data_ptr() for k in keys_seen} == {key.data_ptr()} and all(k.shape[1] == HKV for k in keys_seen)
    assert chunked.shape == whole.shape == (B, Q, HKV * G, DV) and chunked.is_contiguous()
    torch.testing.assert_close(whole, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)


def test_a_mask_that_fits_takes_one_call_and_bad_limits_are_one_line_errors(monkeypatch):
    query, key = torch.randn(1, 2, 3, 4), torch.randn(1, 1, 5, 4)
    mask = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    expected = F.scaled_dot_product_attention(query, key.expand(1, 2, 5, 4), key.expand(1, 2, 5, 4)).transpose(1, 2)
    sdpa, calls = F.scaled_dot_product_attention, []
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: calls.append(1) or sdpa(*a, **kw))
    out = masked_attention(query, key, key, mask, None, max_mask_bytes=1 * 2 * 3 * 5 * 4)  # exactly fits
    assert len(calls) == 1
    torch.testing.assert_close(out, expected)
    with pytest.raises(KVLearnError, match="max_mask_bytes=0 is invalid"):
        masked_attention(query, key, key, mask, None, max_mask_bytes=0)


def test_rows_per_chunk_bound_the_float_mask_sdpa_builds():
    """Hand-computed: 40 query heads over 8 KV heads (g = 5), 131,091 keys, 512 MiB. CUDA: the bias has the mask's
    heads (1 shared, or 8) times g * rows rows; CPU: the math path's scores over all 40 query heads."""
    limit, kv = 512 * 2**20, 131_091
    assert query_rows_per_chunk(1, 40, 8, 1, kv, limit, cuda=True) == limit // (5 * kv * 4) == 204
    assert query_rows_per_chunk(1, 40, 8, 8, kv, limit, cuda=True) == limit // (40 * kv * 4) == 25
    assert query_rows_per_chunk(1, 40, 8, 1, kv, limit, cuda=False) == 25
    assert query_rows_per_chunk(2, 4, 2, 1, 10**12, 1, cuda=True) == 1  # never below one row
