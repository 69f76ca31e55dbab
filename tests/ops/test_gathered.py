"""Visibility intervals (eviction_positions) and the gathered layout vs the dense retention mask; the layout built
in chunks; its BlockMask vs create_block_mask."""

import os
import sys

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, create_mask

from kvlearn.errors import KVLearnError
from kvlearn.ops.gathered import gathered_block_mask, gathered_layout
from kvlearn.ops.gathered_layout import gathered_capacity
from kvlearn.ops.masks import eviction_positions, retention_mask_dense

sys.path.insert(0, os.path.dirname(__file__))
from test_masks import random_inputs  # noqa: E402  (the generator of the retention mask tests)


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
     (3, 1, 2, 2, 90, 1, 4, 0, 16), (4, 1, 2, 2, 50, 2, 3, 200, 16), (5, 1, 2, 1, 129, 4, 8, 16, 32),
     (6, 2, 2, 2, 300, 4, 16, 40, 16)],
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
    # the directly built query-major tables (the backward's) equal torch's general transpose of the key-major ones
    general = BlockMask.from_kv_blocks(bm.kv_num_blocks, bm.kv_indices, bm.full_kv_num_blocks, bm.full_kv_indices,
                                       BLOCK_SIZE=block_size, mask_mod=bm.mask_mod, seq_lengths=bm.seq_lengths)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
                 "full_q_num_blocks", "full_q_indices"):
        got, ref_table = getattr(bm, name), getattr(general, name)
        assert got.dtype == ref_table.dtype == torch.int32 and got.is_contiguous(), name
        assert torch.equal(got, ref_table), name
    assert bm.BLOCK_SIZE == general.BLOCK_SIZE and bm.seq_lengths == general.seq_lengths
    if seed == 6:  # the long case has both kinds of tile
        assert bool((bm.full_kv_num_blocks > 0).any()) and bool((bm.kv_num_blocks > 0).any())


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
