"""The layer that joins a store and a policy (transformers' ``CacheLayerMixin``), and the ``Cache`` of such layers.

Positions are counted over the real (non-padding) tokens of each batch row, so a padded batch (left padding, or
padding between a context part and a question part) behaves exactly like each row run alone;
``get_seq_length()`` returns the tokens seen (padding columns included, as transformers expects when it slices
``input_ids`` and builds position ids).

One forward of the model with ``q`` new tokens:

1. :meth:`CompactCache.begin_forward` (the pre-forward hook of :func:`kvlearn.hf.attach`) receives the 2-D padding
   mask and fixes the positions of the new tokens, ``[batch, q]`` (``-1`` for padding).
2. Each attention layer calls ``update(k, v)``; the layer asks its policy for a :class:`SlotPlan`. For one new token
   (decoding) the token is written into its slot first and the whole store is returned (``capacity`` keys; or no
   keys at all when the store attends the step itself, :meth:`Store.attends_decode`: the packed store on the GPU,
   whose kernel reads the codes, for policies that need no attention back); for
   ``q > 1`` the old store followed by the ``q`` new tokens is returned (``capacity + q`` keys; ``seen + q`` under
   an append-only policy, whose slots past ``seen`` are empty: :meth:`Store.read_prefix`) and the survivors are
   written after (or, for a policy that decides after attending, in :meth:`CompactLayer.observe_attention`).
   :meth:`CompactLayer.get_mask_sizes` promises the upper bound; the masks are the layer's own
   (:meth:`CompactLayer.visibility_mask`), sized to the keys returned.
3. The attention function asks the layer for the visibility mask of the returned keys: key ``j`` is visible to a
   query at position ``p`` iff ``start_j <= p < end_j``, ``start_j`` the key's position and ``end_j`` the first query
   position at which the policy has evicted it (``dense`` forwards: every earlier key is visible). A policy that
   requests attention gets it back through :meth:`CompactLayer.observe_attention` and evicts then.

Allocated bytes: the store (``capacity`` slots), the slot positions (int32) and the declared slot state.
``capacity`` is the policy's budget, or budget + 1 for policies that evict after attending (TOVA, H2O, SnapKV,
PyramidKV): a decode step holds ``budget + 1`` keys while it attends, then evicts one.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import KVLearnError, check
from .policy import NEVER, ChunkRetention, ForwardStep, Policy
from .store import PlainStore, Store, scatter_slots


class CompactLayer(CacheLayerMixin):
    """One layer of a compact cache: a :class:`Store` of ``policy.capacity`` slots per (batch row, KV head) and the
    :class:`Policy` that fills it. ``attend_stored_form``: a multi-token forward attends its own new tokens as the
    store will read them back (:meth:`Store.round_trip`, e.g. quantized) instead of in full precision.

    State (per sequence, reset by :meth:`reset`): ``slot_positions [batch, P, capacity]`` int32 (``-1`` = empty),
    ``slot_state[name] [batch, P, capacity]`` for each name the policy declares, ``seen`` (tokens seen).
    """

    is_sliding = False
    supports_early_init = False

    def __init__(self, policy: Policy, store: Store | None = None, attend_stored_form: bool = False):
        super().__init__()
        check(isinstance(policy, Policy), f"policy {type(policy).__name__} is not a kvlearn.cache.Policy")
        self.policy = policy
        self.store = store if store is not None else PlainStore()
        check(not self.store.requires_append_only or policy.append_only,
              f"{type(self.store).__name__} needs a policy that never evicts (slots written in position order, never "
              f"overwritten: KeepAllPolicy); {type(policy).__name__} evicts")
        self.attend_stored_form = attend_stored_form
        self.capacity = policy.capacity
        self.seen = 0
        self.slot_positions: torch.Tensor | None = None
        self.slot_state: dict[str, torch.Tensor] = {}
        self._visible: tuple[torch.Tensor, torch.Tensor | None, int] | None = None
        self._pending: tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]] | None = None
        self.store_attends = False  # the last update was a decode step the store attends itself (no read-back)
        # the last multi-token update's visibility as a running top-k over one sequence (static-score policies,
        # bounded protocol), for the attention function's sparse chunk path; None otherwise
        self.chunk_retention: ChunkRetention | None = None
        self.trace: list | None = None  # set to a list to record (query_positions, key_positions, mask) per forward

    @property
    def per_head(self) -> bool:
        return self.policy.per_head

    # ----- transformers' CacheLayerMixin contract -----
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, h, _, dk = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.store.allocate(b, h, self.capacity, dk, value_states.shape[-1], key_states.dtype, key_states.device)
        if self.store.read_is_view:  # transformers' layer.keys/values: the live buffers, never a dequantized copy
            self.keys, self.values = self.store.read()
        p = h if self.per_head else 1
        self.slot_positions = torch.full((b, p, self.capacity), -1, dtype=torch.int32, device=key_states.device)
        for name, (dtype, fill) in self.policy.slot_state.items():
            self.slot_state[name] = torch.full((b, p, self.capacity), fill, dtype=dtype, device=key_states.device)
        self.is_initialized = True

    def _check_shapes(self, key_states: torch.Tensor, value_states: torch.Tensor, step: ForwardStep) -> None:
        b, h, c, dk, dv = self.store.shape
        got = (key_states.shape[0], key_states.shape[1], key_states.shape[3], value_states.shape[3])
        check(
            got == (b, h, dk, dv),
            f"new keys/values (batch, kv_heads, k_dim, v_dim) = {got} do not match this cache's {(b, h, dk, dv)}: "
            "a cache serves one batch of one model; make a new cache (or call cache.reset())",
        )
        check(key_states.shape[2] == step.query_length,
              f"{key_states.shape[2]} new keys but the forward step announced {step.query_length} tokens")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, step: ForwardStep | None = None, **kwargs):
        """Store the new tokens ``[batch, kv_heads, q, head_dim]``; return the keys/values the queries attend to
        (``[batch, kv_heads, capacity (+ q if q > 1), head_dim]``)."""
        if step is None:
            raise KVLearnError(
                "a kvlearn compact cache was updated without its forward step: call kvlearn.attach(model) "
                "(or apply the method) before passing the cache to the model"
            )
        check(self._pending is None,
              f"{type(self.policy).__name__} evicts after attending, but the last forward's attention was never "
              "handed back: run the model with the 'kvlearn' attention (kvlearn.attach(model))")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_shapes(key_states, value_states, step)
        b, h, q, _ = key_states.shape
        plan = self.policy.plan(self, step, key_states, value_states)
        self.chunk_retention = None
        p = self.slot_positions.shape[1]
        new_pos = step.positions[:, None, :].expand(b, p, q)
        if q == 1:
            if plan.old_end is not None:
                self._free(plan.old_end, step.positions.max(dim=1).values[:, None, None])
            self._write(plan.write_slots, key_states, value_states, new_pos, plan.new_state)
            self._visible = (self.slot_positions, None, -1)
            self.store_attends = self.store.attends_decode() and not self.policy.observes
            if self.store_attends:  # the attention reads the store itself: hand back no keys (kvlearn_attention)
                keys = key_states.new_empty(b, h, 0, key_states.shape[-1])
                values = value_states.new_empty(b, h, 0, value_states.shape[-1])
            else:
                keys, values = self.store.read()
        elif self.writes_in_place:  # keep-all: write first, attend the filled prefix (a view, or its stored form)
            self.store_attends = False
            self._write(plan.write_slots, key_states, value_states, new_pos, plan.new_state)
            filled = self.seen + q  # slot = position, and every position is below the tokens seen (padding included)
            keys, values = self.store.read_prefix(filled)
            self._visible = (self.slot_positions[..., :filled], None, -1)
        else:
            self.store_attends = False
            # an append-only policy fills slots 0..seen-1 only: attend those (KIVI's prefill), not the whole capacity
            stored = min(self.seen, self.capacity) if self.policy.append_only and not plan.defer else self.capacity
            stored_k, stored_v = self.store.read_prefix(stored) if stored < self.capacity else self.store.read()
            new_k, new_v = (self.store.round_trip(key_states, value_states) if self.attend_stored_form
                            else (key_states, value_states))
            keys = torch.cat([stored_k, new_k], dim=2)
            values = torch.cat([stored_v, new_v], dim=2)
            start = torch.cat([self.slot_positions[..., :stored].to(torch.int64), new_pos], dim=2)
            end = None
            if not (step.dense or plan.defer):
                old_end = (plan.old_end[..., :stored] if plan.old_end is not None
                           else torch.full_like(start[..., :stored], NEVER))
                end = torch.cat([old_end, plan.new_end], dim=2)
                if plan.retention is not None and stored == self.capacity:
                    self.chunk_retention = plan.retention
            self._visible = (start, end, stored)
            if plan.defer:
                state = {n: torch.cat([self.slot_state[n], plan.new_state[n].to(self.slot_state[n].dtype)], dim=2)
                         for n in self.slot_state}
                self._pending = (keys, values, start, state)
            else:
                if plan.old_end is not None:
                    self._free(plan.old_end, step.positions.max(dim=1).values[:, None, None])
                self._write(plan.write_slots, key_states, value_states, new_pos, plan.new_state)
        self.seen += q
        return keys, values

    def _free(self, old_end: torch.Tensor, last: torch.Tensor) -> None:
        """Mark slots whose token is evicted by position ``last`` (``[batch, 1, 1]``) as empty."""
        self.slot_positions.masked_fill_(old_end <= last, -1)

    def _expand_heads(self, slots: torch.Tensor) -> torch.Tensor:
        b, h = self.store.shape[:2]
        return slots.expand(b, h, slots.shape[2]) if slots.shape[1] == 1 else slots

    def _write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, new_pos: torch.Tensor,
               new_state: dict[str, torch.Tensor]) -> None:
        """Write the surviving new tokens (``slots [batch, P, q]``, -1 = not kept) into the store, their positions
        and their declared slot state (fixed-shape scatter when ``q == 1``)."""
        self.store.write(self._expand_heads(slots), k, v)
        scatter_slots(self.slot_positions, slots, new_pos)
        for name, buf in self.slot_state.items():
            scatter_slots(buf, slots, new_state[name])

    @property
    def candidates(self) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """After a deferred multi-token update: ``(positions [batch, P, capacity + q], slot state {name: [batch, P,
        capacity + q]})`` of the returned keys (store then chunk), for the policy's ``observe``."""
        check(self._pending is not None, "candidates are only defined after a deferred multi-token update")
        return self._pending[2], self._pending[3]

    def observe_attention(self, step: ForwardStep, attention: torch.Tensor | None) -> None:
        """Hand the attention the policy requested (``[batch, kv_heads, kv]`` float32 over the returned keys, or
        None) back after attending; the policy evicts now."""
        self.policy.observe(self, step, attention)
        self._pending = None

    def replace_all(self, index: torch.Tensor, valid: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        """After a multi-token forward of a deferring policy: keep the candidates ``index [batch, P, n]`` (into the
        returned keys, ``n <= capacity``; ``valid [batch, P, n]`` False = leave the slot empty) in slots ``0..n-1``;
        ``state[name] [batch, P, n]`` their slot state. Every other slot becomes empty."""
        check(self._pending is not None, "replace_all() is only valid after a deferred multi-token update")
        keys, values, start, _ = self._pending
        b, h = self.store.shape[:2]
        n = index.shape[2]
        idx = self._expand_heads(index)
        k = torch.gather(keys, 2, idx[..., None].expand(b, h, n, keys.shape[-1]))
        v = torch.gather(values, 2, idx[..., None].expand(b, h, n, values.shape[-1]))
        slots = torch.arange(n, device=index.device).expand_as(index)
        slots = torch.where(valid, slots, torch.full_like(slots, -1))
        self.slot_positions.fill_(-1)
        self._write(slots, k, v, torch.gather(start, 2, index), state)

    def visibility_mask(self, query_positions: torch.Tensor, has_padding: bool | None = None) -> torch.Tensor:
        """Boolean mask ``[batch, P, q, kv]`` of the keys returned by the last :meth:`update`.

        ``query_positions``: ``[batch, q]`` positions of the queries (``-1`` for padding). A padding query attends to
        its own key only (decoding: to the whole buffer), so its unused output stays finite. ``has_padding``: False
        skips that fix; None applies it with tensor ops (no device sync: the decode path).
        """
        check(self._visible is not None, "visibility_mask() called before update()")
        start, end, offset = self._visible
        qp = query_positions.to(torch.int64)[:, None, :, None]
        s = start.to(torch.int64)[:, :, None, :]
        mask = (s >= 0) & (s <= qp)
        if end is not None:
            mask = mask & (qp < end.to(torch.int64)[:, :, None, :])
        if has_padding is None or has_padding:
            pad = query_positions < 0
            if offset >= 0:  # multi-token forward: a padding query sees its own (returned) key
                q = query_positions.shape[1]
                own = torch.zeros(mask.shape[-2:], dtype=torch.bool, device=mask.device)
                own[torch.arange(q), offset + torch.arange(q)] = True
            else:
                own = torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device)
            mask = mask | (pad[:, None, :, None] & own)
        if self.trace is not None:
            self.trace.append((query_positions.clone(), start.to(torch.int64).clone(), mask.clone()))
        return mask

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        kv_length = self.capacity if query_length == 1 else self.capacity + query_length
        return kv_length, max(0, self.seen + query_length - kv_length)

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def allocated_bytes(self) -> int:
        """Bytes held by this layer: the store, the slot positions, the declared slot state and the policy's
        per-sequence state. ``capacity`` = budget, or budget + 1 for policies that evict after attending."""
        if not self.is_initialized:
            return 0
        extra = [self.slot_positions, *self.slot_state.values()]
        return self.store.allocated_bytes() + sum(t.numel() * t.element_size() for t in extra) + self.policy.state_bytes()

    @property
    def writes_in_place(self) -> bool:
        """Whether a multi-token forward writes its tokens into the store first and attends the store's filled
        prefix as a view (no copy): a policy that never evicts and puts position ``p`` in slot ``p``
        (``append_only``, :class:`~kvlearn.cache.keepall.KeepAllPolicy`) over a store whose ``read`` is its live
        buffers. Otherwise the forward attends ``capacity`` stored slots and the ``q`` new tokens concatenated (a
        copy of the store), because the tokens a policy evicts in this forward stay visible to its earlier
        queries. At 131k tokens in 4096-token chunks the copy was 537 MB per layer and chunk at bf16 (8 KV heads
        of 128). Also over a store that is not a view when the layer attends the stored form and a write then a read
        gives exactly that form (``Store.write_read_exact``: the packed store): the prefix is then read back
        (dequantized) for ``seen + q`` slots instead of ``capacity``, the same values the concatenation attends. At
        131k that was a flat 28 s per 16k-token segment of int4 prefill against 3-15 s for bf16
        (``results/raw/kaizen_memory_h200_b_131k_f29a15a.json``)."""
        exact = self.attend_stored_form and self.store.write_read_exact
        return bool(self.policy.append_only and (self.store.read_is_view or exact))

    def chunk_bytes(self, chunk: int) -> int:
        """Transient bytes of a ``chunk``-token forward: the returned ``capacity + chunk`` keys/values (none when
        :attr:`writes_in_place`)."""
        if not self.is_initialized or (self.writes_in_place and self.store.read_is_view):
            return 0  # (a packed store's read-back prefix: at most the bound below)
        b, h = self.store.shape[:2]
        return b * h * (self.capacity + chunk) * self.store.bytes_per_token()

    def reset(self) -> None:
        if self.is_initialized:
            self.slot_positions.fill_(-1)
            for name, (dtype, fill) in self.policy.slot_state.items():
                self.slot_state[name].fill_(fill)
        self.policy.reset()
        self.seen = 0
        self._visible = None
        self._pending = None
        self.store_attends = False
        self.chunk_retention = None

    def _unsupported(self, *args, **kwargs):
        raise KVLearnError(
            f"{type(self).__name__} does not support beam search, cropping or batch reordering: use greedy or "
            "sampling decoding with num_beams=1"
        )

    reorder_cache = crop = batch_repeat_interleave = batch_select_indices = _unsupported


