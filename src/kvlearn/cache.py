"""The compact cache contract shared by every eviction method (streaming, KVpop, the baselines).

A compact layer holds fixed, preallocated per-head buffers ``keys, values: [batch, kv_heads, capacity, head_dim]``
written in place, and for every slot the position of the token it holds, ``slot_positions: [batch, P, capacity]``
(int32, ``-1`` = empty; ``P`` is ``kv_heads`` for per-head policies or 1 when all heads keep the same tokens).
Allocated bytes therefore fall with the budget: masking tokens while keeping them is never reported as compression.

Positions are counted over the real (non-padding) tokens of each batch row, so a left-padded batch behaves exactly
like each row run alone; ``get_seq_length()`` returns the tokens seen (padding columns included, as transformers
expects when it slices ``input_ids`` and builds position ids).

One forward of the model with ``q`` new tokens:

1. :meth:`CompactCache.begin_forward` (called by the pre-forward hook of :func:`kvlearn.hf.attach`) receives the 2-D
   padding mask and fixes the positions of the new tokens, ``[batch, q]`` (``-1`` for padding).
2. Each attention layer calls ``update(k, v)``. For a single new token (decoding) the token is written into its slot
   first and the whole buffer is returned (``capacity`` keys); for ``q > 1`` (prefill, chunked prefill) the old
   buffer followed by the ``q`` new tokens is returned (``capacity + q`` keys) and the survivors are written after.
   This is exactly what :meth:`CompactLayer.get_mask_sizes` promises.
3. The attention function (:func:`kvlearn.hf.kvlearn_attention`) asks the layer for the visibility mask of the keys
   it returned: key ``j`` is visible to a query at position ``p`` iff ``start_j <= p < end_j`` where ``start_j`` is
   the key's position and ``end_j`` the first query position at which the method has evicted it. Every eviction
   method is a rule for ``end`` and for which slot a surviving token takes; this interval form covers prefill,
   chunked prefill and decoding with one code path, and it is what a dense-mask forward of the same policy computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .errors import KVLearnError, check

NEVER = torch.iinfo(torch.int32).max  # `end` of a token that is never evicted


@dataclass
class ForwardStep:
    """The new tokens of one forward, shared by all layers.

    Attributes:
        positions: ``[batch, q]`` int64 position of each new token among its row's real tokens, ``-1`` for padding.
        real_after: ``[batch]`` int64 number of real tokens of each row after this forward.
        has_padding: whether any new token is padding (read once per forward, so that the layers' hot paths need
            no device sync to know it).
    """

    positions: torch.Tensor
    real_after: torch.Tensor
    has_padding: bool

    @property
    def query_length(self) -> int:
        return self.positions.shape[1]


@dataclass
class SlotPlan:
    """Where a method puts the new tokens and when it evicts every returned key.

    Attributes:
        write_slots: ``[batch, P, q]`` int64 slot for each new token that survives this forward, ``-1`` otherwise.
        old_end: ``[batch, P, capacity]`` int64 first query position at which each buffered token is evicted
            (``NEVER`` if it survives this forward), or ``None`` when this forward evicts no buffered token except
            by overwriting its slot (nothing to free; with ``q > 1`` every buffered token stays visible to the
            forward's queries). Slots whose token is evicted by the end of the forward and not overwritten are
            freed (position ``-1``).
        new_end: ``[batch, P, q]`` int64 the same for the new tokens.
    """

    write_slots: torch.Tensor
    old_end: torch.Tensor | None
    new_end: torch.Tensor


class CompactLayer(CacheLayerMixin):
    """One layer of a compact cache: a fixed buffer of ``capacity`` slots per (batch row, KV head).

    Subclasses implement :meth:`plan`, the eviction rule. ``per_head`` says whether the rule may keep different tokens
    in different KV heads (then positions are stored per head).
    """

    is_compileable = False
    is_sliding = False
    per_head = False

    def __init__(self, capacity: int):
        super().__init__()
        check(capacity >= 1, f"capacity={capacity} is invalid: expected >= 1")
        self.capacity = capacity
        self.seen = 0
        self.slot_positions: torch.Tensor | None = None
        self._visible: tuple[torch.Tensor, torch.Tensor | None, int] | None = None

    # ----- the eviction rule -----
    def plan(self, step: ForwardStep, key_states: torch.Tensor, value_states: torch.Tensor) -> SlotPlan:
        """The eviction rule for the new tokens (``key_states, value_states: [batch, kv_heads, q, head_dim]``, which
        a learned policy scores)."""  # pragma: no cover - abstract
        raise NotImplementedError

    def _write_extra(self, bi: torch.Tensor, hi: torch.Tensor | None, si: torch.Tensor, ti: torch.Tensor) -> None:
        """Per-slot state a subclass keeps beside K/V (e.g. priorities): new token ``ti`` of row ``bi`` (head
        ``hi``, ``None`` = all heads) went to slot ``si``."""

    # ----- transformers' CacheLayerMixin contract -----
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, dk = key_states.shape
        dv = value_states.shape[-1]
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = torch.zeros(b, h, self.capacity, dk, dtype=key_states.dtype, device=key_states.device)
        self.values = torch.zeros(b, h, self.capacity, dv, dtype=value_states.dtype, device=value_states.device)
        heads = h if self.per_head else 1
        self.slot_positions = torch.full((b, heads, self.capacity), -1, dtype=torch.int32, device=key_states.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, step: ForwardStep | None = None, **kwargs):
        """Store the new tokens ``[batch, kv_heads, q, head_dim]``; return the keys/values the queries attend to."""
        if step is None:
            raise KVLearnError(
                "a kvlearn compact cache was updated without its forward step: call kvlearn.attach(model) "
                "(or apply the method) before passing the cache to the model"
            )
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        b, h, q, _ = key_states.shape
        check(
            b == self.keys.shape[0] and h == self.keys.shape[1],
            f"cache batch/heads {tuple(self.keys.shape[:2])} do not match the new keys {(b, h)}: one cache per batch",
        )
        check(q == step.query_length, f"{q} new keys but the forward step announced {step.query_length} tokens")
        plan = self.plan(step, key_states, value_states)
        new_pos = step.positions.to(torch.int32)[:, None, :].expand(b, plan.new_end.shape[1], q)
        last = step.positions.max(dim=1).values[:, None, None]  # [batch, 1, 1] last real position of this forward
        if q == 1:
            self._free(plan.old_end, last)
            self._write(key_states, value_states, plan.write_slots, new_pos)
            keys, values = self.keys, self.values
            start = self.slot_positions
            end = None  # every buffered token is retained at this query
            query_key_offset = -1
        else:
            keys = torch.cat([self.keys, key_states], dim=2)
            values = torch.cat([self.values, value_states], dim=2)
            start = torch.cat([self.slot_positions, new_pos], dim=2)
            old_end = plan.old_end if plan.old_end is not None else torch.full_like(self.slot_positions, NEVER, dtype=torch.long)
            end = torch.cat([old_end, plan.new_end], dim=2)
            self._free(plan.old_end, last)
            self._write(key_states, value_states, plan.write_slots, new_pos)
            query_key_offset = self.capacity
        self._visible = (start, end, query_key_offset)
        self.seen += q
        return keys, values

    def _free(self, old_end: torch.Tensor | None, last: torch.Tensor) -> None:
        """Mark slots whose token is evicted by position ``last`` (``[batch, 1, 1]``) as empty."""
        if old_end is not None:
            self.slot_positions.masked_fill_(old_end <= last, -1)

    def _write(self, k: torch.Tensor, v: torch.Tensor, write_slots: torch.Tensor, new_pos: torch.Tensor) -> None:
        """Scatter surviving new tokens into their slots (in place)."""
        b, h, q, _ = k.shape
        if write_slots.shape[1] == 1 and h > 1:  # same slots for every head
            bi, ti = torch.nonzero(write_slots[:, 0] >= 0, as_tuple=True)
            si = write_slots[bi, 0, ti]
            self.keys[bi, :, si] = k[bi, :, ti]
            self.values[bi, :, si] = v[bi, :, ti]
            self.slot_positions[bi, 0, si] = new_pos[bi, 0, ti]
            self._write_extra(bi, None, si, ti)
        else:
            bi, hi, ti = torch.nonzero(write_slots >= 0, as_tuple=True)
            si = write_slots[bi, hi, ti]
            self.keys[bi, hi, si] = k[bi, hi, ti]
            self.values[bi, hi, si] = v[bi, hi, ti]
            self.slot_positions[bi, hi, si] = new_pos[bi, hi, ti]
            self._write_extra(bi, hi, si, ti)

    def visibility_mask(self, query_positions: torch.Tensor, has_padding: bool | None = None) -> torch.Tensor:
        """Boolean mask ``[batch, P, q, kv]`` of the keys returned by the last :meth:`update`.

        ``query_positions``: ``[batch, q]`` positions of the queries (``-1`` for padding). A padding query attends to
        its own key only, so its (unused) output stays finite. ``has_padding``: whether any query is padding
        (:attr:`ForwardStep.has_padding`); None reads it from ``query_positions`` (one device sync).
        """
        check(self._visible is not None, "visibility_mask() called before update()")
        start, end, offset = self._visible
        qp = query_positions.to(torch.int64)[:, None, :, None]
        s = start.to(torch.int64)[:, :, None, :]
        mask = (s >= 0) & (s <= qp)
        if end is not None:
            mask = mask & (qp < end.to(torch.int64)[:, :, None, :])
        pad = query_positions < 0
        if has_padding if has_padding is not None else bool(pad.any()):
            if offset >= 0:  # prefill: a padding query sees its own (returned) key
                q = query_positions.shape[1]
                own = torch.zeros(mask.shape[-2:], dtype=torch.bool, device=mask.device)
                own[torch.arange(q), offset + torch.arange(q)] = True
            else:  # decode: a padding query sees the whole buffer
                own = torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device)
            mask = mask | (pad[:, None, :, None] & own)
        return mask

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kv_length = self.capacity if query_length == 1 else self.capacity + query_length
        return kv_length, max(0, self.seen + query_length - kv_length)

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def allocated_bytes(self) -> int:
        """Bytes held by this layer's buffers (keys, values and slot positions)."""
        if not self.is_initialized:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values, self.slot_positions))

    def reset(self) -> None:
        super().reset()
        if self.is_initialized:
            self.slot_positions.fill_(-1)
        self.seen = 0
        self._visible = None

    def _unsupported(self, *args, **kwargs):
        raise KVLearnError(
            f"{type(self).__name__} does not support beam search, cropping or batch reordering: use greedy or "
            "sampling decoding with num_beams=1"
        )

    reorder_cache = crop = batch_repeat_interleave = batch_select_indices = _unsupported


