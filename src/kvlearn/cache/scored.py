"""The scored-eviction base: a policy that ranks tokens implements one ``score()``; the base does the rest.

Per (batch row, KV head): the first ``sinks`` tokens and the ``window`` most recent ones (the query included) are
protected; of the other (eligible) tokens at most ``topk = budget - sinks - window`` are kept, and when one more
arrives the lowest-scored one is evicted (the later token on ties). Higher score = keep.

Two executions of that rule:

- :class:`ScoredPolicy` (static scores, fixed when a token is written: KVpop, knorm, random). Decisions need no
  attention, so they are made before attending and the capacity is the budget. Because scores never change, a token
  that leaves the top-k never returns, so at query ``p`` the cache holds exactly sinks + window + the top-k of the
  eligible set. Decoding evicts the worst of ``topk + 1`` with a fixed-shape ``argmin``/``scatter_`` (compile-ready);
  a multi-token forward (prefill, chunked prefill into a non-empty cache) gets the exact per-query visibility of
  that rule from the running top-k cutoff (:func:`kvlearn.ops.fenwick.running_topk_cutoff`) over the buffer
  followed by the chunk, in position order.
- :class:`AttentionScoredPolicy` (scores from the attention of the new queries: TOVA, H2O, SnapKV, PyramidKV).
  The queries of a forward attend first: a decode step sees ``budget + 1`` keys (capacity ``budget + 1``), a
  multi-token forward sees the buffer plus the chunk causally; then the attention function hands the requested
  attention back (:meth:`kvlearn.cache.CompactLayer.observe_attention`) and the policy evicts down to the budget:
  one token per decode step, the lowest-scored eligible tokens after a multi-token forward.
"""

from __future__ import annotations

import torch

from ..errors import check
from ..ops.fenwick import running_topk_cutoff
from ..ops.masks import eviction_positions
from .policy import NEVER, ChunkRetention, ForwardStep, Policy, SlotPlan

_LAST = 2 ** 62  # sort key of an empty slot / padding token: after every real position


def position_order(positions: torch.Tensor) -> torch.Tensor:
    """``[b, P, n]`` indices that sort candidates by position, empty/padding (``-1``) last, stably."""
    return torch.argsort(torch.where(positions >= 0, positions, torch.full_like(positions, _LAST)), dim=2, stable=True)


def worst_eligible(positions: torch.Tensor, scores: torch.Tensor, eligible: torch.Tensor) -> torch.Tensor:
    """Slot of the lowest-scored eligible token, the later token on ties: ``[b, P]`` (fixed shape, no sync).

    positions, scores, eligible: ``[b, P, capacity]``."""
    sp = torch.where(eligible, scores, torch.full_like(scores, float("inf")))
    worst = sp.min(dim=2, keepdim=True).values
    tied = eligible & (sp == worst)
    return torch.where(tied, positions, torch.full_like(positions, -1)).argmax(dim=2)


