"""The policy half of a compact cache layer: which slot each new token takes and when each held token is evicted.

A policy never owns tensors. It reads the layer (``layer.slot_positions [batch, P, capacity]`` int32, ``-1`` = empty,
and ``layer.slot_state[name] [batch, P, capacity]``) and returns a :class:`SlotPlan`; the layer applies it. ``P`` is
``kv_heads`` for per-head policies, 1 when every KV head keeps the same tokens.

What a policy declares, so that the layer and the attention function do only what it needs:

- ``slot_state``: ``{name: (dtype, fill)}`` per-slot state the layer allocates and stores for it (``[batch, P,
  capacity]``, written with the tokens); the values of new tokens come in :attr:`SlotPlan.new_state`.
- :meth:`Policy.attention_request`: ``None`` (the policy decides before attending; nothing extra is computed) or an
  :class:`AttentionRequest`, which the attention function answers after attending by calling
  ``layer.observe_attention(attention)``; the policy then evicts in :meth:`Policy.observe`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

NEVER = torch.iinfo(torch.int32).max  # `end` of a token that is never evicted


@dataclass
class ForwardStep:
    """The new tokens of one forward, shared by all layers.

    Attributes:
        positions: ``[batch, q]`` int64 position of each new token among its row's real tokens, ``-1`` for padding.
        real_after: ``[batch]`` int64 number of real tokens of each row after this forward.
        has_padding: whether any new token is padding; ``None`` when not read (decoding: reading it would be a
            device sync, and the hot path handles padding with tensor ops instead).
        dense: the ``context`` protocol for this forward: every query sees every earlier token of the forward and of
            the buffer, and the policy compresses once to its budget after the forward.
    """

    positions: torch.Tensor
    real_after: torch.Tensor
    has_padding: bool | None
    dense: bool = False

    @property
    def query_length(self) -> int:
        return self.positions.shape[1]


@dataclass
class SlotPlan:
    """Where the new tokens go and when every returned key is evicted (before attending).

    Attributes:
        write_slots: ``[batch, P, q]`` int64 slot for each new token that survives this forward, ``-1`` otherwise.
        old_end: ``[batch, P, capacity]`` int64 first query position at which each buffered token is evicted
            (``NEVER`` if it survives this forward), or ``None`` when the forward evicts no buffered token except by
            overwriting its slot. Slots whose token is evicted by the end of the forward and not overwritten are freed.
        new_end: ``[batch, P, q]`` int64 the same for the new tokens.
        new_state: ``{name: [batch, P, q]}`` the per-slot state of the new tokens (every name of
            :attr:`Policy.slot_state`).
        defer: the policy decides after attending (:meth:`Policy.observe`): a multi-token forward writes nothing now.
    """

    write_slots: torch.Tensor
    old_end: torch.Tensor | None
    new_end: torch.Tensor
    new_state: dict[str, torch.Tensor] = field(default_factory=dict)
    defer: bool = False
    retention: ChunkRetention | None = None


@dataclass(frozen=True)
class ChunkRetention:
    """A multi-token forward's visibility as a running top-k over one sequence (static-score policies).

    The held tokens followed by the chunk, sorted by position (empty slots and padding last), form a sequence in
    which every query sees the sinks (the first ``sinks`` indices), the ``window`` indices up to itself and the keys
    whose rank is within its running cutoff: sparse retention over that sequence
    (:func:`kvlearn.ops.retention_attention.sparse_retention_attention`) is the forward's attention, without its ``[q,
    capacity + q]`` mask. Attributes: ``order [batch, P, capacity + q]`` int64 indices of the returned keys in that
    sequence order; ``ranks, cutoffs [batch, P, capacity + q]`` int32 (:mod:`kvlearn.ops.fenwick`); ``held [batch,
    P]`` int64 tokens held before the forward (the chunk's first index in the sequence); ``sinks``, ``window``,
    ``topk``: the rule's parameters."""

    order: torch.Tensor
    ranks: torch.Tensor
    cutoffs: torch.Tensor
    held: torch.Tensor
    sinks: int
    window: int
    topk: int


@dataclass(frozen=True)
class AttentionRequest:
    """What the attention function computes for a policy after attending (float32, per KV head).

    ``queries``: ``"last"`` (the last ``n`` real queries of the forward; TOVA ``n = 1``, SnapKV ``n = window_size``)
    or ``"all"`` (every real query of the forward; H2O). The result handed to ``layer.observe_attention`` is
    ``[batch, kv_heads, kv]``: the post-softmax attention probabilities of the selected queries summed over those
    queries, then aggregated over the query heads of each KV head by ``group`` (``"mean"`` or ``"sum"``).
    """

    queries: str
    n: int = 1
    group: str = "mean"

    def __post_init__(self) -> None:
        from ..errors import check, check_int

        check(self.queries in ("last", "all"), f"queries={self.queries!r} is invalid: expected 'last' or 'all'")
        check_int("n", self.n, 1)
        check(self.group in ("mean", "sum"), f"group={self.group!r} is invalid: expected 'mean' or 'sum'")


class Policy:
    """Base policy. Subclasses set ``capacity``/``per_head``/``slot_state`` and implement :meth:`plan`."""

    per_head: bool = False
    slot_state: dict[str, tuple[torch.dtype, float]] = {}
    observes: bool = False  # evicts after attending: the attention function calls layer.observe_attention
    append_only: bool = False  # writes slots in position order and never overwrites one (KeepAllPolicy)

    def __init__(self, capacity: int):
        from ..errors import check_int

        self.capacity = check_int("capacity", capacity, 1)

    def plan(self, layer, step: ForwardStep, key_states: torch.Tensor, value_states: torch.Tensor) -> SlotPlan:
        """The rule for the new tokens ``key_states, value_states: [batch, kv_heads, q, head_dim]``.

        With ``q == 1`` this runs on the decode path: fixed shapes only, no host sync."""
        raise NotImplementedError  # pragma: no cover - abstract

    def attention_request(self, step: ForwardStep) -> AttentionRequest | None:
        """What the attention function must hand back after attending this forward (None: nothing)."""
        return None

    def observe(self, layer, step: ForwardStep, attention: torch.Tensor | None) -> None:
        """Evict after attending (only called for policies whose plan set ``defer`` or that request attention)."""

    def reset(self) -> None:
        """Forget per-sequence state kept outside the layer's slot state (e.g. a recurrent scorer memory)."""

    def state_bytes(self) -> int:
        """Bytes of per-sequence state the policy holds outside the layer's buffers."""
        return 0