class CompactCache(Cache):
    """A transformers ``Cache`` made of :class:`CompactLayer` s, one per decoder layer.

    Use it as ``model.generate(..., past_key_values=cache)`` after :func:`kvlearn.hf.attach` (or a method's
    ``apply_*``), which routes the padding mask to :meth:`begin_forward` and the cache to the attention function.
    """

    def __init__(self, layers: list[CompactLayer]):
        check(len(layers) > 0, "a compact cache needs at least one layer")
        super().__init__(layers=layers)
        self._real_seen: torch.Tensor | None = None
        self._step: ForwardStep | None = None

    def begin_forward(self, attention_mask: torch.Tensor | None, batch_size: int, query_length: int, device) -> ForwardStep:
        """Fix the positions of the ``query_length`` new tokens from the 2-D padding mask ``[batch, seen + q]``."""
        seen = self.get_seq_length()
        if attention_mask is None:
            valid = torch.ones(batch_size, query_length, dtype=torch.bool, device=device)
        else:
            check(
                attention_mask.dim() == 2,
                f"attention_mask of shape {tuple(attention_mask.shape)} is not supported with a kvlearn cache: "
                "pass the 2-D padding mask [batch, tokens]",
            )
            check(
                attention_mask.shape[1] in (query_length, seen + query_length),
                f"attention_mask has {attention_mask.shape[1]} columns: expected {seen + query_length} "
                f"(tokens seen {seen} + new {query_length})",
            )
            valid = attention_mask[:, -query_length:].to(device=device, dtype=torch.bool)
        if self._real_seen is None:
            self._real_seen = torch.zeros(batch_size, dtype=torch.int64, device=device)
        check(
            self._real_seen.shape[0] == batch_size,
            f"batch size {batch_size} differs from the cache's {self._real_seen.shape[0]}: one cache per batch",
        )
        csum = valid.to(torch.int64).cumsum(dim=1)
        positions = torch.where(valid, self._real_seen[:, None] + csum - 1, torch.full_like(csum, -1))
        self._real_seen = self._real_seen + csum[:, -1]
        has_padding = attention_mask is not None and not bool(valid.all())  # the one sync of the forward
        self._step = ForwardStep(positions=positions, real_after=self._real_seen.clone(), has_padding=has_padding)
        return self._step

    @property
    def step(self) -> ForwardStep | None:
        return self._step

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states, step=self._step)

    def allocated_bytes(self) -> int:
        """Bytes held by every layer's buffers."""
        return sum(layer.allocated_bytes() for layer in self.layers)

    def reset(self) -> None:
        super().reset()
        self._real_seen = None
        self._step = None
