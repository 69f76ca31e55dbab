"""Knorm (Devoto et al., 2024, "A Simple and Effective L2 Norm-Based Strategy for KV Cache Compression"; kvpress
``KnormPress``): keep the keys of lowest L2 norm.

Score of a token in a KV head = ``-||k||_2`` of its (post-RoPE) key in that head (RoPE rotates pairs of channels,
so the norm is that of the pre-RoPE key); per KV head, so heads keep different tokens. On the scored base
(:class:`kvlearn.cache.ScoredPolicy`): the first ``sinks`` and the ``window`` most recent tokens are protected (kvpress
protects nothing; we protect them as every method here does), and of the others the ``topk`` lowest-norm keys are
kept. The score is static, so decisions are exact per query in every forward, decoding evicts before attending and
the capacity is the budget; the attention function computes nothing extra.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import CompactCache, CompactLayer, ScoredPolicy
from ..config import EvictionBudget

SUMMARY = "Knorm: keep the keys of lowest L2 norm per KV head (+ sinks and a recent window)"
PROTOCOLS = ("bounded", "context")


@dataclass(frozen=True)
class KnormConfig(EvictionBudget):
    """``budget`` per KV head; ``sinks`` (4) and ``window`` (32) protected."""


CONFIG = KnormConfig


class KnormPolicy(ScoredPolicy):
    def __init__(self, config: KnormConfig):
        super().__init__(config.budget, config.sinks, config.window)

    def score(self, layer, step, key_states: torch.Tensor, value_states: torch.Tensor) -> torch.Tensor:
        """``-||k||`` per new token: ``[batch, kv_heads, q]`` float32."""
        return -key_states.float().norm(dim=-1)


def make_cache(config: KnormConfig, model_config, *, store_factory=None) -> CompactCache:
    """``store_factory``: a callable returning a fresh :class:`~kvlearn.cache.Store` per layer (for example
    ``lambda: PackedStore(4)``); ``None`` = :class:`~kvlearn.cache.PlainStore`."""
    return CompactCache([CompactLayer(KnormPolicy(config), store_factory() if store_factory else None)
                         for _ in range(model_config.num_hidden_layers)])
