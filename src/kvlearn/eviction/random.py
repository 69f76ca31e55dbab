"""Random eviction (kvpress ``RandomPress``): the lower bound every method must beat.

Score of a token = a hash of ``(seed, layer, kv_head, position)`` mapped to ``[0, 1)``, so a token's score does not
depend on the batch it runs in (a batch equals each row run alone) and a run is reproducible from ``seed``
(default 0) without any random generator state. On the static scored base: ``sinks`` and the recent ``window``
protected, the ``topk`` highest-scored eligible tokens kept per KV head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..cache import CompactCache, CompactLayer, ScoredPolicy
from ..config import EvictionBudget
from ..errors import check_int

SUMMARY = "Random: seeded random scores per KV head (+ sinks and a recent window); the lower bound"
PROTOCOLS = ("bounded", "context")
_MASK = 0xFFFFFFFF


@dataclass(frozen=True)
class RandomConfig(EvictionBudget):
    """``budget`` per KV head; ``sinks`` (4), ``window`` (32); ``seed`` of the score hash (0)."""

    seed: int = 0

    def __post_init__(self) -> None:
        check_int("seed", self.seed, 0)
        super().__post_init__()


CONFIG = RandomConfig


def hashed_scores(seed: int, layer: int, heads: int, positions: torch.Tensor) -> torch.Tensor:
    """``[batch, heads, q]`` float32 in ``[0, 1)`` from ``positions [batch, q]`` (a 32-bit integer mix)."""
    h = torch.arange(heads, device=positions.device, dtype=torch.int64)[None, :, None]
    x = (positions[:, None, :].clamp(min=0) * 0x9E3779B1 + h * 0x85EBCA77 + layer * 0xC2B2AE3D + seed * 0x27D4EB2F) & _MASK
    for mult in (0x2C1B3C6D, 0x297A2D39):
        x = ((x ^ (x >> 15)) * mult) & _MASK
    x = x ^ (x >> 15)
    return x.float() / float(2 ** 32)


class RandomPolicy(ScoredPolicy):
    def __init__(self, config: RandomConfig, layer_idx: int):
        super().__init__(config.budget, config.sinks, config.window)
        self.seed, self.layer_idx = config.seed, layer_idx

    def score(self, layer, step, key_states, value_states) -> torch.Tensor:
        return hashed_scores(self.seed, self.layer_idx, key_states.shape[1], step.positions)


def make_cache(config: RandomConfig, model_config, *, store_factory=None) -> CompactCache:
    """``store_factory``: a callable returning a fresh :class:`~kvlearn.cache.Store` per layer (for example
    ``lambda: PackedStore(4)``); ``None`` = :class:`~kvlearn.cache.PlainStore`."""
    return CompactCache([CompactLayer(RandomPolicy(config, i), store_factory() if store_factory else None)
                         for i in range(model_config.num_hidden_layers)])
