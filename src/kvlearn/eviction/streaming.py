"""StreamingLLM (Xiao et al., 2024, "Efficient Streaming Language Models with Attention Sinks"; kvpress
``StreamingLLMPress``): keep the first ``sinks`` tokens and a window of the most recent ones.

The query at position ``p`` sees token ``t <= p`` iff ``t < sinks`` or ``p - t < window`` with
``window = budget - sinks``; once ``budget`` real tokens are seen every query sees exactly ``budget`` keys, itself
included. Positions are not re-indexed: each key keeps the RoPE rotation of its original position, as in the
transformers integration of every method here (the comparison between methods stays like for like). The same
tokens are kept in every KV head (the rule reads positions only).

Storage: slots ``0..sinks-1`` hold the sinks, slots ``sinks..budget-1`` a ring buffer over the window, so a new token
overwrites exactly the token that just left the window (decoding: one fixed-shape scatter, compile-ready).
``context`` protocol (dense forward): every query of the forward sees every earlier token; the cache then keeps the
sinks and the last ``window`` tokens.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..cache import NEVER, CompactCache, CompactLayer, ForwardStep, Policy, SlotPlan, Store
from ..config import StreamingConfig

CONFIG = StreamingConfig
SUMMARY = "StreamingLLM: attention sinks + the most recent tokens (rule-based, the same tokens in every KV head)"
PROTOCOLS = ("bounded", "context")


class StreamingPolicy(Policy):
    """Sinks + ring-buffer window; capacity = budget; needs nothing (no slot state, no attention)."""

    per_head = False

    def __init__(self, config: StreamingConfig):
        super().__init__(config.budget)
        self.config = config

    def _slot_of(self, positions: torch.Tensor) -> torch.Tensor:
        s, w = self.config.sinks, self.config.window
        return torch.where(positions < s, positions, s + (positions - s).remainder(w))

    def _end_of(self, positions: torch.Tensor) -> torch.Tensor:
        s, w = self.config.sinks, self.config.window
        return torch.where(positions < s, torch.full_like(positions, NEVER), positions + w)

    def plan(self, layer, step: ForwardStep, key_states=None, value_states=None) -> SlotPlan:
        pos = step.positions  # [batch, q]
        w = self.config.window
        survives = (pos >= 0) & ((pos < self.config.sinks) | (pos >= step.real_after[:, None] - w))
        write_slots = torch.where(survives, self._slot_of(pos), torch.full_like(pos, -1))[:, None, :]
        new_end = torch.where(pos >= 0, self._end_of(pos), torch.zeros_like(pos))[:, None, :]
        old_end = None
        if step.query_length > 1:
            old = layer.slot_positions.to(torch.int64)
            old_end = torch.where(old >= 0, self._end_of(old), torch.zeros_like(old))
        return SlotPlan(write_slots=write_slots, old_end=old_end, new_end=new_end)


class StreamingLayer(CompactLayer):
    """One layer of a sinks + window cache (the same tokens in every KV head)."""

    def __init__(self, config: StreamingConfig, store: Store | None = None):
        super().__init__(StreamingPolicy(config), store)
        self.config = config


class StreamingCache(CompactCache):
    """A sinks + window cache of ``num_layers`` layers; ``store_factory`` returns a fresh store per layer (``None``:
    :class:`~kvlearn.cache.PlainStore`)."""

    def __init__(self, config: StreamingConfig, num_layers: int, store_factory: Callable[[], Store] | None = None):
        super().__init__([StreamingLayer(config, store_factory() if store_factory else None)
                          for _ in range(num_layers)])
        self.config = config


def make_cache(config: StreamingConfig, model_config, *,
               store_factory: Callable[[], Store] | None = None) -> StreamingCache:
    """A streaming cache for every decoder layer of ``model_config`` (a transformers ``PretrainedConfig``);
    ``store_factory``: a callable returning a fresh store per layer (for example ``lambda: PackedStore(4)``)."""
    return StreamingCache(config, model_config.num_hidden_layers, store_factory)
