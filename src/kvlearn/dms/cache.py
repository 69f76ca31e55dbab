"""The DMS inference cache: sinks + window + the long-range tokens the gates kept, on the cache contract v2.

Rule (Łańcucki et al. 2025, arXiv 2506.05345, section 3; delayed eviction of the reference ``DMSPagedCacheLayer``):
a token is never evicted while it is a sink or inside the window of the ``window`` most recent tokens (the query
included); when token ``t`` leaves the window (query ``t + window`` arrives) it is dropped iff its decision logit
``alpha[t + 1] > 0`` (the shift by one: the decision is produced by the next token), and its slot is reused.

Hard budget (not in the paper; for like-for-like comparisons at a budget ``B``): the ``topk = B - sinks - window``
long-range slots hold the kept tokens; when one more kept token leaves the window and they are full, the kept token
with the **highest eviction logit** is evicted (ties: the later token). This is :class:`~kvlearn.cache.ScoredPolicy`
with the static score ``-alpha[t + 1]`` and its threshold rule ``drop_below = 0`` (a token scoring below 0, i.e.
``alpha > 0``, is dropped on leaving the window even with free slots). Since every kept token scores >= 0 > every
dropped one, the held long-range set at query ``q`` is the top-``topk`` (by ``-alpha``) of the eligible tokens with
``alpha <= 0``; with ``B >=`` the sequence length this is exactly the paper's rule, and the full-sequence training
attention with hard gates (:func:`kvlearn.dms.attention.dms_bias`, ``hard=True``) computes the same function.

``DMSConfig.overflow_evicts`` picks another order for the full slots (the keep/drop decision is the same): ``oldest``
scores a kept token ``t`` by its position (the slots hold the most recent kept tokens), ``newest`` by
``2**24 - t`` (the first kept tokens stay; a newly kept token enters only where one was dropped); a dropped token
scores -1 either way. Positions are exact in the float32 score below ``2**24`` tokens.

The shift by one in the cache: a token's score is provisional (``+inf``: never eligible before it is set) until the
next real token of its row arrives; then the next token's logit is written into its slot (decoding: one fixed-shape
``where``, no sync) or, inside a multi-token forward, taken from the next real token of the chunk (positions, so
padding anywhere in a row is skipped). The gate logits of the forward are handed to the policy by the gate hook of
:func:`kvlearn.dms.apply.apply_dms` (``policy.set_logits``) before the layer's cache update; they are per-forward
state of the cache, not of the modules.
"""

from __future__ import annotations

import torch

from ..cache import CompactCache, CompactLayer, ForwardStep, ScoredPolicy
from ..cache.scored import position_order
from ..config import DMSConfig
from ..errors import check
from .gates import has_dms

PROVISIONAL = float("inf")  # score of a token whose decision (the next token's logit) is not known yet
NEWEST_BASE = float(2 ** 24)  # overflow_evicts="newest": a kept token scores NEWEST_BASE - position (exact in float32)


def keep_score(neg_alpha: torch.Tensor, position: torch.Tensor, overflow_evicts: str) -> torch.Tensor:
    """The slot score of decided tokens: ``-alpha`` (``highest_logit``) or, for a kept token (``-alpha >= 0``), its
    position (``oldest``) or ``2**24 - position`` (``newest``), -1 for a dropped one. ``neg_alpha``, ``position``:
    broadcastable, float32 result."""
    if overflow_evicts == "highest_logit":
        return neg_alpha
    pos = position.to(torch.float32)
    rank = pos if overflow_evicts == "oldest" else NEWEST_BASE - pos
    return torch.where(neg_alpha >= 0, rank, torch.full_like(rank, -1.0))


