"""Sparse retention on the interval-gathered layout: the layout from ``(ranks, cutoffs)``, and FlexAttention on it.

* :func:`gathered_layout`: :func:`kvlearn.ops.masks.eviction_positions`, then the layout
  (:class:`kvlearn.ops.gathered_layout.GatheredLayout`) by one of two bit-identical builds: ``torch``
  (:func:`~kvlearn.ops.gathered_layout.gathered_layout_torch`, the CPU default) or ``triton``
  (:func:`~kvlearn.ops.gathered_layout_triton.gathered_layout_triton`, one fused launch, the CUDA default).
* :func:`relative_intervals` and :func:`gathered_block_mask`: FlexAttention on the layout, one query block per
  kernel batch entry. (The fused Triton forward on the layout is :mod:`kvlearn.ops.gathered_triton`.)
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from kvlearn.errors import check, check_int, is_int
from kvlearn.ops.gathered_layout import GatheredLayout, gathered_capacity, gathered_layout_torch
from kvlearn.ops.gathered_layout_triton import gathered_layout_triton
from kvlearn.ops.masks import check_retention_inputs, eviction_positions
from kvlearn.ops.triton_support import HAS_TRITON

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
    """The interval-gathered key layout (see :class:`~kvlearn.ops.gathered_layout.GatheredLayout`).

    Args:
        ranks, cutoffs: int32 ``[batch, kv_heads, T]`` from :mod:`kvlearn.ops.fenwick` (cutoffs non-increasing).
        sinks: >= 0. window: >= 1.
        topk: the budget the cutoffs were computed with. Given, the capacity is the bound of
            :func:`~kvlearn.ops.gathered_layout.gathered_capacity` and nothing syncs with the host (the cutoffs
            must really come from this ``topk``: a smaller one would truncate blocks silently). None: the capacity
            is the largest block's used count rounded up to ``block_size`` (one host sync; on CUDA a new capacity
            recompiles the kernel).
        block_size: query block and key tile size (>= 1; 128 for the CUDA kernel).
        chunk_blocks: torch backend: query blocks built at once (>= 1); None bounds the grid at
            :data:`kvlearn.ops.gathered_layout.GRID_ELEMENTS`. Ignored by the triton backend (it materialises no
            grid).
        backend: ``"auto"`` (triton when ``ranks`` is on CUDA and triton imports, else torch),
            ``"torch"`` or ``"triton"`` (CUDA, or the CPU under ``TRITON_INTERPRET=1``; with ``topk=None`` a
            counts-only launch sizes the capacity). Both give the same layout, bit for bit.

    Returns:
        :class:`~kvlearn.ops.gathered_layout.GatheredLayout`: slots int32 ``[batch, kv_heads, ceil(T /
        block_size), capacity]``, counts int32 ``[batch, kv_heads, ceil(T / block_size)]``.
    """
    check_retention_inputs(ranks, cutoffs, sinks, window)
    check(topk is None or (is_int(topk) and topk >= 0), f"topk={topk!r} is invalid: expected None or an integer >= 0")
    check_int("block_size", block_size, 1)
    check(chunk_blocks is None or (is_int(chunk_blocks) and chunk_blocks >= 1),
          f"chunk_blocks={chunk_blocks!r} is invalid: expected None or an integer >= 1")
    check(backend in LAYOUT_BACKENDS, f"backend={backend!r} is invalid: expected one of {LAYOUT_BACKENDS}")
    T = ranks.shape[-1]
    check(T >= 1, f"seq length {T} is invalid: expected >= 1")
    if backend == "auto":
        backend = "triton" if (ranks.is_cuda and HAS_TRITON) else "torch"
    capacity = None if topk is None else gathered_capacity(T, sinks, window, topk, block_size)
    end = eviction_positions(ranks, cutoffs, sinks, window)
    if backend == "triton":  # gathered_layout_triton checks that triton is there and the device
        return gathered_layout_triton(end, block_size, capacity)
    return gathered_layout_torch(end, block_size, capacity, chunk_blocks=chunk_blocks)


def _check_layout(layout) -> None:
    check(isinstance(layout, GatheredLayout),
          f"layout of type {type(layout).__name__} is invalid: expected a GatheredLayout")


def relative_intervals(layout: GatheredLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots' visibility intervals relative to their block start, one query block per kernel batch entry.

    Returns:
        ``(rel_pos, rel_end)``, int32 ``[batch * num_blocks, kv_heads, capacity]`` (batch-major: entry
        ``b * num_blocks + i`` is block ``i`` of batch ``b``): query row ``r`` of block ``i`` sees slot ``s`` iff
        ``rel_pos[., s] <= r < rel_end[., s]``.
    """
    _check_layout(layout)
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


