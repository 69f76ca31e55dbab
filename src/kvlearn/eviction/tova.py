"""TOVA (Oren et al., 2024, "Transformers are Multi-State RNNs"; github.com/schwartz-lab-NLP/TOVA; kvpress
``TOVAPress``): after each step, evict the token that received the lowest attention from the current (last) query.

Rule here, per (batch row, KV head): score of a held token = the post-softmax attention of the last real query of
the forward, averaged over the query heads of that KV head (GQA choice: the paper and kvpress average over *all*
heads of the layer, one ranking shared by every KV head; we average within each KV head's group so every KV head
keeps its own tokens, like every method here). A decode step attends over ``budget + 1`` keys and then evicts the
lowest-scored one (the evicted token took part in this step, as in the reference); the query's own token is
protected (``window = 1``, kvpress gives it the maximum score); ``sinks = 0`` as in the paper. A multi-token forward
attends causally over the buffer and the chunk, then keeps the ``budget`` best by the attention of its last query.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import AttentionRequest, AttentionScoredPolicy, CompactCache, CompactLayer
from ..config import EvictionBudget

SUMMARY = "TOVA: evict the token with the lowest attention from the current query (mean over the KV head's group)"
PROTOCOLS = ("bounded", "context")


@dataclass(frozen=True)
class TOVAConfig(EvictionBudget):
    """``budget`` per KV head; ``sinks`` (0) and ``window`` (1: the query's own token) protected."""

    sinks: int = 0

    def default_window(self) -> int:
        return 1


CONFIG = TOVAConfig


class TOVAPolicy(AttentionScoredPolicy):
    def __init__(self, config: TOVAConfig):
        super().__init__(config.budget, config.sinks, config.window)
        self._request = AttentionRequest("last", 1, "mean")

    def attention_request(self, step) -> AttentionRequest:
        return self._request

    def update_scores(self, stored, attention, positions, step) -> torch.Tensor:
        return torch.where(positions >= 0, attention, torch.full_like(attention, float("-inf")))


def make_cache(config: TOVAConfig, model_config, *, store_factory=None) -> CompactCache:
    """``store_factory``: a callable returning a fresh :class:`~kvlearn.cache.Store` per layer (for example
    ``lambda: PackedStore(4)``); ``None`` = :class:`~kvlearn.cache.PlainStore`."""
    return CompactCache([CompactLayer(TOVAPolicy(config), store_factory() if store_factory else None)
                         for _ in range(model_config.num_hidden_layers)])
