"""The interval-gathered layout of sparse retention: its type, its size bound and its torch build.

Every key ``t`` of one (batch, KV head) is visible to the queries ``t <= q < end[t]``
(:func:`kvlearn.ops.masks.eviction_positions`). Per query block the keys any of its queries sees are gathered
into a fixed number of slots (:class:`GatheredLayout`), so attention runs on ``capacity`` slots per block
instead of the ``T`` keys.

Two builds with the same signature and bit-identical results (every field, dtype and shape):

* :func:`gathered_layout_torch` (here, the reference; the CPU default): two int32 cumsums and two searchsorted
  calls over a ``[batch, kv_heads, blocks, T]`` membership grid, :data:`GRID_ELEMENTS` at a time.
* :func:`kvlearn.ops.gathered_layout_triton.gathered_layout_triton` (the CUDA default): one fused launch.

:func:`kvlearn.ops.gathered.gathered_layout` builds it from ``(ranks, cutoffs)`` with either.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvlearn.errors import check, check_int, is_int


class GatheredLayout(NamedTuple):
    """Per (batch, KV head, query block) the keys any query of the block can see, gathered into ``capacity`` slots.

    Query block ``i`` covers ``q0 = i * block_size .. q1 = q0 + block_size - 1`` (the sequence is padded to
    ``num_blocks * block_size``; the padded query rows are discarded by the caller and see what query ``T - 1``
    sees, so no row is empty). Slots, in this order:

    1. ``[0, num_full)``: keys visible to every query of the block (``t <= q0`` and ``end > q1``), by position;
    2. the block's own tokens ``q0 < t <= min(q1, T - 1)`` (a causal triangle);
    3. keys evicted inside the block (``t <= q0`` and ``q0 < end <= q1``), by position;
    4. ``[num_used, capacity)``: padding (``index`` 0, ``key_pos`` = padded length, ``key_end`` 0: never visible).

    Fields (int32; slots ``[batch, kv_heads, num_blocks, capacity]``, counts ``[batch, kv_heads, num_blocks]``):
        index: key position to gather per slot (0 on padding slots).
        key_pos, key_end: the slot's visibility interval ``key_pos <= q < key_end`` in absolute query positions;
            a key never evicted inside the sequence has ``key_end`` = the padded length (so padded rows see it).
        num_full: count of the leading always-visible slots. num_used: count of non-padding slots (not clamped
            to ``capacity``: a block with more is truncated to its first ``capacity`` slots).
        block_size, seq_len (``T``), capacity: python ints.
    """

    index: torch.Tensor
    key_pos: torch.Tensor
    key_end: torch.Tensor
    num_full: torch.Tensor
    num_used: torch.Tensor
    block_size: int
    seq_len: int
    capacity: int

    @property
    def num_blocks(self) -> int:
        return self.index.shape[2]

    def tiles_computed(self) -> torch.Tensor:
        """int64 scalar tensor: (query block, key block) tiles the kernel visits, summed over batch and KV heads."""
        return ((self.num_used + self.block_size - 1) // self.block_size).sum()


def gathered_capacity(seq_len: int, sinks: int, window: int, topk: int, block_size: int = 128) -> int:
    """Slots per query block that always suffice: ``round_up(min(T, s + w + k + block_size - 1), block_size)``.

    The keys visible to the block's first query ``q0`` are at most ``s + w + k`` (Eq. 1), the union over the
    block only adds its own ``block_size - 1`` later tokens, and it never holds more than the ``T`` keys.
    """
    for name, value, low in (("seq_len", seq_len, 1), ("sinks", sinks, 0), ("window", window, 1), ("topk", topk, 0),
                             ("block_size", block_size, 1)):
        check_int(name, value, low)
    need = min(seq_len, sinks + window + topk + block_size - 1)
    return -(-need // block_size) * block_size


def check_end_inputs(end, block_size, capacity) -> None:
    """One-line errors for the arguments both builds share: ``end`` int32 ``[batch, kv_heads, T >= 1]``,
    ``block_size >= 1``, ``capacity`` None or a positive multiple of ``block_size``."""
    check(isinstance(end, torch.Tensor), f"end of type {type(end).__name__} is invalid: expected a torch.Tensor")
    check(end.dim() == 3, f"end with shape {tuple(end.shape)} is invalid: expected 3 dims [batch, kv_heads, seq]")
    check(end.dtype == torch.int32, f"end with dtype {end.dtype} is invalid: expected torch.int32")
    check(end.shape[-1] >= 1, f"seq length {end.shape[-1]} is invalid: expected >= 1")
    check_int("block_size", block_size, 1)
    check(capacity is None or (is_int(capacity) and capacity >= block_size and capacity % block_size == 0),
          f"capacity={capacity!r} is invalid: expected None or a positive multiple of block_size={block_size}")


def capacity_for(used_max: int, block_size: int) -> int:
    """The data-sized capacity: the largest block's used slot count rounded up to ``block_size`` (at least one
    block)."""
    return max(block_size, -(-used_max // block_size) * block_size)


# Query blocks whose [batch, kv_heads, blocks, T] membership grid is built at once: at most this many elements
# (int32 cumsums over it), so long contexts stay bounded (T = 16k, 8 KV heads: all 128 blocks in one pass).
GRID_ELEMENTS = 1 << 26


def gathered_layout_torch(
    end: torch.Tensor, block_size: int, capacity: int | None, *, chunk_blocks: int | None = None
) -> GatheredLayout:
    """The interval-gathered layout from the eviction positions, in torch (the reference build).

    Args:
        end: int32 ``[batch, kv_heads, T]``, :func:`kvlearn.ops.masks.eviction_positions` (``end[t]`` in
            ``[t + 1, T]``; values are not checked). Values ``>= T`` mean "never evicted".
        block_size: query block size (>= 1).
        capacity: slots per query block, a positive multiple of ``block_size``
            (:func:`gathered_capacity`; blocks with more used slots are truncated to their first ``capacity``
            slots). None: the largest block's used count rounded up to ``block_size`` (one host sync).
        chunk_blocks: query blocks built at once (>= 1); None bounds the grid at :data:`GRID_ELEMENTS`.

    Returns:
        :class:`GatheredLayout` with ``num_blocks = ceil(T / block_size)``. Work is ``O(batch * kv_heads *
        num_blocks * T)``: two int32 cumsums and searchsorted over the ``[batch, kv_heads, blocks, T]`` grid, in
        memory ``chunk_blocks`` blocks at a time.
    """
    check_end_inputs(end, block_size, capacity)
    check(chunk_blocks is None or (is_int(chunk_blocks) and chunk_blocks >= 1),
          f"chunk_blocks={chunk_blocks!r} is invalid: expected None or an integer >= 1")
    B, H, T = end.shape
    dev = end.device
    BS = block_size
    nQ = -(-T // BS)
    Tp = nQ * BS
    end = torch.where(end >= T, torch.full_like(end, Tp), end)  # never evicted: the padded rows see it too
    t = torch.arange(T, device=dev, dtype=torch.int32)
    step = chunk_blocks or max(1, GRID_ELEMENTS // max(1, B * H * T))
    chunks = [torch.arange(lo, min(nQ, lo + step), device=dev, dtype=torch.int32) * BS for lo in range(0, nQ, step)]
    if capacity is None:
        used_max = max(int(_block_counts(end, t, q0, BS, T)[2].max()) if end.numel() else 0 for q0 in chunks)
        capacity = capacity_for(used_max, BS)
    parts = [_layout_blocks(end, t, q0, BS, T, Tp, capacity) for q0 in chunks]
    index, key_pos, key_end, n_always, used = (torch.cat(x, dim=2) if len(parts) > 1 else x[0] for x in zip(*parts))
    return GatheredLayout(index, key_pos, key_end, n_always, used, BS, T, capacity)


def _block_counts(end, t, q0, BS: int, T: int):
    """For query blocks starting at ``q0 [n]``: running counts of the always-visible and evicted-in-block keys
    (int32 ``[B, H, n, T]``) and the used slots per block ``[B, H, n]``."""
    q1 = q0 + (BS - 1)
    e = end[:, :, None, :]  # [B, H, 1, T]
    old = t[None, :] <= q0[:, None]  # [n, T]
    c_always = (old & (e > q1[:, None])).cumsum(-1, dtype=torch.int32)
    c_evicted = (old & (e > q0[:, None]) & (e <= q1[:, None])).cumsum(-1, dtype=torch.int32)
    n_own = (T - 1 - q0).clamp(max=BS - 1)  # [n]: the block's own tokens after q0
    used = c_always[..., -1] + n_own + c_evicted[..., -1]
    return c_always, c_evicted, used


def _layout_blocks(end, t, q0, BS: int, T: int, Tp: int, capacity: int):
    """The :class:`GatheredLayout` fields of the query blocks starting at ``q0 [n]``."""
    c_always, c_evicted, used = _block_counts(end, t, q0, BS, T)
    B, H = end.shape[:2]
    n_always = c_always[..., -1]  # [B, H, n]
    off_evicted = n_always + (T - 1 - q0).clamp(max=BS - 1)  # first slot of the evicted-in-block keys
    slot = torch.arange(capacity, device=end.device, dtype=torch.int32)  # [C]
    shape = (B, H, q0.shape[0], capacity)
    # the j-th always-visible key is the first t where the running count reaches j + 1 (same for evicted keys)
    t_always = torch.searchsorted(c_always, (slot + 1).expand(shape).contiguous(), out_int32=True)
    rank_ev = (slot - off_evicted[..., None] + 1).clamp(min=1)
    t_evicted = torch.searchsorted(c_evicted, rank_ev.contiguous(), out_int32=True)
    del c_always, c_evicted
    t_own = q0[:, None] + 1 + (slot - n_always[..., None])
    pad = torch.full_like(t_own, -1)
    index = torch.where(
        slot < n_always[..., None],
        t_always,
        torch.where(slot < off_evicted[..., None], t_own, torch.where(slot < used[..., None], t_evicted, pad)),
    )
    valid = index >= 0
    index = index.clamp(min=0, max=T - 1)
    key_pos = torch.where(valid, index, torch.full_like(index, Tp))
    key_end = torch.where(valid, end.gather(-1, index.reshape(B, H, -1)).view(shape), torch.zeros_like(index))
    return index, key_pos, key_end, n_always, used


__all__ = ["GRID_ELEMENTS", "GatheredLayout", "capacity_for", "check_end_inputs", "gathered_capacity",
           "gathered_layout_torch"]
