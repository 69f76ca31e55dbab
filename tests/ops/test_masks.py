"""Retention mask: dense twin vs a python loop, mask_mod (GQA head mapping) vs dense, the budget, BlockMask;
visibility intervals and the gathered layout vs the dense mask, its BlockMask vs create_block_mask."""

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask

from kvlearn.errors import KVLearnError
from kvlearn.ops.fenwick import running_topk_cutoff
from kvlearn.ops.masks import (
    eviction_positions,
    gathered_block_mask,
    gathered_capacity,
    gathered_layout,
    retention_block_mask,
    retention_mask_dense,
    retention_mask_mod,
)


def random_inputs(seed, B, H, T, sinks, window, topk, ties=True):
    g = torch.Generator().manual_seed(seed)
    if ties:
        p = torch.randint(0, 3, (B, H, T), generator=g).float()
    else:
        p = torch.randn(B, H, T, generator=g)
    return running_topk_cutoff(p, sinks, window, topk, backend="torch")


def loop_mask(ranks, cutoffs, sinks, window):
    """Eq. 26 with causality, one (b, h, q, t) at a time."""
    B, H, T = ranks.shape
    out = torch.zeros(B, H, T, T, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for q in range(T):
                for t in range(q + 1):
                    keep = t < sinks or q - t < window
                    if sinks <= t <= q - window and ranks[b, h, t] <= cutoffs[b, h, q]:
                        keep = True
                    out[b, h, q, t] = keep
    return out


@pytest.mark.parametrize(
    "seed,B,H,T,sinks,window,topk",
    [(0, 2, 2, 24, 2, 3, 4), (1, 1, 3, 30, 0, 1, 5), (2, 2, 1, 20, 3, 4, 0), (3, 1, 2, 17, 1, 2, 100)],
)
def test_dense_mask_matches_python_loop(seed, B, H, T, sinks, window, topk):
    ranks, cutoffs = random_inputs(seed, B, H, T, sinks, window, topk)
    assert torch.equal(retention_mask_dense(ranks, cutoffs, sinks, window), loop_mask(ranks, cutoffs, sinks, window))


@pytest.mark.parametrize(
    "seed,B,Hkv,G,T,sinks,window,topk",
    [(0, 2, 2, 2, 70, 4, 8, 10), (1, 1, 3, 1, 50, 0, 1, 6), (2, 2, 2, 3, 64, 2, 5, 0), (3, 1, 2, 4, 45, 3, 4, 60)],
)
def test_mask_mod_matches_dense_with_gqa_head_mapping(seed, B, Hkv, G, T, sinks, window, topk):
    ranks, cutoffs = random_inputs(seed, B, Hkv, T, sinks, window, topk, ties=seed % 2 == 0)
    dense = retention_mask_dense(ranks, cutoffs, sinks, window)  # [B, Hkv, T, T]
    mod = retention_mask_mod(ranks, cutoffs, sinks, window, G)
    flex_dense = create_mask(mod, B, Hkv * G, T, T, device="cpu")  # h = query head
    assert torch.equal(flex_dense, dense.repeat_interleave(G, dim=1))
    # where the budget binds the KV heads differ, so a wrong h -> kv head mapping would show up
    if 0 < topk < T - sinks - window and Hkv > 1:
        assert not torch.equal(dense[:, 0], dense[:, 1])


@pytest.mark.parametrize("sinks,window,topk", [(4, 8, 12), (0, 1, 5), (2, 6, 0), (1, 3, 1)])
def test_budget_saturates_at_sinks_window_topk(sinks, window, topk):
    T = 80
    ranks, cutoffs = random_inputs(sinks * 10 + topk, 2, 3, T, sinks, window, topk, ties=True)
    mask = retention_mask_dense(ranks, cutoffs, sinks, window)
    per_row = mask.sum(-1)  # [B, H, T]
    saturate = sinks + window + topk - 1
    q = torch.arange(T)
    causal_count = (q + 1).expand_as(per_row)
    assert torch.equal(per_row[..., saturate:], torch.full_like(per_row[..., saturate:], sinks + window + topk))
    assert torch.equal(per_row[..., :saturate], causal_count[..., :saturate])


def test_block_mask_dense_equals_mask_and_blocks_skip():
    B, Hkv, G, T, sinks, window, topk = 2, 2, 2, 96, 2, 8, 8
    ranks, cutoffs = random_inputs(7, B, Hkv, T, sinks, window, topk, ties=False)
    bm = retention_block_mask(ranks, cutoffs, sinks, window, G, block_size=16)
    assert bm.shape == (B, Hkv * G, T, T)
    dense = retention_mask_dense(ranks, cutoffs, sinks, window).repeat_interleave(G, dim=1)
    # block level: a tile is scheduled iff it holds at least one kept entry
    tiles = dense.reshape(B, Hkv * G, T // 16, 16, T // 16, 16).any(dim=(3, 5))
    assert torch.equal(bm.to_dense().bool(), tiles)
    # and the mask_mod carried by the BlockMask is the query-head one
    assert torch.equal(create_mask(bm.mask_mod, B, Hkv * G, T, T, device="cpu"), dense)
    assert 0.0 < bm.sparsity() < 100.0


def test_mask_bad_inputs_raise():
    ranks, cutoffs = random_inputs(0, 1, 2, 16, 1, 2, 3)
    with pytest.raises(KVLearnError, match="zero window"):
        retention_mask_dense(ranks, cutoffs, 1, 0)
    with pytest.raises(KVLearnError, match="sinks=-1"):
        retention_mask_mod(ranks, cutoffs, -1, 2, 1)
    with pytest.raises(KVLearnError, match="int32"):
        retention_mask_dense(ranks.long(), cutoffs, 1, 2)
    with pytest.raises(KVLearnError, match="cutoffs shape"):
        retention_mask_dense(ranks, cutoffs[:, :1], 1, 2)
    with pytest.raises(KVLearnError, match="query_heads_per_kv=0"):
        retention_block_mask(ranks, cutoffs, 1, 2, 0)
    with pytest.raises(KVLearnError, match="3 dims"):
        retention_mask_mod(ranks[0], cutoffs[0], 1, 2, 1)


# ---- visibility intervals and the gathered layout ----

def fresh_draw(seed):
    """Random (B, H, T, sinks, window, topk, block_size, ties) including the edges: k = 0, window >= T, sinks = 0."""
    g = torch.Generator().manual_seed(seed)

    def draw(lo, hi):
        return int(torch.randint(lo, hi + 1, (1,), generator=g))

    T = draw(1, 70)
    sinks = [0, draw(0, 4), draw(0, 80)][seed % 3]
    window = [draw(1, 12), draw(1, 90), T + draw(0, 3)][seed % 4 % 3]
    topk = [0, draw(1, 8), draw(1, 40), T + 5][seed % 4]
    return 2, 2, T, sinks, window, topk, draw(1, 20), seed % 2 == 0


def reconstruct(layout):
    """Dense [B, H, padded T, T] count of slots that make key t visible to query q (must be the 0/1 mask)."""
    B, H, nQ, C = layout.index.shape
    BS, T = layout.block_size, layout.seq_len
    q = torch.arange(nQ * BS).view(nQ, BS, 1)
    vis = (layout.key_pos[:, :, :, None, :] <= q) & (q < layout.key_end[:, :, :, None, :])  # [B, H, nQ, BS, C]
    counts = torch.zeros(B, H, nQ, BS, T, dtype=torch.int64)
    counts.scatter_add_(-1, layout.index.long()[:, :, :, None, :].expand(vis.shape), vis.long())
    return counts.view(B, H, nQ * BS, T), vis


@pytest.mark.parametrize("seed", range(40))
def test_eviction_intervals_equal_dense_mask(seed):
    B, H, T, sinks, window, topk, _, ties = fresh_draw(seed)
    ranks, cutoffs = random_inputs(seed, B, H, T, sinks, window, topk, ties=ties)
    end = eviction_positions(ranks, cutoffs, sinks, window)
    assert end.dtype == torch.int32 and end.shape == ranks.shape
    q = torch.arange(T)[:, None]
    t = torch.arange(T)[None, :]
    intervals = (t <= q) & (q < end[:, :, None, :].long())
    assert torch.equal(intervals, retention_mask_dense(ranks, cutoffs, sinks, window))


@pytest.mark.parametrize("seed", range(40))
def test_gathered_layout_holds_exactly_the_visible_keys(seed):
    B, H, T, sinks, window, topk, block_size, ties = fresh_draw(seed)
    ranks, cutoffs = random_inputs(seed, B, H, T, sinks, window, topk, ties=ties)
    dense = retention_mask_dense(ranks, cutoffs, sinks, window)
    bound = gathered_capacity(T, sinks, window, topk, block_size)
    for k in (topk, None):
        lay = gathered_layout(ranks, cutoffs, sinks, window, topk=k, block_size=block_size)
        nQ, C = lay.num_blocks, lay.capacity
        assert nQ == -(-T // block_size) and C % block_size == 0 and C <= bound
        if k is not None:
            assert C == bound  # sized by the budget, no host sync
        assert bool((lay.num_used <= C).all())  # never exceeds capacity ...
        assert bool((lay.num_used <= min(T, sinks + window + topk + block_size - 1)).all())  # ... nor the bound
        counts, vis = reconstruct(lay)
        assert counts.max() <= 1  # no key twice
        assert torch.equal(counts[:, :, :T].bool(), dense)  # never drops a visible key, never adds one
        # padded query rows see what query T - 1 sees
        assert torch.equal(counts[:, :, T:].bool(), dense[:, :, T - 1:T].expand(-1, -1, nQ * block_size - T, -1))
        slot = torch.arange(C)
        full = slot < lay.num_full[..., None]
        assert bool(vis.all(dim=3)[full].all())  # leading slots: visible to every query of the block
        assert not bool(vis.any(dim=3)[slot >= lay.num_used[..., None]].any())  # padding: to none
        # own tokens right after the always-visible ones, in order
        q0 = torch.arange(nQ) * block_size
        n_own = (T - 1 - q0).clamp(max=block_size - 1)
        own = (slot >= lay.num_full[..., None]) & (slot < lay.num_full[..., None] + n_own[:, None])
        expect = q0[:, None] + 1 + slot - lay.num_full[..., None]
        assert torch.equal(lay.index.long()[own], expect[own])


@pytest.mark.parametrize("seed", range(12))
def test_gathered_layout_built_in_chunks_of_query_blocks_is_the_same(seed):
    B, H, T, sinks, window, topk, block_size, ties = fresh_draw(seed)
    ranks, cutoffs = random_inputs(seed, B, H, T, sinks, window, topk, ties=ties)
    for k in (topk, None):
        whole = gathered_layout(ranks, cutoffs, sinks, window, topk=k, block_size=block_size)
        for chunk in (1, 2, 3):
            part = gathered_layout(ranks, cutoffs, sinks, window, topk=k, block_size=block_size, chunk_blocks=chunk)
            assert part.capacity == whole.capacity
            for name in ("index", "key_pos", "key_end", "num_full", "num_used"):
                assert torch.equal(getattr(part, name), getattr(whole, name)), (name, chunk)
    with pytest.raises(KVLearnError, match="chunk_blocks=0 is invalid"):
        gathered_layout(ranks, cutoffs, sinks, window, topk=topk, chunk_blocks=0)


def tile_types(bm):
    """[B, H, q blocks, kv blocks]: 0 skipped, 1 partial (mask_mod applied), 2 full."""

    def dense(num, idx):
        n = idx.shape[-1]
        out = torch.zeros(*idx.shape[:-1], n + 1, dtype=torch.int64)
        live = torch.arange(n) < num[..., None]
        out.scatter_(-1, torch.where(live, idx, n).long(), 1)
        return out[..., :n]

    full = dense(bm.full_kv_num_blocks, bm.full_kv_indices) if bm.full_kv_num_blocks is not None else 0
    return dense(bm.kv_num_blocks, bm.kv_indices) + 2 * full


@pytest.mark.parametrize(
    "seed,B,Hkv,G,T,sinks,window,topk,block_size",
    [(0, 2, 2, 2, 100, 3, 8, 12, 16), (1, 1, 2, 3, 77, 0, 1, 5, 8), (2, 2, 1, 2, 64, 2, 100, 3, 16),
     (3, 1, 2, 2, 90, 1, 4, 0, 16), (4, 1, 2, 2, 50, 2, 3, 200, 16), (5, 1, 2, 1, 129, 4, 8, 16, 32)],
)
def test_gathered_block_mask_equals_create_block_mask(seed, B, Hkv, G, T, sinks, window, topk, block_size):
    ranks, cutoffs = random_inputs(seed, B, Hkv, T, sinks, window, topk, ties=seed % 2 == 0)
    lay = gathered_layout(ranks, cutoffs, sinks, window, topk=topk, block_size=block_size)
    bm = gathered_block_mask(lay, G)
    shape = (B * lay.num_blocks, Hkv * G, block_size, lay.capacity)
    assert bm.shape == shape
    ref = create_block_mask(bm.mask_mod, *shape, device="cpu", BLOCK_SIZE=block_size)
    assert torch.equal(tile_types(bm), tile_types(ref))
    # the mask_mod maps query head h to KV head h // G and block b to its interval rows
    mask = create_mask(bm.mask_mod, *shape, device="cpu")  # [B * nQ, Hq, BS, C]
    nQ, C = lay.num_blocks, lay.capacity
    q = torch.arange(nQ * block_size).view(nQ, block_size, 1)
    vis = (lay.key_pos[:, :, :, None, :] <= q) & (q < lay.key_end[:, :, :, None, :])  # [B, Hkv, nQ, BS, C]
    want = vis.transpose(1, 2).reshape(B * nQ, Hkv, block_size, C).repeat_interleave(G, dim=1)
    assert torch.equal(mask, want)


def test_gathered_bad_inputs_raise():
    ranks, cutoffs = random_inputs(0, 1, 2, 16, 1, 2, 3)
    with pytest.raises(KVLearnError, match="topk=-1"):
        gathered_layout(ranks, cutoffs, 1, 2, topk=-1)
    with pytest.raises(KVLearnError, match="block_size=0"):
        gathered_layout(ranks, cutoffs, 1, 2, topk=3, block_size=0)
    with pytest.raises(KVLearnError, match="zero window"):
        eviction_positions(ranks, cutoffs, 1, 0)
    with pytest.raises(KVLearnError, match="layout of type str"):
        gathered_block_mask("layout", 2)
    lay = gathered_layout(ranks, cutoffs, 1, 2, topk=3, block_size=4)
    with pytest.raises(KVLearnError, match="query_heads_per_kv=0"):
        gathered_block_mask(lay, 0)
    with pytest.raises(KVLearnError, match="seq_len=0"):
        gathered_capacity(0, 1, 2, 3)
