"""Fused Triton build of the interval-gathered layout (:class:`kvlearn.ops.gathered_layout.GatheredLayout`).

:func:`gathered_layout_triton` computes, in one launch, what its reference twin
:func:`kvlearn.ops.gathered_layout.gathered_layout_torch` (same signature) builds from a ``[batch, kv_heads,
num_blocks, T]`` grid with two int32 cumsums and two searchsorted calls; the result is bit-identical (every field,
dtype and shape).

* One program per (query block, batch, KV head), a 1-D grid, latest query blocks first (they scan the most keys).
  The program of query block ``i`` (``q0 = i * block_size``, ``q1 = q0 + block_size - 1``) reads ``end[b, h, :]`` of
  :func:`kvlearn.ops.masks.eviction_positions` in chunks of ``CH`` keys; a value ``>= T`` (never evicted) is read
  as the padded length ``Tp = num_blocks * block_size``, so the padded query rows of the last block see it.
* Pass 1 counts the always-visible keys ``t <= q0, end[t] > q1`` (``num_full``): the block's own tokens and the
  keys evicted inside the block are placed after them.
* Pass 2 scans ``t <= min(q1, T - 1)`` once more and writes every key to its slot: always-visible keys to
  ``[0, num_full)`` and keys evicted inside the block (``t <= q0``, ``q0 < end[t] <= q1``) to
  ``[num_full + n_own, num_used)``, both in position order (one ``tl.cumsum`` per chunk over the two indicator
  bits packed into one int32, plus the counts carried from the earlier chunks); the own tokens
  ``q0 < t <= min(q1, T - 1)`` (``n_own`` of them) to ``num_full + t - q0 - 1``.
* Then the padding slots ``[num_used, capacity)`` (index 0, key_pos ``Tp``, key_end 0) and the two counts.

Every slot store is masked with ``slot < capacity``: cutoffs from a larger ``topk`` than the capacity was sized
for truncate the block exactly as the torch path does (the first ``capacity`` slots of the same order), and
``num_used`` is not clamped there either. Work is ``O(batch * kv_heads * num_blocks * T)`` int32 loads and
compares (mostly L2 hits: the programs of one head share its ``end`` row), no intermediate tensors.

Runs on CUDA, or on the CPU in Triton's interpreter (``TRITON_INTERPRET=1``, set before triton is imported).
"""

from __future__ import annotations

import torch

from kvlearn.errors import check
from kvlearn.ops.gathered_layout import GatheredLayout, capacity_for, check_end_inputs
from kvlearn.ops.triton_support import HAS_TRITON as _HAS_TRITON
from kvlearn.ops.triton_support import interpreting as _interpreting
from kvlearn.ops.triton_support import is_pow2 as _is_pow2
from kvlearn.ops.triton_support import tl, triton

# Keys per chunk of the scan and warps per program (None arguments take these). Not swept: on the H200 the kernel
# takes 0.06 ms at T = 16384, 8 KV heads, block 128 (results/raw/gpu_tests_rest_2dba706.log), against 1.0 ms for the
# torch build; the GPU tests also run 256 x 4 warps and 2048 x 8 warps.
DEFAULT_CHUNK = 1024
DEFAULT_NUM_WARPS = 8


