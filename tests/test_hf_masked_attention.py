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


@pytest.mark.parametrize("mask_rows", [Q, 1])
@pytest.mark.parametrize("limit", [None, 3 * B * 1 * KV * 4])  # one call; 3 rows per call on the broadcast bound
def test_one_kv_head_broadcasts_kv_and_mask_over_the_query_heads(mask_rows, limit, monkeypatch):
    """MQA (the absorbed MLA attention): the broadcast path hands SDPA the one KV head as stride-0 views over the
    query heads (no copy) and the shared mask unrepeated, and equals the brute-force reference and the fold."""
    hq = 4
    query = torch.randn(B, hq, Q, D)
    key, value = torch.randn(B, 1, KV, D), torch.randn(B, 1, KV, DV)
    mask = make_mask(1, mask_rows)
    scaling = D ** -0.5
    expected = reference(query, key, value, mask, scaling)
    sdpa, seen = F.scaled_dot_product_attention, []

    def spy(q, k, v, attn_mask=None, **kw):
        seen.append((q.shape, k.shape, k.stride(1), k.data_ptr(), attn_mask.shape))
        return sdpa(q, k, v, attn_mask=attn_mask, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    out = masked_attention(query, key, value, mask, scaling, max_mask_bytes=limit, broadcast=True)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    # the CPU bound counts every query head's scores (the math path): the limit that holds 3 rows on CUDA holds
    # limit // (B * hq * KV * 4) = 0 -> 1 row per call here
    rows = Q if limit is None else 1
    assert [s[0][2] for s in seen] == [min(rows, Q - s) for s in range(0, Q, rows)]
    for q_shape, k_shape, k_head_stride, ptr, m_shape in seen:
        assert q_shape[1] == hq and k_shape[1] == hq and k_head_stride == 0 and ptr == key.data_ptr()
        assert m_shape[1] == 1 and m_shape[2] in (1, q_shape[2])  # the mask is never repeated over the heads
    seen.clear()
    folded = masked_attention(query, key, value, mask, scaling, max_mask_bytes=limit)  # the CPU default folds
    assert all(q_shape[1] == 1 and q_shape[2] % hq == 0 for q_shape, *_ in seen)
    torch.testing.assert_close(folded, out, atol=1e-5, rtol=1e-5)
    # per-KV-head masks or several KV heads: broadcast=True is ignored and the fold is taken (same result)
    key2, value2 = torch.randn(B, 2, KV, D), torch.randn(B, 2, KV, DV)
    mask2 = make_mask(2, mask_rows)
    torch.testing.assert_close(masked_attention(query, key2, value2, mask2, scaling, broadcast=True),
                               reference(query, key2, value2, mask2, scaling), atol=1e-5, rtol=1e-5)


def test_rows_per_chunk_of_the_one_kv_head_path():
    """Hand-computed, the absorbed MLA prefill at 131,091 keys, 512 MiB, 40 query heads over one latent head on CUDA:
    folding repeats the shared mask 40 times (25 rows per call); broadcasting it holds 40 times the rows (1023)."""
    limit, kv = 512 * 2**20, 131_091
    folded = query_rows_per_chunk(1, 40, 1, 1, kv, limit, cuda=True)
    broadcast = query_rows_per_chunk(1, 40, 40, 1, kv, limit, cuda=True)
    assert folded == limit // (40 * kv * 4) == 25
    assert broadcast == limit // (kv * 4) == 1023
    calls = [-(-4096 // rows) for rows in (broadcast, folded)]  # SDPA calls per 4096-token prefill chunk
    assert calls == [5, 164]


@pytest.mark.gpu
def test_one_kv_head_broadcast_on_cuda_matches_the_fold_and_takes_fewer_calls():
    """On CUDA the default broadcasts from BROADCAST_MIN_QUERIES queries; bf16 result equals the float32 fold."""
    from kvlearn.hf import BROADCAST_MIN_QUERIES
    torch.manual_seed(0)
    dev = torch.device("cuda")
    hq, q, kv, d, dv = 40, 4 * BROADCAST_MIN_QUERIES, 4096, 192, 128
    query = torch.randn(1, hq, q, d, device=dev, dtype=torch.bfloat16)
    key = torch.randn(1, 1, kv, d, device=dev, dtype=torch.bfloat16)
    value = torch.randn(1, 1, kv, dv, device=dev, dtype=torch.bfloat16)
    pos = torch.arange(kv, device=dev)
    mask = (pos[None, :] <= (kv - q + torch.arange(q, device=dev))[:, None])[None, None]  # causal, offset
    limit = 64 * kv * 4  # 64 broadcast rows per call, 1 folded row
    out = masked_attention(query, key, value, mask, d ** -0.5, max_mask_bytes=limit)
    ref = masked_attention(query.float(), key.float(), value.float(), mask, d ** -0.5, max_mask_bytes=limit,
                           broadcast=False)
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
