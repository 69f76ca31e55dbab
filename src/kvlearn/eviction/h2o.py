"""H2O (Zhang et al., 2023, "H2O: Heavy-Hitter Oracle"; github.com/FMInference/H2O ``utils_real_drop``; kvpress
``ObservedAttentionPress`` is its prefill-only relative): keep the heavy hitters (largest accumulated attention)
plus a recent window.

Rule here, per (batch row, KV head): a token's score is the attention it has received from every query so far,
summed over the queries and over the query heads of its KV head (unnormalised, as the reference accumulates
``attn.sum`` over queries; older tokens gather more). The ``window`` most recent tokens (default half the budget:
the reference's equal heavy/recent split) are protected; ``sinks = 0``. After each forward (a decode step attends
over ``budget + 1`` keys) the lowest-scored eligible tokens are evicted down to the budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import AttentionRequest, AttentionScoredPolicy, CompactCache, CompactLayer
from ..config import EvictionBudget

SUMMARY = "H2O: heavy hitters by accumulated attention (sum over queries and the KV head's group) + a recent window"
PROTOCOLS = ("bounded", "context")


@dataclass(frozen=True)
class H2OConfig(EvictionBudget):
    """``budget`` per KV head; ``sinks`` (0); ``window`` recent tokens (default ``budget // 2``)."""

    sinks: int = 0

    def default_window(self) -> int:
        return max(1, self.budget // 2)


CONFIG = H2OConfig


class H2OPolicy(AttentionScoredPolicy):
    def __init__(self, config: H2OConfig):
        super().__init__(config.budget, config.sinks, config.window)
        self._request = AttentionRequest("all", 1, "sum")

    def attention_request(self, step) -> AttentionRequest:
        return self._request

    def update_scores(self, stored, attention, positions, step) -> torch.Tensor:
        return torch.where(positions >= 0, stored + attention, torch.zeros_like(stored))


def make_cache(config: H2OConfig, model_config, *, store_factory=None) -> CompactCache:
    """``store_factory``: a callable returning a fresh :class:`~kvlearn.cache.Store` per layer (for example
    ``lambda: PackedStore(4)``); ``None`` = :class:`~kvlearn.cache.PlainStore`."""
    return CompactCache([CompactLayer(H2OPolicy(config), store_factory() if store_factory else None)
                         for _ in range(model_config.num_hidden_layers)])
