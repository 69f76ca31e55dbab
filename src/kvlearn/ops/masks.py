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

The same predicate as visibility intervals (the default sparse attention path):

* :func:`eviction_positions`: ``end[t]`` such that key ``t`` is visible to ``q`` iff ``t <= q < end[t]``
  (the cutoffs are non-increasing in ``q``, so an evicted key never comes back).
* :func:`gathered_layout`: per query block, the keys any of its queries sees, gathered into a fixed number of
  slots (always-visible keys first, then the block's own tokens, then the keys evicted inside the block);
  :func:`gathered_block_mask` / :func:`gathered_mask_mod`: FlexAttention on that layout. Two backends with
  bit-identical layouts: ``torch`` (cumsums and searchsorted over a ``[batch, kv_heads, blocks, T]`` grid; the
  CPU default) and ``triton`` (:func:`kvlearn.ops.gathered_layout_triton.gathered_layout_triton`: one fused
  launch, one program per (batch, KV head, query block) scanning the ``end`` row; the CUDA default).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from kvlearn.errors import check
from kvlearn.ops.triton_support import HAS_TRITON as _HAS_TRITON


def _check_int(name: str, value, low: int) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    check(ok, f"{name}={value!r} is invalid: expected an integer >= {low}")


def _check_inputs(ranks, cutoffs, sinks, window) -> None:
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
    _check_int("sinks", sinks, 0)
    check(not (isinstance(window, int) and window == 0), "window=0 is invalid (zero window): expected an integer >= 1")
    _check_int("window", window, 1)


def retention_mask_dense(ranks: torch.Tensor, cutoffs: torch.Tensor, sinks: int, window: int) -> torch.Tensor:
    """Dense retention mask.

    Args:
        ranks: int32 ``[batch, kv_heads, T]``.
        cutoffs: int32 ``[batch, kv_heads, T]``.
        sinks: >= 0. window: >= 1.

    Returns:
        bool ``[batch, kv_heads, T, T]`` (query rows, key columns), True where the key is attended.
    """
    _check_inputs(ranks, cutoffs, sinks, window)
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
    _check_inputs(ranks, cutoffs, sinks, window)
    _check_int("query_heads_per_kv", query_heads_per_kv, 1)
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
    _check_inputs(ranks, cutoffs, sinks, window)
    _check_int("query_heads_per_kv", query_heads_per_kv, 1)
    _check_int("block_size", block_size, 1)
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
# Visibility intervals and the interval-gathered layout (the default sparse attention path).
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
    _check_inputs(ranks, cutoffs, sinks, window)
    T = ranks.shape[-1]
    if ranks.numel() == 0:
        return torch.empty_like(ranks)
    # -cutoffs is non-decreasing: the first q with -cutoffs[q] > -ranks[t] is the first q with cutoffs[q] < ranks[t]
    first = torch.searchsorted((-cutoffs).contiguous(), (-ranks).contiguous(), right=True, out_int32=True)
    t = torch.arange(T, device=ranks.device, dtype=torch.int32)
    end = torch.maximum(first, t + min(window, T)).clamp_(max=T)  # the window protects t up to t + window - 1
    return torch.where(t < sinks, torch.full_like(end, T), end)


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
        num_full: count of the leading always-visible slots. num_used: count of non-padding slots.
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
        _check_int(name, value, low)
    need = min(seq_len, sinks + window + topk + block_size - 1)
    return -(-need // block_size) * block_size


# Query blocks whose [batch, kv_heads, blocks, T] membership grid is built at once: at most this many elements
# (int32 cumsums over it), so long contexts stay bounded (T = 16k, 8 KV heads: all 128 blocks in one pass).
GRID_ELEMENTS = 1 << 26
LAYOUT_BACKENDS = ("auto", "torch", "triton")


def gathered_layout(
    ranks: torch.Tensor,
    cutoffs: torch.Tensor,
    sinks: int,
    window: int,
    topk: int | None = None,
    block_size: int = 128,
    chunk_blocks: int | None = None,
    backend: str = "auto",
) -> GatheredLayout:
    """The interval-gathered key layout (see :class:`GatheredLayout`).

    Args:
        ranks, cutoffs: int32 ``[batch, kv_heads, T]`` from :mod:`kvlearn.ops.fenwick` (cutoffs non-increasing).
        sinks: >= 0. window: >= 1.
        topk: the budget the cutoffs were computed with. Given, the capacity is the bound of
            :func:`gathered_capacity` and nothing syncs with the host (the cutoffs must really come from this
            ``topk``: a smaller one would truncate blocks silently). None: the capacity is the largest block's
            used count rounded up to ``block_size`` (one host sync; on CUDA a new capacity recompiles the kernel).
        block_size: query block and key tile size (>= 1; 128 for the CUDA kernel).
        chunk_blocks: torch backend: query blocks built at once (>= 1); None bounds the grid at
            :data:`GRID_ELEMENTS`. Ignored by the triton backend (it materialises no grid).
        backend: ``"auto"`` (triton when ``ranks`` is on CUDA and triton imports, else torch),
            ``"torch"`` or ``"triton"`` (:func:`kvlearn.ops.gathered_layout_triton.gathered_layout_triton`; CUDA,
            or the CPU under ``TRITON_INTERPRET=1``; with ``topk=None`` a counts-only launch sizes the capacity).
            Both give the same layout, bit for bit.

    Work is ``O(batch * kv_heads * num_blocks * T)`` either way. torch: two int32 cumsums and searchsorted over
    the ``[batch, kv_heads, blocks, T]`` grid, memory that of ``chunk_blocks`` blocks at a time. triton: one
    launch, no intermediate tensors.
    """
    _check_inputs(ranks, cutoffs, sinks, window)
    check(
        topk is None or (isinstance(topk, int) and not isinstance(topk, bool) and topk >= 0),
        f"topk={topk!r} is invalid: expected None or an integer >= 0",
    )
    _check_int("block_size", block_size, 1)
    check(chunk_blocks is None or (isinstance(chunk_blocks, int) and not isinstance(chunk_blocks, bool) and chunk_blocks >= 1),
          f"chunk_blocks={chunk_blocks!r} is invalid: expected None or an integer >= 1")
    check(backend in LAYOUT_BACKENDS, f"backend={backend!r} is invalid: expected one of {LAYOUT_BACKENDS}")
    B, H, T = ranks.shape
    check(T >= 1, f"seq length {T} is invalid: expected >= 1")
    if backend == "auto":
        backend = "triton" if (ranks.is_cuda and _HAS_TRITON) else "torch"
    if backend == "triton":  # gathered_layout_triton checks that triton is there and the device
        from kvlearn.ops.gathered_layout_triton import gathered_layout_triton  # imports this module

        capacity = None if topk is None else gathered_capacity(T, sinks, window, topk, block_size)
        return gathered_layout_triton(eviction_positions(ranks, cutoffs, sinks, window), block_size, capacity)
    dev = ranks.device
    BS = block_size
    nQ = -(-T // BS)
    Tp = nQ * BS
    end = eviction_positions(ranks, cutoffs, sinks, window)
    end = torch.where(end >= T, torch.full_like(end, Tp), end)  # never evicted: the padded rows see it too
    t = torch.arange(T, device=dev, dtype=torch.int32)
    step = chunk_blocks or max(1, GRID_ELEMENTS // max(1, B * H * T))
    chunks = [torch.arange(lo, min(nQ, lo + step), device=dev, dtype=torch.int32) * BS for lo in range(0, nQ, step)]
    if topk is None:
        used_max = max(int(_block_counts(end, t, q0, BS, T)[2].max()) for q0 in chunks)
        capacity = max(BS, -(-used_max // BS) * BS)
    else:
        capacity = gathered_capacity(T, sinks, window, topk, BS)
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


def gathered_mask_mod(layout: GatheredLayout, query_heads_per_kv: int):
    """FlexAttention ``mask_mod`` on the gathered layout.

    The kernel sees batch ``b = batch * num_blocks + block``, query head ``h`` (KV head ``h // G``), query row
    ``q_idx`` of the block and slot ``kv_idx``: visible iff ``key_pos <= q0 + q_idx < key_end``. The intervals are
    stored relative to the block start (``[batch * num_blocks, kv_heads, capacity]`` int32), so the closure does
    two loads and two compares.
    """
    check(isinstance(layout, GatheredLayout), f"layout of type {type(layout).__name__} is invalid: expected a GatheredLayout")
    _check_int("query_heads_per_kv", query_heads_per_kv, 1)
    rel_pos, rel_end = _relative_intervals(layout)
    return _make_gathered_mask_mod(rel_pos, rel_end, query_heads_per_kv)


def _relative_intervals(layout: GatheredLayout) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, nQ, C = layout.index.shape
    q0 = torch.arange(nQ, device=layout.index.device, dtype=torch.int32)[:, None] * layout.block_size

    def rel(x):
        return (x - q0).transpose(1, 2).reshape(B * nQ, H, C).contiguous()

    return rel(layout.key_pos), rel(layout.key_end)


def _make_gathered_mask_mod(rel_pos, rel_end, group: int):
    def mask_mod(b, h, q_idx, kv_idx):
        kv_head = h // group
        return (rel_pos[b, kv_head, kv_idx] <= q_idx) & (q_idx < rel_end[b, kv_head, kv_idx])

    return mask_mod


def gathered_block_mask(layout: GatheredLayout, query_heads_per_kv: int) -> BlockMask:
    """``BlockMask`` for FlexAttention on the gathered layout, built directly with ``BlockMask.from_kv_blocks``.

    Shape ``[batch * num_blocks, kv_heads * G, block_size, capacity]`` (one query block per kernel batch entry):
    full tiles are the ``num_full // block_size`` leading ones (every slot visible to every query: the mask_mod
    is skipped), partial tiles follow up to ``ceil(num_used / block_size)``, nothing beyond.
    """
    check(isinstance(layout, GatheredLayout), f"layout of type {type(layout).__name__} is invalid: expected a GatheredLayout")
    _check_int("query_heads_per_kv", query_heads_per_kv, 1)
    return _gathered_block_mask(layout, query_heads_per_kv, *_relative_intervals(layout))


def _gathered_block_mask(layout: GatheredLayout, G: int, rel_pos: torch.Tensor, rel_end: torch.Tensor) -> BlockMask:
    """:func:`gathered_block_mask` with the layout's relative intervals already computed (no validation)."""
    B, H, nQ, C = layout.index.shape
    BS = layout.block_size
    n_kv = C // BS
    full = layout.num_full // BS  # [B, H, nQ]
    total = ((layout.num_used + BS - 1) // BS).clamp(max=n_kv)
    cols = torch.arange(n_kv, device=full.device, dtype=torch.int32)
    part_idx = (cols + full[..., None]).clamp(max=n_kv - 1)  # entries past the count are never read
    full_idx = cols.expand(B, H, nQ, n_kv)

    def per_query_head(x):  # [B, H, nQ, ...] -> [B * nQ, H * G, 1, ...]
        x = x.transpose(1, 2).reshape(B * nQ, H, *x.shape[3:]).repeat_interleave(G, dim=1)
        return x.unsqueeze(2).contiguous().to(torch.int32)

    return BlockMask.from_kv_blocks(
        per_query_head(total - full),
        per_query_head(part_idx),
        per_query_head(full),
        per_query_head(full_idx),
        BLOCK_SIZE=BS,
        mask_mod=_make_gathered_mask_mod(rel_pos, rel_end, G),
        seq_lengths=(BS, C),
    )


__all__ = [
    "GatheredLayout",
    "LAYOUT_BACKENDS",
    "eviction_positions",
    "gathered_block_mask",
    "gathered_capacity",
    "gathered_layout",
    "gathered_mask_mod",
    "retention_block_mask",
    "retention_mask_dense",
    "retention_mask_mod",
]
