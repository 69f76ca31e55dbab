"""SnapKV (Li et al., 2024, "SnapKV: LLM Knows What You are Looking for Before Generation";
github.com/FasterDecoding/SnapKV; kvpress ``SnapKVPress``): compress a prompt once, by the attention its last
``window_size`` queries (the observation window) pay to the earlier tokens.

Rule here, per (batch row, KV head), at the end of a multi-token forward (the ``context`` protocol: the prompt is
prefilled densely, :func:`kvlearn.cache.prefill` with ``dense=True``):

1. ``a_j`` = post-softmax attention of the forward's last ``window_size`` real queries to key ``j``, summed over
   those queries and averaged over the query heads of the KV head (kvpress's GQA rule; the official code repeats
   K/V per query head and keeps a cache per query head, saving nothing under GQA).
2. Observation-window tokens are set to 0 and ``a`` is pooled over the key axis in position order with kernel
   ``kernel_size`` (5), stride 1, zero padding ``kernel_size // 2`` (``avg`` as the reference, or ``max``). Average
   pooling is linear, so pooling before or after the group mean is the same; max pooling here pools the group mean.
3. Keep the observation window (protected, with ``sinks``, default 0) and the ``budget - window_size`` best pooled
   scores among the other tokens; evict the rest.

The selection runs once per sequence: at its first multi-token forward (or at a ``dense`` one). Every later forward
(the question chunks of the ``context`` protocol, decoding) is defined here, as SnapKV compresses the prompt only:
the prompt tokens selected in step 3 stay for good, and the observation window plus the new tokens form a recent
window, the oldest of them evicted first (the attention function computes nothing for these forwards). So the
question never takes part in the selection, the cache never exceeds the budget, and generated tokens are kept as a
sliding window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..cache import AttentionRequest, AttentionScoredPolicy, CompactCache, CompactLayer
from ..cache.scored import position_order
from ..config import EvictionBudget
from ..errors import check, check_int

SUMMARY = "SnapKV: prompt compression by the pooled attention of the last window_size queries (context protocol)"
PROTOCOLS = ("context",)


@dataclass(frozen=True)
class SnapKVConfig(EvictionBudget):
    """``budget`` per KV head; ``window`` = the observation window ``window_size`` (32); ``sinks`` (0);
    ``kernel_size`` (5, odd) and ``pooling`` (``"avg"`` or ``"max"``) of the score smoothing."""

    sinks: int = 0
    kernel_size: int = 5
    pooling: str = "avg"

    def __post_init__(self) -> None:
        check_int("kernel_size", self.kernel_size, 1)
        check(self.kernel_size % 2 == 1, f"kernel_size={self.kernel_size} is invalid: expected an odd integer >= 1")
        check(self.pooling in ("avg", "max"), f"pooling={self.pooling!r} is invalid: expected 'avg' or 'max'")
        super().__post_init__()

    @property
    def window_size(self) -> int:
        return self.window


CONFIG = SnapKVConfig


def pool_scores(scores: torch.Tensor, positions: torch.Tensor, kernel_size: int, pooling: str) -> torch.Tensor:
    """Pool ``scores [b, P, n]`` over the key axis in position order (``positions [b, P, n]``, -1 last), stride 1,
    zero padding; returns the pooled scores in the input order."""
    order = position_order(positions)
    x = torch.gather(scores, 2, order)
    b, p, n = x.shape
    flat = x.reshape(b * p, 1, n)
    if pooling == "avg":
        y = F.avg_pool1d(flat, kernel_size, stride=1, padding=kernel_size // 2, count_include_pad=True)
    else:
        y = F.max_pool1d(F.pad(flat, (kernel_size // 2, kernel_size // 2)), kernel_size, stride=1)
    out = torch.empty_like(x)
    out.scatter_(2, order, y.reshape(b, p, n))
    return out


class SnapKVPolicy(AttentionScoredPolicy):
    def __init__(self, config: SnapKVConfig, budget: int | None = None):
        super().__init__(config.budget if budget is None else budget, config.sinks, config.window)
        self.config = config
        self._request = AttentionRequest("last", config.window, "mean")
        self._selected = False  # per sequence: whether the prompt selection has run

    def attention_request(self, step):
        select = step.query_length > 1 and (step.dense or not self._selected)
        return self._request if select else None

    def reset(self) -> None:
        self._selected = False

    def initial_score(self, step, key_states):
        """New tokens: their position (decoding evicts the oldest non-selected token)."""
        b, h, q, _ = key_states.shape
        return step.positions[:, None, :].float().expand(b, h, q)

    def update_scores(self, stored, attention, positions, step):
        if attention is None:  # after the selection: keep it, oldest unselected token first
            return stored
        self._selected = True
        last = step.real_after[:, None, None] - 1
        prefix = (positions >= 0) & (positions <= last - self.window)  # outside the observation window
        a = torch.where(prefix, attention, torch.zeros_like(attention))
        pooled = pool_scores(a, positions, self.config.kernel_size, self.config.pooling)
        return torch.where(prefix, pooled, torch.zeros_like(pooled))

    def kept_score(self, scores, positions, protected):
        """Selected prompt tokens stay for good (+inf); the window's tokens are ranked by position from now on."""
        return torch.where(protected, positions.float(), torch.full_like(scores, float("inf")))


def make_cache(config: SnapKVConfig, model_config, *, store_factory=None) -> CompactCache:
    """``store_factory``: a callable returning a fresh :class:`~kvlearn.cache.Store` per layer (for example
    ``lambda: PackedStore(4)``); ``None`` = :class:`~kvlearn.cache.PlainStore`."""
    return CompactCache([CompactLayer(SnapKVPolicy(config), store_factory() if store_factory else None)
                         for _ in range(model_config.num_hidden_layers)])