def gathered_block_mask(
    layout: GatheredLayout,
    query_heads_per_kv: int,
    intervals: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> BlockMask:
    """``BlockMask`` for FlexAttention on the gathered layout, its key-major and query-major tables built directly.

    Shape ``[batch * num_blocks, kv_heads * G, block_size, capacity]`` (one query block per kernel batch entry,
    query head ``h`` reads KV head ``h // G``): full tiles are the ``num_full // block_size`` leading ones (every
    slot visible to every query: the mask_mod is skipped), partial tiles follow up to
    ``ceil(num_used / block_size)``, nothing beyond. The ``mask_mod`` (visible iff ``rel_pos <= q_idx < rel_end``)
    closes over ``intervals``: :func:`relative_intervals` of ``layout``, computed here when None.

    With one query block per entry, the query-major tables the backward reads (``q_num_blocks``, ``q_indices`` and
    their full twins) are closed forms: key tile ``j`` is read by query block 0 iff it lies in its range. They are
    built here with a few tensor operations instead of ``BlockMask.from_kv_blocks``' general transpose (a vmapped
    dense scatter whose host time was 3.7 ms of every layer's training forward under cProfile on the H200,
    ``results/raw/retrofit_step_host_profile_retrofit_kvpop_mlp_3807658.txt``); ``tests/ops/test_gathered.py``
    checks both give the same tables.
    """
    _check_layout(layout)
    G = check_int("query_heads_per_kv", query_heads_per_kv, 1)
    rel_pos, rel_end = relative_intervals(layout) if intervals is None else intervals
    B, H, nQ, C = layout.index.shape
    BS = layout.block_size
    n_kv = C // BS
    full = layout.num_full // BS  # [B, H, nQ]
    total = ((layout.num_used + BS - 1) // BS).clamp(max=n_kv)

    def per_query_head(x):  # [B, H, nQ, ...] -> [B * nQ, H * G, ...]
        x = x.transpose(1, 2).reshape(B * nQ, H, *x.shape[3:]).repeat_interleave(G, dim=1)
        return x.contiguous().to(torch.int32)

    full, total = per_query_head(full), per_query_head(total)  # [B * nQ, H * G]
    cols = torch.arange(n_kv, device=full.device, dtype=torch.int32)
    # key-major: the full tiles 0 .. full - 1, the partial tiles full .. total - 1 (entries past a count are never
    # read; they are clamped into range)
    kv_num = (total - full).unsqueeze(-1)  # [B * nQ, H * G, 1]
    kv_idx = (cols + full[..., None]).clamp(max=n_kv - 1).unsqueeze(2).contiguous()  # [B * nQ, H * G, 1, n_kv]
    full_kv_num = full.unsqueeze(-1).contiguous()
    full_kv_idx = cols.expand(B * nQ, H * G, 1, n_kv).contiguous()
    # query-major: key tile j is read (by the one query block, index 0) iff it lies in the range
    q_num = ((cols >= full[..., None]) & (cols < total[..., None])).to(torch.int32)  # [B * nQ, H * G, n_kv]
    full_q_num = (cols < full[..., None]).to(torch.int32)
    q_idx = torch.zeros_like(q_num).unsqueeze(-1)  # [B * nQ, H * G, n_kv, 1]
    return BlockMask(
        (BS, C),
        kv_num.contiguous(), kv_idx, full_kv_num, full_kv_idx,
        q_num, q_idx, full_q_num, q_idx.clone(),
        (BS, BS),
        _make_gathered_mask_mod(rel_pos, rel_end, G),
    )


__all__ = ["LAYOUT_BACKENDS", "gathered_block_mask", "gathered_layout", "relative_intervals"]