class ScoredPolicy(Policy):
    """Static-score eviction (see the module docstring). Subclasses implement :meth:`score`.

    Args:
        budget: tokens kept per (batch row, KV head). sinks, window: protected first / most recent tokens
            (``window`` counts the query itself). Requires ``sinks + window <= budget``.
    """

    per_head = True
    slot_state = {"score": (torch.float32, float("-inf"))}
    # ``None``: the plain rule. A number ``c``: additionally, an eligible token whose score is below ``c`` is evicted
    # the moment it leaves the window (even with free slots): DMS's threshold rule (score = -logit, c = 0). Every
    # kept token then scores >= c > every dropped one, so top-k of the kept = (top-k of all) minus the dropped.
    drop_below: float | None = None

    def __init__(self, budget: int, sinks: int, window: int, capacity: int | None = None):
        check(window >= 1 and sinks >= 0 and sinks + window <= budget,
              f"budget={budget} is invalid: expected >= sinks + window = {sinks + window} (sinks={sinks}, window={window})")
        super().__init__(capacity if capacity is not None else budget)
        self.budget, self.sinks, self.window = budget, sinks, window
        self.topk = budget - sinks - window

    # ----- what a method implements -----
    def score(self, layer, step: ForwardStep, key_states: torch.Tensor, value_states: torch.Tensor) -> torch.Tensor:
        """Score of each new token, ``[batch, kv_heads, q]`` float32 (higher = keep). Padding columns are ignored."""
        raise NotImplementedError  # pragma: no cover - abstract

    def decode_score(self, layer, step: ForwardStep, key_states, value_states) -> torch.Tensor:
        """Score of the one new token while decoding (``[batch, kv_heads, 1]``); may also update the stored
        ``layer.slot_state["score"]`` of a held token (KVpop's delayed readout)."""
        return self.score(layer, step, key_states, value_states)

    # ----- the rule -----
    def plan(self, layer, step: ForwardStep, key_states, value_states) -> SlotPlan:
        if step.query_length == 1:
            return self._plan_decode(layer, step, self.decode_score(layer, step, key_states, value_states).float())
        new = self.score(layer, step, key_states, value_states).float()
        new = torch.where(step.positions[:, None, :] >= 0, new, torch.full_like(new, float("-inf")))
        return self._plan_chunk(layer, step, new)

    def _plan_decode(self, layer, step: ForwardStep, new_score: torch.Tensor) -> SlotPlan:
        """One new token at position p (fixed shapes, no sync): token p - window has just joined the eligible set;
        if more than ``topk`` are eligible the worst one is evicted and the new token takes its slot."""
        p = step.positions[:, 0]  # [b], -1 = padding
        pos = layer.slot_positions.long()  # [b, P, C]
        eligible = (pos >= self.sinks) & (pos <= (p - self.window)[:, None, None])
        worst = worst_eligible(pos, layer.slot_state["score"], eligible)
        evict = eligible.sum(dim=2) > self.topk
        if self.drop_below is not None:  # the token leaving the window now is the only eligible one that can be low
            low = eligible & (layer.slot_state["score"] < self.drop_below)
            evict = evict | low.any(dim=2)
        free = (pos < 0).long().argmax(dim=2)  # first free slot (exists whenever nothing is evicted)
        target = torch.where(evict, worst, free)
        target = torch.where((p >= 0)[:, None], target, torch.full_like(target, -1))[..., None]
        never = torch.full_like(target, NEVER)
        return SlotPlan(write_slots=target, old_end=None, new_end=never, new_state={"score": new_score})

    def _plan_chunk(self, layer, step: ForwardStep, new_score: torch.Tensor) -> SlotPlan:
        """A multi-token forward: the running top-k over the buffer followed by the chunk, in position order.

        The buffer holds the sinks, the last ``window - 1`` tokens and at most ``topk`` eligible tokens, and an
        evicted token never returns, so ranking the held tokens followed by the new ones (sequence index instead
        of position) gives the same decisions as the whole sequence: sinks are the first ``sinks`` indices, the
        window tail is contiguous, and every held non-window token is eligible for every new query."""
        b, q = step.positions.shape
        h = new_score.shape[1]
        cap = self.capacity
        cand_pos = torch.cat([layer.slot_positions.long(), step.positions[:, None, :].expand(b, h, q)], dim=2)
        cand_score = torch.cat([layer.slot_state["score"], new_score], dim=2)
        cand_score = torch.where(cand_pos >= 0, cand_score, torch.full_like(cand_score, float("-inf")))
        order = position_order(cand_pos)  # [b, h, N]
        seq_prio = torch.gather(cand_score, 2, order).contiguous()
        seq_pos = torch.gather(cand_pos, 2, order)
        n = seq_pos.shape[2]
        ranks, cutoffs = running_topk_cutoff(seq_prio, self.sinks, self.window, self.topk)
        end_idx = eviction_positions(ranks, cutoffs, self.sinks, self.window).long()  # index of the first blind query
        if self.drop_below is not None:  # dropped when it leaves the window: index + window (the tail is contiguous)
            low = (seq_prio < self.drop_below) & (seq_pos >= self.sinks)
            idx = torch.arange(n, device=seq_pos.device)
            end_idx = torch.where(low, torch.minimum(end_idx, (idx + self.window).clamp(max=n)), end_idx)
        n_real = (seq_pos >= 0).sum(dim=2, keepdim=True)
        survives = end_idx >= n_real
        end_pos = torch.gather(seq_pos, 2, end_idx.clamp(max=n - 1))
        end_pos = torch.where(survives, torch.full_like(end_pos, NEVER), end_pos)
        inverse = torch.argsort(order, dim=2)
        end_c = torch.gather(end_pos, 2, inverse)
        keep_c = torch.gather(survives & (seq_pos >= 0), 2, inverse)
        # held survivors keep their slot; new survivors fill the freed slots in order
        free_first = torch.argsort((keep_c[..., :cap]).long(), dim=2, stable=True)  # free slots first, in slot order
        new_keep = keep_c[..., cap:]
        rank = (new_keep.long().cumsum(dim=2) - 1).clamp(min=0)
        slots = torch.where(new_keep, torch.gather(free_first, 2, rank), torch.full_like(rank, -1))
        new_end = torch.where(step.positions[:, None, :] >= 0, end_c[..., cap:], torch.zeros_like(rank))
        retention = None
        if self.drop_below is None:  # the threshold rule's early drops are not a running top-k
            held = (layer.slot_positions >= 0).sum(dim=2)  # [b, P] tokens held before this forward
            retention = ChunkRetention(order, ranks, cutoffs, held, self.sinks, self.window, self.topk)
        return SlotPlan(write_slots=slots, old_end=end_c[..., :cap], new_end=new_end, new_state={"score": new_score},
                        retention=retention)


