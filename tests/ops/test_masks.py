"""Retention mask: dense twin vs a python loop, mask_mod (GQA head mapping) vs dense, the budget, BlockMask.
(Visibility intervals and the gathered layout: test_gathered.py.)"""

import pytest
import torch
from torch.nn.attention.flex_attention import create_mask

from kvlearn.errors import KVLearnError
from kvlearn.ops.fenwick import running_topk_cutoff
from kvlearn.ops.masks import retention_block_mask, retention_mask_dense, retention_mask_mod


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
