"""The KVpop retention predicate (Eq. 26 of the KVpop paper, intersected with causality).

For query ``q`` and key ``t`` of one (batch, KV head)::

    M[q, t] = t <= q and ( t < sinks                                   # sink
                           or q - t < window                           # protected recent window
                           or (sinks <= t <= q - window                # eligible ...
                               and ranks[t] <= cutoffs[q]) )           # ... and inside the running top-k

``ranks`` and ``cutoffs`` come from :mod:`kvlearn.ops.fenwick` (int32 ``[batch, kv_heads, T]``; cutoff ``T``
keeps every eligible token, ``-1`` none). Three executions of the same predicate:

* :func:`retention_mask_dense`: a dense bool ``[batch, kv_heads, T, T]`` (tests, small T, reference).
* :func:`retention_mask_mod`: a FlexAttention ``mask_mod`` closing over the tensors; FlexAttention passes the
  QUERY head index ``h`` (with ``enable_gqa`` the key/value heads are ``repeat_interleave``-d, so query head
  ``h`` reads KV head ``h // query_heads_per_kv``).
* :func:`retention_block_mask`: the ``BlockMask`` FlexAttention needs, built at KV-head granularity and
  expanded to the query heads (every query head of a group shares its KV head's mask).

The same predicate as visibility intervals (what the default sparse attention path is built from):

* :func:`eviction_positions`: ``end[t]`` such that key ``t`` is visible to ``q`` iff ``t <= q < end[t]``
  (the cutoffs are non-increasing in ``q``, so an evicted key never comes back); the interval-gathered layout of
  :mod:`kvlearn.ops.gathered` is built from it.

:func:`check_retention_inputs` is the validation every consumer of ``(ranks, cutoffs, sinks, window)`` shares.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from kvlearn.errors import check, check_int, is_int


def check_retention_inputs(ranks, cutoffs, sinks, window) -> None:
    """One-line :class:`~kvlearn.errors.KVLearnError` unless ``ranks`` and ``cutoffs`` are int32
    ``[batch, kv_heads, T]`` tensors of one shape and device, ``sinks >= 0`` and ``window >= 1`` (integers)."""
    for name, tensor in (("ranks", ranks), ("cutoffs", cutoffs)):
        check(
            isinstance(tensor, torch.Tensor),
            f"{name} of type {type(tensor).__name__} is invalid: expected a torch.Tensor",
        )
        check(
            tensor.dim() == 3,
            f"{name} with shape {tuple(tensor.shape)} is invalid: expected 3 dims [batch, kv_heads, seq]",
        )
        check(tensor.dtype == torch.int32, f"{name} with dtype {tensor.dtype} is invalid: expected torch.int32")
    check(
        ranks.shape == cutoffs.shape,
        f"cutoffs shape {tuple(cutoffs.shape)} is invalid: expected the ranks shape {tuple(ranks.shape)}",
    )
    check(
        ranks.device == cutoffs.device,
        f"cutoffs on {cutoffs.device} is invalid: expected the ranks device {ranks.device}",
    )
    check_int("sinks", sinks, 0)
    check(not (is_int(window) and window == 0), "window=0 is invalid (zero window): expected an integer >= 1")
    check_int("window", window, 1)


def retention_mask_dense(ranks: torch.Tensor, cutoffs: torch.Tensor, sinks: int, window: int) -> torch.Tensor:
    """Dense retention mask.

    Args:
        ranks: int32 ``[batch, kv_heads, T]``.
        cutoffs: int32 ``[batch, kv_heads, T]``.
        sinks: >= 0. window: >= 1.

    Returns:
        bool ``[batch, kv_heads, T, T]`` (query rows, key columns), True where the key is attended.
    """
    check_retention_inputs(ranks, cutoffs, sinks, window)
    T = ranks.shape[-1]
    q = torch.arange(T, device=ranks.device)[:, None]
    t = torch.arange(T, device=ranks.device)[None, :]
    causal = t <= q
    sink = t < sinks
    recent = (q - t) < window
    eligible = (t >= sinks) & (t <= q - window)
    in_topk = ranks[:, :, None, :] <= cutoffs[:, :, :, None]
    return causal & (sink | recent | (eligible & in_topk))


def retention_mask_mod(
    ranks: torch.Tensor, cutoffs: torch.Tensor, sinks: int, window: int, query_heads_per_kv: int
):
    """FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool`` for the retention predicate.

    Args:
        ranks, cutoffs: int32 ``[batch, kv_heads, T]``.
        sinks: >= 0. window: >= 1.
        query_heads_per_kv: GQA group size G; the mask_mod's ``h`` is a query head in ``[0, kv_heads * G)``
            and reads KV head ``h // G``.
    """
    check_retention_inputs(ranks, cutoffs, sinks, window)
    check_int("query_heads_per_kv", query_heads_per_kv, 1)
    return _make_mask_mod(ranks, cutoffs, sinks, window, query_heads_per_kv)


def _make_mask_mod(ranks, cutoffs, sinks: int, window: int, group: int):
    def mask_mod(b, h, q_idx, kv_idx):
        kv_head = h // group
        causal = kv_idx <= q_idx
        sink = kv_idx < sinks
        recent = (q_idx - kv_idx) < window
        eligible = (kv_idx >= sinks) & (kv_idx <= q_idx - window)
        in_topk = ranks[b, kv_head, kv_idx] <= cutoffs[b, kv_head, q_idx]
        return causal & (sink | recent | (eligible & in_topk))

    return mask_mod


_COMPILED_CREATE_BLOCK_MASK = None


def _create_block_mask_fn(device: torch.device):
    """``create_block_mask``, compiled once per process on CUDA (eager elsewhere)."""
    global _COMPILED_CREATE_BLOCK_MASK
    if device.type != "cuda":
        return create_block_mask
    if _COMPILED_CREATE_BLOCK_MASK is None:
        _COMPILED_CREATE_BLOCK_MASK = torch.compile(create_block_mask)
    return _COMPILED_CREATE_BLOCK_MASK


def retention_block_mask(
    ranks: torch.Tensor,
    cutoffs: torch.Tensor,
    sinks: int,
    window: int,
    query_heads_per_kv: int,
    block_size: int = 128,
) -> BlockMask:
    """FlexAttention ``BlockMask`` of the retention predicate for ``kv_heads * query_heads_per_kv`` query heads.

    Args:
        ranks, cutoffs: int32 ``[batch, kv_heads, T]``.
        sinks: >= 0. window: >= 1. query_heads_per_kv: GQA group size G >= 1. block_size: >= 1.

    Returns:
        BlockMask of shape ``[batch, kv_heads * G, T, T]`` whose ``mask_mod`` is :func:`retention_mask_mod`.
        The block structure is computed once per KV head and repeated over its G query heads.
    """
    check_retention_inputs(ranks, cutoffs, sinks, window)
    check_int("query_heads_per_kv", query_heads_per_kv, 1)
    check_int("block_size", block_size, 1)
    B, H, T = ranks.shape
    G = query_heads_per_kv
    build = _create_block_mask_fn(ranks.device)
    kv_mask = build(
        _make_mask_mod(ranks, cutoffs, sinks, window, 1), B, H, T, T, device=ranks.device, BLOCK_SIZE=block_size
    )
    if G == 1:
        return kv_mask

    def expand(x):
        return None if x is None else x.repeat_interleave(G, dim=1)

    return BlockMask.from_kv_blocks(
        expand(kv_mask.kv_num_blocks),
        expand(kv_mask.kv_indices),
        expand(kv_mask.full_kv_num_blocks),
        expand(kv_mask.full_kv_indices),
        BLOCK_SIZE=kv_mask.BLOCK_SIZE,
        mask_mod=_make_mask_mod(ranks, cutoffs, sinks, window, G),
        seq_lengths=(T, T),
    )


# ----------------------------------------------------------------------------------------------------------
# The same predicate as visibility intervals (what the gathered layout of kvlearn.ops.gathered is built from).
# ----------------------------------------------------------------------------------------------------------


def eviction_positions(ranks: torch.Tensor, cutoffs: torch.Tensor, sinks: int, window: int) -> torch.Tensor:
    """End of every key's visibility interval: key ``t`` is visible to query ``q`` iff ``t <= q < end[t]``.

    This rests on ``cutoffs`` being non-increasing in ``q``, which holds for every output of
    :func:`kvlearn.ops.fenwick.running_cutoff`: ``T`` while fewer than ``topk`` tokens are eligible (including the
    queries with no eligible token yet), then the ``topk``-th smallest rank of a growing set; ``-1`` everywhere
    when ``topk == 0``. It is not checked (that would need a device sync). An eligible key therefore drops out at
    the first query ``q >= t + window`` with ``cutoffs[q] < ranks[t]`` and never comes back; a sink never drops.

    Args:
        ranks, cutoffs: int32 ``[batch, kv_heads, T]`` (see :mod:`kvlearn.ops.fenwick`).
        sinks: >= 0. window: >= 1.

    Returns:
        int32 ``[batch, kv_heads, T]`` in ``[t + 1, T]``: ``T`` for sinks and for keys never evicted inside the
        sequence, else ``max(t + window, first q with cutoffs[q] < ranks[t])``.
    """
    check_retention_inputs(ranks, cutoffs, sinks, window)
    T = ranks.shape[-1]
    if ranks.numel() == 0:
        return torch.empty_like(ranks)
    # -cutoffs is non-decreasing: the first q with -cutoffs[q] > -ranks[t] is the first q with cutoffs[q] < ranks[t]
    first = torch.searchsorted((-cutoffs).contiguous(), (-ranks).contiguous(), right=True, out_int32=True)
    t = torch.arange(T, device=ranks.device, dtype=torch.int32)
    end = torch.maximum(first, t + min(window, T)).clamp_(max=T)  # the window protects t up to t + window - 1
    return torch.where(t < sinks, torch.full_like(end, T), end)


__all__ = [
    "check_retention_inputs",
    "eviction_positions",
    "retention_block_mask",
    "retention_mask_dense",
    "retention_mask_mod",
]