if _HAS_TRITON:

    @triton.jit
    def _end_chunk(end_row, offs, live, T, Tp):
        """``end[offs]`` (masked lanes 0), never-evicted keys (``end >= T``) read as the padded length ``Tp``."""
        e = tl.load(end_row + offs, mask=live, other=0)
        return tl.where(e >= T, Tp, e)

    @triton.jit
    def _count_always(end_row, start, q0, q1, T, Tp, CH: tl.constexpr):
        """Always-visible keys (``t <= q0``, ``end > q1``) among ``t = start .. start + CH - 1``."""
        offs = start + tl.arange(0, CH)
        old = offs <= q0
        e = _end_chunk(end_row, offs, old, T, Tp)
        return tl.sum((old & (e > q1)).to(tl.int32), axis=0)

    @triton.jit
    def _write_chunk(
        end_row, index_row, key_pos_row, key_end_row, start, q0, q1, last, T, Tp, capacity, off_own, off_ev, n_a, n_e,
        CH: tl.constexpr,
    ):
        """Slots of the keys ``t = start .. start + CH - 1`` (``t <= last``); returns the running counts of the
        always-visible and evicted-in-block keys after this chunk."""
        offs = start + tl.arange(0, CH)
        live = offs <= last
        e = _end_chunk(end_row, offs, live, T, Tp)
        old = offs <= q0  # implies live (q0 <= last)
        always = old & (e > q1)
        evicted = old & (e > q0) & (e <= q1)
        own = live & (offs > q0)
        # both running counts from one scan: always in the low 16 bits, evicted in the high (CH < 2^15)
        packed = always.to(tl.int32) + (evicted.to(tl.int32) << 16)
        incl = tl.cumsum(packed, axis=0)
        slot = tl.where(
            always,
            n_a + (incl & 0xFFFF) - 1,
            tl.where(evicted, off_ev + n_e + (incl >> 16) - 1, off_own + (offs - q0 - 1)),
        )
        keep = (always | evicted | own) & (slot < capacity)
        tl.store(index_row + slot, offs, mask=keep)
        tl.store(key_pos_row + slot, offs, mask=keep)
        tl.store(key_end_row + slot, e, mask=keep)
        total = tl.sum(packed, axis=0)
        return n_a + (total & 0xFFFF), n_e + (total >> 16)

    @triton.jit
    def _write_padding(index_row, key_pos_row, key_end_row, start, used, capacity, Tp, CH: tl.constexpr):
        offs = start + tl.arange(0, CH)
        pad = (offs >= used) & (offs < capacity)
        zero = tl.zeros([CH], dtype=tl.int32)
        tl.store(index_row + offs, zero, mask=pad)
        tl.store(key_pos_row + offs, zero + Tp, mask=pad)
        tl.store(key_end_row + offs, zero, mask=pad)

    @triton.jit
    def _gathered_layout_kernel(
        end_ptr,  # int32 [B * H, T]: eviction_positions (any value >= T: never evicted)
        index_ptr,  # int32 [B * H, nQ, C]
        key_pos_ptr,
        key_end_ptr,
        num_full_ptr,  # int32 [B * H, nQ]
        num_used_ptr,
        T,
        n_blocks,
        n_rows,  # B * H
        capacity,  # C (0: counts only)
        BS,  # query block size
        CH: tl.constexpr,  # keys per chunk (power of two < 2^15)
        INTERPRET: tl.constexpr,  # `while` loops (the CPU interpreter cannot take runtime `range` bounds)
    ):
        pid = tl.program_id(0)
        blk = n_blocks - 1 - pid // n_rows  # latest query blocks first: they scan the most keys
        bh = (pid % n_rows).to(tl.int64)
        Tp = n_blocks * BS
        q0 = blk * BS
        q1 = q0 + BS - 1
        n_own = tl.minimum(BS - 1, T - 1 - q0)  # the block's own tokens after q0
        last = q0 + n_own  # min(q1, T - 1)
        end_row = end_ptr + bh * T
        out = (bh * n_blocks + blk) * capacity
        index_row = index_ptr + out
        key_pos_row = key_pos_ptr + out
        key_end_row = key_end_ptr + out
        zero = q0 * 0  # int32 scalar tensor (loop-carried values keep one type)

        n_always = zero
        if INTERPRET:
            start = zero
            while start <= q0:
                n_always += _count_always(end_row, start, q0, q1, T, Tp, CH)
                start += CH
        else:
            for start in range(0, q0 + 1, CH):
                n_always += _count_always(end_row, start, q0, q1, T, Tp, CH)

        off_ev = n_always + n_own  # first slot of the keys evicted inside the block
        n_a = zero
        n_e = zero
        if INTERPRET:
            start = zero
            while start <= last:
                n_a, n_e = _write_chunk(end_row, index_row, key_pos_row, key_end_row, start, q0, q1, last, T, Tp,
                                        capacity, n_always, off_ev, n_a, n_e, CH)
                start += CH
        else:
            for start in range(0, last + 1, CH):
                n_a, n_e = _write_chunk(end_row, index_row, key_pos_row, key_end_row, start, q0, q1, last, T, Tp,
                                        capacity, n_always, off_ev, n_a, n_e, CH)

        used = off_ev + n_e
        first_pad = (tl.minimum(used, capacity) // CH) * CH
        if INTERPRET:
            start = first_pad
            while start < capacity:
                _write_padding(index_row, key_pos_row, key_end_row, start, used, capacity, Tp, CH)
                start += CH
        else:
            for start in range(first_pad, capacity, CH):
                _write_padding(index_row, key_pos_row, key_end_row, start, used, capacity, Tp, CH)

        cnt = bh * n_blocks + blk
        tl.store(num_full_ptr + cnt, n_always)
        tl.store(num_used_ptr + cnt, used)


def _check_inputs(end, block_size, capacity, chunk, num_warps) -> None:
    check_end_inputs(end, block_size, capacity)
    check(_is_pow2(chunk) and 16 <= chunk <= 8192, f"chunk={chunk!r} is invalid: expected a power of two in [16, 8192]")
    check(_is_pow2(num_warps) and num_warps <= 32, f"num_warps={num_warps!r} is invalid: expected a power of two <= 32")
    check(_HAS_TRITON, "gathered_layout_triton is unavailable: triton is not installed (use gathered_layout's "
                       "backend='torch')")
    check(end.is_cuda or _interpreting(),
          f"device {end.device} is invalid: expected a CUDA tensor (or TRITON_INTERPRET=1 to run on the CPU)")
    B, H, T = end.shape
    n_blocks = -(-T // block_size)
    check(n_blocks * block_size < 2**31,
          f"seq length {T} with block_size={block_size} is invalid: expected a padded length below 2^31")
    check(B * H * n_blocks < 2**31, f"batch * kv_heads * num_blocks = {B * H * n_blocks} is invalid: expected "
                                    f"below 2^31 (one program each)")


def _launch(end: torch.Tensor, block_size: int, capacity: int, chunk: int, num_warps: int):
    """The kernel on contiguous ``end [B, H, T]``; ``capacity`` 0 fills only the counts."""
    B, H, T = end.shape
    nQ = -(-T // block_size)
    dev = end.device
    index = torch.empty((B, H, nQ, capacity), dtype=torch.int32, device=dev)
    key_pos = torch.empty_like(index)
    key_end = torch.empty_like(index)
    num_full = torch.empty((B, H, nQ), dtype=torch.int32, device=dev)
    num_used = torch.empty_like(num_full)
    if B * H > 0:
        _gathered_layout_kernel[(nQ * B * H,)](
            end, index, key_pos, key_end, num_full, num_used,
            T, nQ, B * H, capacity, block_size,
            CH=chunk, INTERPRET=_interpreting(), num_warps=num_warps,
        )
    return index, key_pos, key_end, num_full, num_used


def gathered_layout_triton(
    end: torch.Tensor,
    block_size: int,
    capacity: int | None,
    *,
    chunk: int | None = None,
    num_warps: int | None = None,
) -> GatheredLayout:
    """The interval-gathered layout from the eviction positions, in one Triton launch (see the module docstring).

    Args:
        end: int32 ``[batch, kv_heads, T]``, :func:`kvlearn.ops.masks.eviction_positions` (``end[t]`` in
            ``[t + 1, T]``; values are not checked). Values ``>= T`` mean "never evicted", so ``end`` with the
            never-evicted keys already set to the padded length gives the same layout.
        block_size: query block size (>= 1).
        capacity: slots per query block, a positive multiple of ``block_size``
            (:func:`kvlearn.ops.gathered_layout.gathered_capacity`; blocks with more used slots are truncated to
            their first ``capacity`` slots, as the torch build does). None: the largest block's used count rounded
            up to ``block_size`` (a counts-only launch and one host sync first).
        chunk: keys per scan step (power of two in [16, 8192]); num_warps: the launch's (power of two <= 32).
            None: :data:`DEFAULT_CHUNK`, :data:`DEFAULT_NUM_WARPS`.

    Returns:
        :class:`kvlearn.ops.gathered_layout.GatheredLayout`: ``index``, ``key_pos``, ``key_end`` int32
        ``[batch, kv_heads, num_blocks, capacity]``, ``num_full``, ``num_used`` int32
        ``[batch, kv_heads, num_blocks]`` (``num_used`` not clamped to ``capacity``), ``num_blocks = ceil(T /
        block_size)``; bit-identical to :func:`kvlearn.ops.gathered_layout.gathered_layout_torch` on the same
        inputs.
    """
    chunk = DEFAULT_CHUNK if chunk is None else chunk
    num_warps = DEFAULT_NUM_WARPS if num_warps is None else num_warps
    _check_inputs(end, block_size, capacity, chunk, num_warps)
    B, H, T = end.shape
    end = end.contiguous()
    if capacity is None:
        used = _launch(end, block_size, 0, chunk, num_warps)[4]
        used_max = int(used.max()) if used.numel() else 0
        capacity = capacity_for(used_max, block_size)
    index, key_pos, key_end, num_full, num_used = _launch(end, block_size, capacity, chunk, num_warps)
    return GatheredLayout(index, key_pos, key_end, num_full, num_used, block_size, T, capacity)


__all__ = ["DEFAULT_CHUNK", "DEFAULT_NUM_WARPS", "gathered_layout_triton"]
