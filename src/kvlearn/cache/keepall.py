"""The no-eviction policy: every token is kept, the token at position ``p`` of a row in slot ``p``.

A preallocated full cache of ``capacity`` slots (the longest sequence it will hold, prompt and generated tokens).
It is the policy of stores whose value is in how each token is stored rather than which are kept: KV-Kaizen's
per-layer precision (:mod:`kvlearn.kaizen.cache`) and KIVI (:class:`kvlearn.cache.kivi.KIVIStore`, which needs slots
written in position order and never overwritten: :attr:`KeepAllPolicy.append_only`). Decoding is one fixed-shape
scatter into the slot of the new token's position (no host sync).
"""

from __future__ import annotations

import torch

from ..errors import check
from .policy import NEVER, ForwardStep, Policy, SlotPlan


class KeepAllPolicy(Policy):
    """Slot = position; nothing is evicted; the same tokens in every KV head. ``capacity``: the most tokens a row
    will hold (a forward that could exceed it is refused with a one-line error, checked on the host against the
    tokens seen, padding included, so without a device sync)."""

    per_head = False
    append_only = True

    def plan(self, layer, step: ForwardStep, key_states=None, value_states=None) -> SlotPlan:
        q = step.query_length
        check(layer.seen + q <= self.capacity,
              f"{layer.seen} tokens seen + {q} new exceed the capacity of this full cache ({self.capacity} slots): "
              "make the cache with a capacity >= prompt + generated tokens")
        pos = step.positions  # [batch, q]
        write = torch.where(pos >= 0, pos, torch.full_like(pos, -1))[:, None, :]
        return SlotPlan(write_slots=write, old_end=None, new_end=torch.full_like(write, NEVER))
