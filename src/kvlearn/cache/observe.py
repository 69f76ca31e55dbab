"""The attention a policy asks for, computed blockwise after attending (float32, aggregated per KV head).

Only policies that declare an :class:`~kvlearn.cache.policy.AttentionRequest` pay for this; the attention output
itself comes from SDPA as for every other policy. Queries are processed in blocks of ``block`` rows, so the
largest temporary is ``[batch, q_heads, block, kv]`` float32: a 4096-token forward never materialises its
``[q, kv]`` probabilities for all heads at once.
"""

from __future__ import annotations

import torch

from .policy import AttentionRequest

DEFAULT_QUERY_BLOCK = 128


def query_weights(request: AttentionRequest, positions: torch.Tensor) -> torch.Tensor:
    """Which queries count: ``[batch, q]`` float32, 1 for the selected real queries, 0 otherwise.

    ``positions``: ``[batch, q]`` (``-1`` = padding). ``"last"`` selects the real queries whose position is among the
    row's last ``n`` positions of this forward."""
    real = positions >= 0
    if request.queries == "all":
        return real.float()
    last = positions.max(dim=1, keepdim=True).values
    return (real & (positions > last - request.n)).float()


def attention_summary(query: torch.Tensor, key: torch.Tensor, mask: torch.Tensor, scaling: float | None,
                      request: AttentionRequest, positions: torch.Tensor, block: int = DEFAULT_QUERY_BLOCK) -> torch.Tensor:
    """Sum over the selected queries of the attention probabilities, aggregated over each KV head's query heads.

    Args:
        query: ``[batch, q_heads, q, head_dim]``; key: ``[batch, kv_heads, kv, head_dim]`` (the keys attended).
        mask: ``[batch, P, q, kv]`` bool visibility (``P`` = 1 or kv_heads).
        positions: ``[batch, q]`` query positions (``-1`` = padding, never counted).
    Returns:
        ``[batch, kv_heads, kv]`` float32: ``sum_{i selected} p[h, i, j]`` then mean (or sum) over the group's heads.
    """
    b, hq, q, d = query.shape
    hkv, kv = key.shape[1], key.shape[2]
    g = hq // hkv
    scale = scaling if scaling is not None else d ** -0.5
    weights = query_weights(request, positions)  # [b, q]
    k = key.float()
    out = torch.zeros(b, hkv, g, kv, dtype=torch.float32, device=query.device)
    first = 0
    if q > 1:  # prefill: skip the blocks with no selected query (one host sync; never on the decode path)
        cols = torch.nonzero(weights.sum(dim=0) > 0)
        first = int(cols.min()) if cols.numel() else q
    for a in range((first // block) * block, q, block):
        z = min(q, a + block)
        qb = query[:, :, a:z].float().reshape(b, hkv, g, z - a, d)
        logits = torch.einsum("bhgqd,bhkd->bhgqk", qb, k) * scale
        m = mask[:, :, a:z][:, :, None]  # [b, P, 1, blk, kv]
        logits = logits.masked_fill(~m, float("-inf"))
        probs = torch.softmax(logits, dim=-1).nan_to_num(0.0)
        out += torch.einsum("bhgqk,bq->bhgk", probs, weights[:, a:z])
    return out.mean(dim=2) if request.group == "mean" else out.sum(dim=2)
