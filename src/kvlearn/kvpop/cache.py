"""The KVpop bounded cache: sinks + protected window + the learned top-k of older tokens, per KV head.

One retention rule, two executions (ARCHITECTURE rule 4). Training and prefill rank a whole sequence once by the
static priority ``p_t = r_t - t log(gamma_h)`` (Eq. 20, decay step 1) and keep, for query ``q``, the top-k of the
eligible set ``E(q) = {t : s <= t <= q - w}`` (:mod:`kvlearn.ops.fenwick`, :mod:`kvlearn.ops.masks`). Decoding
applies the same function one token at a time: when query ``q`` arrives, token ``q - w`` leaves the window and
joins the retained eligible tokens; if they are now ``k + 1``, the worst one (lowest priority, the later token on
ties, as :func:`kvlearn.ops.fenwick.static_ranks` orders them) is evicted and the new token takes its slot. Since
priorities are static, a token that leaves the top-k never returns, so this equals the full-sequence mask.

Per-sequence state lives here (slot priorities); the learned modules (a scorer and the per-head decay) live on
the model and are only called. Supported now: stateless scorers (linear, MLP), one prefill forward into an empty
cache, then one token per forward (what ``generate`` does). The delayed mLSTM readout and chunked prefill into a
non-empty cache raise a clear error.
"""

from __future__ import annotations

import torch
from torch import nn

from ..cache import NEVER, CompactCache, CompactLayer, ForwardStep, SlotPlan
from ..config import KVpopConfig
from ..errors import KVLearnError, check
from ..ops.fenwick import running_topk_cutoff


