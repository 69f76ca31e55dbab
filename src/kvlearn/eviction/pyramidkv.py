"""PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal Information Funneling";
kvpress ``PyramidKVPress``): SnapKV scoring with per-layer budgets decreasing linearly with depth, same total.

Per-layer budget (kvpress's rule, in our terms: ``B`` = the average budget per layer, which kvpress writes as
``window_size + q_len (1 - cr) - window_size``; ``L`` layers; ``n`` = ``context`` when given):
``min = B / beta``, ``max = 2B - min``; if ``max >= n - window`` then ``max = n - window`` and ``min = 2B - max``;
if not ``n >= max >= min >= window`` (here also ``min >= sinks + window + 1``, so every layer can rank) every layer
gets ``B`` (SnapKV); else layer ``l`` gets ``round(max - l (max - min) / (L - 1))``. ``beta = 20``. Without
``context`` the clamp to ``n - window`` is skipped. The total is ``L * B`` up to rounding. Decoding as SnapKV.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..cache import CompactCache, CompactLayer
from ..errors import check_int
from .snapkv import SnapKVConfig, SnapKVPolicy

SUMMARY = "PyramidKV: SnapKV with per-layer budgets decreasing linearly with depth (beta=20; context protocol)"
PROTOCOLS = ("context",)


@dataclass(frozen=True)
class PyramidKVConfig(SnapKVConfig):
    """SnapKV's fields, ``budget`` = the average per layer, and ``beta`` (20) the steepness of the pyramid."""

    beta: int = 20

    def __post_init__(self) -> None:
        check_int("beta", self.beta, 1)
        super().__post_init__()


CONFIG = PyramidKVConfig


def layer_budgets(config: PyramidKVConfig, num_layers: int) -> list[int]:
    """Budget of each layer (first = largest); see the module docstring."""
    b, w = config.budget, config.window
    n = config.context if config.context is not None else math.inf
    low = b / config.beta
    high = 2 * b - low
    if high >= n - w:
        high = n - w
        low = 2 * b - high
    if num_layers == 1 or not (n >= high >= low >= max(w, config.sinks + w + 1)):
        return [b] * num_layers
    steps = (high - low) / (num_layers - 1)
    return [round(high - i * steps) for i in range(num_layers)]


def make_cache(config: PyramidKVConfig, model_config, *, store_factory=None) -> CompactCache:
    """``store_factory``: a callable returning a fresh :class:`~kvlearn.cache.Store` per layer (for example
    ``lambda: PackedStore(4)``); ``None`` = :class:`~kvlearn.cache.PlainStore`."""
    budgets = layer_budgets(config, model_config.num_hidden_layers)
    return CompactCache([CompactLayer(SnapKVPolicy(config, budget=bl), store_factory() if store_factory else None)
                         for bl in budgets])
