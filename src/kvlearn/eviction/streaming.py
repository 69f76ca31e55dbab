"""StreamingLLM (Xiao et al., 2024): keep the first ``sinks`` tokens and a window of the most recent ones.

The query at position ``p`` sees token ``t <= p`` iff ``t < sinks`` or ``p - t < window`` with
``window = budget - sinks``; once ``budget`` real tokens are seen every query sees exactly ``budget`` keys, itself
included. Positions are not re-indexed: each key keeps the RoPE rotation of its original position, as in the
transformers integration of every method here (the comparison between methods stays like for like).

Storage: slots ``0..sinks-1`` hold the sinks, slots ``sinks..budget-1`` a ring buffer over the window, so a new token
overwrites exactly the token that just left the window.
"""

from __future__ import annotations

import torch

from ..cache import NEVER, CompactCache, CompactLayer, ForwardStep, SlotPlan
from ..config import StreamingConfig


class StreamingLayer(CompactLayer):
    """One layer of a sinks + window cache (the same tokens in every KV head)."""

    per_head = False

    def __init__(self, config: StreamingConfig):
        super().__init__(capacity=config.budget)
        self.config = config

    def _slot_of(self, positions: torch.Tensor) -> torch.Tensor:
        s, w = self.config.sinks, self.config.window
        return torch.where(positions < s, positions, s + (positions - s).remainder(w))

    def _end_of(self, positions: torch.Tensor) -> torch.Tensor:
        s, w = self.config.sinks, self.config.window
        return torch.where(positions < s, torch.full_like(positions, NEVER), positions + w)

    def plan(self, step: ForwardStep, key_states=None, value_states=None) -> SlotPlan:
        pos = step.positions  # [batch, q]
        w = self.config.window
        survives = (pos >= 0) & ((pos < self.config.sinks) | (pos >= step.real_after[:, None] - w))
        write_slots = torch.where(survives, self._slot_of(pos), torch.full_like(pos, -1))[:, None, :]
        new_end = torch.where(pos >= 0, self._end_of(pos), torch.zeros_like(pos))[:, None, :]
        old_end = None
        if step.query_length > 1:
            old = self.slot_positions.to(torch.int64)
            old_end = torch.where(old >= 0, self._end_of(old), torch.zeros_like(old))
        return SlotPlan(write_slots=write_slots, old_end=old_end, new_end=new_end)


class StreamingCache(CompactCache):
    """A sinks + window cache for every decoder layer of ``model_config`` (a transformers config)."""

    def __init__(self, config: StreamingConfig, num_layers: int):
        super().__init__([StreamingLayer(config) for _ in range(num_layers)])
        self.config = config