class AttentionScoredPolicy(ScoredPolicy):
    """Eviction by scores computed from the attention of the new queries (see the module docstring).

    Subclasses implement :meth:`attention_request` and :meth:`update_scores`; :meth:`initial_score` and
    :meth:`kept_score` have defaults. Capacity is ``budget + 1``.
    """

    observes = True

    def __init__(self, budget: int, sinks: int, window: int):
        check(sinks + window < budget + 1, f"budget={budget} is invalid: expected >= sinks + window = {sinks + window}")
        super().__init__(budget, sinks, window, capacity=budget + 1)

    def initial_score(self, step: ForwardStep, key_states: torch.Tensor) -> torch.Tensor:
        """Stored score of new tokens before their attention is seen: ``[b, kv_heads, q]`` (default 0)."""
        b, h, q, _ = key_states.shape
        return torch.zeros(b, h, q, dtype=torch.float32, device=key_states.device)

    def update_scores(self, stored: torch.Tensor, attention: torch.Tensor | None, positions: torch.Tensor,
                      step: ForwardStep) -> torch.Tensor:
        """Scores of the candidates ``[b, P, n]`` from their stored scores and this forward's attention
        (``[b, kv_heads, n]`` or None); ``positions [b, P, n]`` (-1 = empty)."""
        raise NotImplementedError  # pragma: no cover - abstract

    def kept_score(self, scores: torch.Tensor, positions: torch.Tensor, protected: torch.Tensor) -> torch.Tensor:
        """Score stored for the tokens kept after a multi-token forward (default: their score)."""
        return scores

    def plan(self, layer, step: ForwardStep, key_states, value_states) -> SlotPlan:
        b, h, q, _ = key_states.shape
        init = self.initial_score(step, key_states)
        never = torch.full((b, h, q), NEVER, dtype=torch.int64, device=key_states.device)
        if q > 1:  # attend over buffer + chunk causally, compress after (observe)
            return SlotPlan(write_slots=torch.full_like(never, -1), old_end=None, new_end=never,
                            new_state={"score": init}, defer=True)
        p = step.positions[:, 0]
        free = (layer.slot_positions < 0).long().argmax(dim=2)  # held <= budget < capacity: a free slot exists
        target = torch.where((p >= 0)[:, None], free, torch.full_like(free, -1))[..., None]
        return SlotPlan(write_slots=target, old_end=None, new_end=never, new_state={"score": init})

    def observe(self, layer, step: ForwardStep, attention: torch.Tensor | None) -> None:
        if step.query_length == 1:
            self._evict_one(layer, step, attention)
        else:
            self._compress(layer, step, attention)

    def _evict_one(self, layer, step: ForwardStep, attention) -> None:
        """After a decode step: if ``budget + 1`` tokens are held, free the slot of the worst eligible one (its
        interval ends at ``p + 1``). Fixed shapes, no sync."""
        pos = layer.slot_positions.long()
        scores = self.update_scores(layer.slot_state["score"], attention, pos, step)
        layer.slot_state["score"].copy_(scores)
        p = step.positions[:, 0]
        eligible = (pos >= self.sinks) & (pos <= (p - self.window)[:, None, None])
        worst = worst_eligible(pos, scores, eligible)[..., None]  # [b, P, 1]
        evict = ((pos >= 0).sum(dim=2) > self.budget)[..., None]
        current = torch.gather(layer.slot_positions, 2, worst)
        layer.slot_positions.scatter_(2, worst, torch.where(evict, torch.full_like(current, -1), current))

    def _compress(self, layer, step: ForwardStep, attention) -> None:
        """After a multi-token forward: keep the protected tokens and the best-scored eligible ones, ``budget``
        in all, per (row, KV head)."""
        cand_pos, state = layer.candidates
        scores = self.update_scores(state["score"], attention, cand_pos, step)
        last = step.real_after[:, None, None] - 1  # last real position (a row may have none in this forward)
        protected = (cand_pos >= 0) & ((cand_pos < self.sinks) | (cand_pos > last - self.window))
        key = torch.where(protected, torch.full_like(scores, float("inf")), scores)
        key = torch.where(cand_pos >= 0, key, torch.full_like(key, float("-inf")))
        top = key.topk(self.budget, dim=2)
        valid = top.values > float("-inf")
        kept = self.kept_score(scores, cand_pos, protected)
        layer.replace_all(top.indices, valid, {"score": torch.gather(kept, 2, top.indices)})