class KVpopLayer(CompactLayer):
    """One layer of the KVpop cache: ``capacity = sinks + window + topk`` slots per (batch row, KV head).

    Args:
        config: the budget (``sinks``, ``window``, ``topk``) and ``decay_step`` (must be 1).
        scorer: ``module(key, value) -> raw scores [batch, kv_heads, q]`` (float32), stateless.
        decay: ``module() -> log_gamma [kv_heads]`` (float32, negative).
    """

    per_head = True

    def __init__(self, config: KVpopConfig, scorer: nn.Module, decay: nn.Module):
        check(config.decay_step == 1, f"decay_step={config.decay_step} is not supported by the cache: expected 1 (static priorities)")
        check(not getattr(scorer, "stateful", False),
              f"{type(scorer).__name__} is stateful: the KVpop cache supports stateless scorers (linear, mlp) for now")
        super().__init__(capacity=config.budget)
        self.config, self.scorer, self.decay = config, scorer, decay
        self.slot_priority: torch.Tensor | None = None  # [batch, kv_heads, capacity] float32
        self._new_priority: torch.Tensor | None = None  # [batch, kv_heads, q] of the forward in progress

    def _priorities(self, step: ForwardStep, key_states, value_states) -> torch.Tensor:
        """Static priorities of the new tokens ``[batch, kv_heads, q]`` float32 (``-inf`` for padding)."""
        with torch.no_grad():
            raw = self.scorer(key_states, value_states).float()
            log_gamma = self.decay().float()
        pos = step.positions[:, None, :].float()
        prio = raw - pos * log_gamma[None, :, None]
        return torch.where(step.positions[:, None, :] >= 0, prio, torch.full_like(prio, float("-inf")))

    def plan(self, step: ForwardStep, key_states: torch.Tensor, value_states: torch.Tensor) -> SlotPlan:
        prio = self._priorities(step, key_states, value_states)
        self._new_priority = prio
        if self.slot_priority is None:
            b, h = key_states.shape[:2]
            self.slot_priority = torch.full((b, h, self.capacity), float("-inf"), device=key_states.device)
        if step.query_length == 1:
            return self._plan_decode(step, prio)
        if self.seen == 0:
            return self._plan_prefill(step, prio)
        raise KVLearnError(
            f"KVpop cache: a {step.query_length}-token forward after {self.seen} tokens (chunked prefill) is not "
            "supported yet: prefill the prompt in one forward, then decode one token at a time"
        )

    def _plan_prefill(self, step: ForwardStep, prio: torch.Tensor) -> SlotPlan:
        """Prompt into an empty cache: the running top-k of the whole prompt (Fenwick cutoffs), per row."""
        s, w, k = self.config.sinks, self.config.window, self.config.topk
        pos = step.positions  # [b, q], -1 = padding
        b, q = pos.shape
        h = prio.shape[1]
        # sequence order = position order, padding last (priority -inf: never eligible for a real query)
        order = torch.argsort(torch.where(pos >= 0, pos, torch.full_like(pos, q)), dim=1, stable=True)  # [b, q]
        seq_prio = torch.gather(prio, 2, order[:, None, :].expand(b, h, q)).contiguous()
        ranks, cutoffs = running_topk_cutoff(seq_prio, s, w, k)
        t = torch.arange(q, device=pos.device)
        n_real = step.real_after[:, None, None]  # [b, 1, 1]
        # cutoffs are non-increasing in the query: token t leaves the top-k at the first query p >= t + w with
        # cutoffs[p] < ranks[t], i.e. from the first index where -cutoffs (non-decreasing) exceeds -ranks[t]
        first_drop = torch.searchsorted(-cutoffs.long().contiguous(), -ranks.long().contiguous(), right=True)
        end = torch.maximum(first_drop, t + w)
        end = torch.where((t < s) | (end >= n_real), torch.full_like(end, NEVER), end)  # sinks; kept at the end
        survives = (end == NEVER) & (t < n_real)
        slot = torch.where(survives, survives.long().cumsum(dim=2) - 1, torch.full_like(end, -1))
        # back from sequence order to columns
        inverse = torch.argsort(order, dim=1)[:, None, :].expand(b, h, q)
        new_end = torch.gather(end, 2, inverse)
        write_slots = torch.gather(slot, 2, inverse)
        valid = pos[:, None, :] >= 0
        empty = torch.zeros_like(self.slot_positions, dtype=torch.long)  # the buffer is empty: nothing to evict
        return SlotPlan(write_slots=torch.where(valid, write_slots, -1), old_end=empty,
                        new_end=torch.where(valid, new_end, torch.zeros_like(new_end)))

    def _plan_decode(self, step: ForwardStep, prio: torch.Tensor) -> SlotPlan:
        """One new token at position p: token p - w joins the eligible set; evict the worst of k + 1."""
        s, w, k = self.config.sinks, self.config.window, self.config.topk
        p = step.positions[:, 0]  # [b]
        check(bool((p >= 0).all()), "KVpop cache: a padding token while decoding is not supported")
        slot_pos = self.slot_positions.long()  # [b, h, C]
        eligible = (slot_pos >= s) & (slot_pos <= (p - w)[:, None, None])
        count = eligible.sum(dim=2)  # [b, h]
        sp = torch.where(eligible, self.slot_priority, torch.full_like(self.slot_priority, float("inf")))
        worst_prio = sp.min(dim=2, keepdim=True).values
        # among equal priorities the later token ranks lower (ties go to the earlier token)
        tied = eligible & (sp == worst_prio)
        worst = torch.where(tied, slot_pos, torch.full_like(slot_pos, -1)).argmax(dim=2)  # [b, h]
        evict = count > k
        free = (slot_pos < 0).long().argmax(dim=2)  # first free slot (exists whenever nothing is evicted)
        target = torch.where(evict, worst, free)
        old_end = torch.full_like(slot_pos, NEVER)
        old_end.scatter_(2, worst[..., None], torch.where(evict, p[:, None], NEVER)[..., None].long())
        return SlotPlan(write_slots=target[..., None], old_end=old_end,
                        new_end=torch.full_like(target[..., None], NEVER))

    def _write_extra(self, bi, hi, si, ti) -> None:
        if hi is None:
            self.slot_priority[bi, :, si] = self._new_priority[bi, :, ti]
        else:
            self.slot_priority[bi, hi, si] = self._new_priority[bi, hi, ti]

    def allocated_bytes(self) -> int:
        extra = 0 if self.slot_priority is None else self.slot_priority.numel() * self.slot_priority.element_size()
        return super().allocated_bytes() + extra

    def reset(self) -> None:
        super().reset()
        self.slot_priority = None


class KVpopCache(CompactCache):
    """A KVpop cache for every decoder layer; ``scorers[i]`` and ``decays[i]`` are layer ``i``'s learned modules."""

    def __init__(self, config: KVpopConfig, scorers: list[nn.Module], decays: list[nn.Module]):
        check(len(scorers) == len(decays) and len(scorers) > 0,
              f"{len(scorers)} scorers and {len(decays)} decays: expected one of each per decoder layer")
        super().__init__([KVpopLayer(config, sc, dc) for sc, dc in zip(scorers, decays)])
        self.config = config