CHUNK_ATTENTION = ("auto", "sparse", "mask")


class CompactCache(Cache):
    """A transformers ``Cache`` made of :class:`CompactLayer` s, one per decoder layer.

    Use it as ``model.generate(..., past_key_values=cache)`` after :func:`kvlearn.hf.attach`, which routes the padding
    mask to :meth:`begin_forward` and the cache to the attention function. ``is_compileable`` stays False: the
    one-token update is compile-ready (fixed-shape scatter, no host sync), but ``get_seq_length`` is a Python int,
    so transformers' automatic compilation of the whole decode forward would recompile every step.
    """

    def __init__(self, layers: list[CompactLayer]):
        check(len(layers) > 0, "a compact cache needs at least one layer")
        super().__init__(layers=layers)
        self._real_seen: torch.Tensor | None = None
        self._step: ForwardStep | None = None
        self._dense = False
        self._chunk_attention = "auto"

    @property
    def chunk_attention(self) -> str:
        """How a multi-token forward attends where the layer's visibility is a running top-k (static-score
        policies under ``bounded``, no padding in the forward, as many held tokens in every row): ``"auto"``
        (default: sparse retention over one sequence on CUDA from :data:`kvlearn.hf.SPARSE_CHUNK_MIN_QUERIES`
        queries, the visibility mask otherwise), ``"sparse"`` (always there) or ``"mask"`` (never). Both give the
        same attention (:func:`kvlearn.hf.sparse_chunk_attention`); the sparse one never builds the ``[batch, P,
        q, capacity + q]`` mask, which a single-forward prefill of a long prompt (``generate``) would."""
        return self._chunk_attention

    @chunk_attention.setter
    def chunk_attention(self, mode: str) -> None:
        check(mode in CHUNK_ATTENTION, f"chunk_attention={mode!r} is invalid: expected one of {CHUNK_ATTENTION}")
        self._chunk_attention = mode

    @contextmanager
    def dense(self):
        """Run the forwards inside the block under the ``context`` protocol (see :class:`ForwardStep`)."""
        previous, self._dense = self._dense, True
        try:
            yield self
        finally:
            self._dense = previous

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
        has_padding = None
        if query_length > 1:  # prefill: one sync per forward; decoding never reads it
            has_padding = attention_mask is not None and not bool(valid.all())
        self._step = ForwardStep(positions=positions, real_after=self._real_seen.clone(), has_padding=has_padding,
                                 dense=self._dense)
        return self._step

    @property
    def step(self) -> ForwardStep | None:
        return self._step

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        check(0 <= layer_idx < len(self.layers),
              f"layer_idx={layer_idx} is invalid: this cache has {len(self.layers)} layers (one cache per model)")
        return self.layers[layer_idx].update(key_states, value_states, step=self._step)

    def check_model(self, num_layers: int, model=None) -> None:
        """Raise a one-line error unless the cache has one layer per decoder layer of the model (``model``, the
        top-level model of the forward, is for subclasses whose cache uses the model's own modules)."""
        check(num_layers == len(self.layers),
              f"the model has {num_layers} decoder layers but this cache has {len(self.layers)}: make the cache "
              "from the model's config")

    def allocated_bytes(self) -> int:
        """Bytes held by every layer's buffers."""
        return sum(layer.allocated_bytes() for layer in self.layers)

    def store_bytes(self) -> int:
        """Bytes of the keys/values alone (every layer's store): :meth:`allocated_bytes` minus the bookkeeping
        (slot positions, slot state such as scores, policy state)."""
        return sum(layer.store.allocated_bytes() for layer in self.layers if layer.is_initialized)

    def peak_bytes(self, chunk: int) -> int:
        """Allocated bytes plus the transient copy of one ``chunk``-token forward of one layer (budget + one
        chunk); 0 before the first forward."""
        return self.allocated_bytes() + max(layer.chunk_bytes(chunk) for layer in self.layers)

    def start_trace(self) -> list[list]:
        """Record, per layer, ``(query_positions [b, q], key_positions [b, P, kv], mask [b, P, q, kv])`` of every
        later forward (the decisions the cache made, to replay them as a dense mask). Returns the lists."""
        for layer in self.layers:
            layer.trace = []
        return [layer.trace for layer in self.layers]

    def reset(self) -> None:
        super().reset()
        self._real_seen = None
        self._step = None