class DMSPolicy(ScoredPolicy):
    """DMS retention with a hard budget (see the module docstring): ``capacity = budget`` slots per (row, KV head);
    slot state ``"score"`` float32: ``-alpha[t + 1]``, or the overflow order's rank (:func:`keep_score`)."""

    drop_below = 0.0

    def __init__(self, config: DMSConfig):
        check(config.budget is not None,
              "a DMS cache needs a budget: set DMSConfig.budget (a budget >= the sequence length keeps every token the "
              "gates keep)")
        super().__init__(config.budget, config.sinks, config.window)
        self.config = config
        self.logits: torch.Tensor | None = None  # this forward's gate logits [batch, kv_heads, q] (set by the hook)

    def set_logits(self, alpha: torch.Tensor) -> None:
        """Hand this forward's gate logits ``[batch, kv_heads, q]`` to the policy (before the layer's update)."""
        self.logits = alpha.detach().float()

    def _take_logits(self, step: ForwardStep, heads: int) -> torch.Tensor:
        alpha = self.logits
        check(alpha is not None and alpha.shape[1:] == (heads, step.query_length),
              "the DMS cache got no gate logits for this forward: run the model made by apply_dms (its gate hooks "
              "hand them to the cache)")
        self.logits = None
        return alpha

    @staticmethod
    def _set_held(layer, position: torch.Tensor, score: torch.Tensor) -> None:
        """Write ``score [b, h]`` into the slot of the held token at ``position [b]`` (if held; ``< 0``: none)."""
        stored = layer.slot_state["score"]
        pos = layer.slot_positions.long()
        hit = (pos == position[:, None, None]) & (position >= 0)[:, None, None]
        stored.copy_(torch.where(hit, score[:, :, None], stored))

    def score(self, layer, step: ForwardStep, key_states, value_states) -> torch.Tensor:
        """Scores of a multi-token forward's tokens ``[b, h, q]``: ``-alpha`` of each token's next real token in the
        chunk (provisional for a row's last one); the row's held token just before the chunk gets the chunk's first
        logit."""
        b, h, q, _ = key_states.shape
        alpha = self._take_logits(step, h)
        pos = step.positions[:, None, :].expand(b, h, q)
        order = position_order(pos)
        s_alpha = torch.gather(alpha, 2, order)
        s_pos = torch.gather(pos, 2, order)
        nxt_real = torch.cat([s_pos[..., 1:] >= 0, torch.zeros_like(s_pos[..., :1], dtype=torch.bool)], dim=2)
        nxt_alpha = torch.cat([s_alpha[..., 1:], torch.zeros_like(s_alpha[..., :1])], dim=2)
        ranked = keep_score(-nxt_alpha, s_pos, self.config.overflow_evicts)
        s_score = torch.where(nxt_real, ranked, torch.full_like(nxt_alpha, PROVISIONAL))
        score = torch.empty_like(s_score).scatter_(2, order, s_score)
        first = s_pos[:, 0, 0]  # [b]: the first real position of the chunk (-1: no real token)
        held = torch.where(first >= 1, first - 1, torch.full_like(first, -1))
        self._set_held(layer, held, keep_score(-s_alpha[..., 0], held[:, None], self.config.overflow_evicts))
        return score

    def decode_score(self, layer, step: ForwardStep, key_states, value_states) -> torch.Tensor:
        """One new token at position ``p``: its logit decides token ``p - 1`` (written into that slot); its own
        score is provisional."""
        b, h = key_states.shape[:2]
        alpha = self._take_logits(step, h)  # [b, h, 1]
        p = step.positions[:, 0]
        held = torch.where(p >= 1, p - 1, torch.full_like(p, -1))
        self._set_held(layer, held, keep_score(-alpha[..., 0], held[:, None], self.config.overflow_evicts))
        return torch.full_like(alpha, PROVISIONAL)

    def reset(self) -> None:
        self.logits = None


class DMSLayer(CompactLayer):
    """One layer of the DMS cache (a :class:`DMSPolicy` over a plain store)."""

    def __init__(self, config: DMSConfig):
        super().__init__(DMSPolicy(config))
        self.config = config


class DMSCache(CompactCache):
    """A DMS cache of ``num_layers`` layers; the model's gate hooks hand each layer its logits."""

    def __init__(self, config: DMSConfig, num_layers: int):
        super().__init__([DMSLayer(config) for _ in range(num_layers)])
        self.config = config

    def check_model(self, num_layers: int, model=None) -> None:
        """Also: one-line error unless ``model`` has DMS gates (:func:`kvlearn.dms.apply.apply_dms`)."""
        super().check_model(num_layers, model)
        if model is not None:
            check(has_dms(model), f"{type(model).__name__} has no DMS gates: call kvlearn.dms.apply.apply_dms(model, "
                                  "config) before using a DMS cache")
