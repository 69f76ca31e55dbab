"""The KVpop bounded cache: sinks + protected window + the learned top-k of older tokens, per KV head.

One retention rule, two executions (ARCHITECTURE rule 4). Training and prefill rank a whole sequence once by the
static priority ``p_t = r_t - t log(gamma_h)`` (Eq. 20, decay step 1) and keep, for query ``q``, the top-k of the
eligible set ``E(q) = {t : s <= t <= q - w}`` (:mod:`kvlearn.ops.fenwick`, :mod:`kvlearn.ops.masks`). Decoding
applies the same function one token at a time: when query ``q`` arrives, token ``q - w`` leaves the window and
joins the retained eligible tokens; if they are now ``k + 1``, the worst one (lowest priority, the later token on
ties, as :func:`kvlearn.ops.fenwick.static_ranks` orders them) is evicted and the new token takes its slot. Since
priorities are static, a token that leaves the top-k never returns, so this equals the full-sequence mask.

Per-sequence state lives here (slot priorities, the mLSTM scorer state); the learned modules (a scorer and the
per-head decay) live on the model and are only called. A stateful scorer with the delayed readout scores token
``u`` when token ``u + w`` arrives, from the memory after ``u + w`` and ``u``'s cached key/value: exactly when
``u`` leaves the window and first competes, so the decision uses the same score as the training mask. Supported:
linear, MLP and mLSTM scorers (delayed or immediate readout), one prefill forward into an empty cache (left
padding), then one token per forward (what ``generate`` does); chunked prefill into a non-empty cache raises.
"""

from __future__ import annotations

import torch
from torch import nn

from ..cache import NEVER, CompactCache, CompactLayer, ForwardStep, SlotPlan
from ..config import KVpopConfig
from ..errors import KVLearnError, check
from ..ops.fenwick import running_topk_cutoff
from ..ops.masks import eviction_positions


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
        self.stateful = bool(getattr(scorer, "stateful", False))
        self.delay = int(getattr(scorer, "readout_delay", 0))
        check(self.delay in (0, config.window),
              f"scorer readout delay {self.delay} is invalid: expected 0 (immediate) or the window {config.window}")
        super().__init__(capacity=config.budget)
        self.config, self.scorer, self.decay = config, scorer, decay
        self.slot_priority: torch.Tensor | None = None  # [batch, kv_heads, capacity] float32
        self.scorer_state = None  # the stateful scorer's memory after the last token (per sequence)
        self._new_priority: torch.Tensor | None = None  # [batch, kv_heads, q] of the forward in progress

    def _static(self, raw: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Static priority ``raw - t log(gamma)`` (Eq. 20); ``raw [b, h, n]``, ``positions [b, n]`` (-1: -inf)."""
        with torch.no_grad():
            log_gamma = self.decay().float()
        prio = raw.float() - positions[:, None, :].float() * log_gamma[None, :, None]
        return torch.where(positions[:, None, :] >= 0, prio, torch.full_like(prio, float("-inf")))

    def _prefill_scores(self, step: ForwardStep, key_states, value_states) -> torch.Tensor:
        """Raw scores of the prompt tokens ``[b, h, q]`` (provisional for the last ``delay`` tokens)."""
        with torch.no_grad():
            if not self.stateful:
                return self.scorer(key_states, value_states)
            valid = step.positions >= 0
            # left padding only: once a row's real tokens start they continue to the end
            check(bool((valid.long().cummax(dim=1).values == valid.long()).all()),
                  "KVpop cache with a stateful scorer: padding must be on the left of each row")
            raw, self.scorer_state = self.scorer.prefill(key_states, value_states, valid=valid)
            return raw

    def plan(self, step: ForwardStep, key_states: torch.Tensor, value_states: torch.Tensor) -> SlotPlan:
        if self.slot_priority is None:
            b, h = key_states.shape[:2]
            self.slot_priority = torch.full((b, h, self.capacity), float("-inf"), device=key_states.device)
        if step.query_length == 1:
            return self._plan_decode(step, key_states, value_states)
        if self.seen == 0:
            prio = self._static(self._prefill_scores(step, key_states, value_states), step.positions)
            self._new_priority = prio
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
        # token t is visible to queries [t, end_t) (sinks: end = q); a token still visible after the row's last real
        # query is kept in the cache
        end = eviction_positions(ranks, cutoffs, s, w).long()
        end = torch.where(end >= n_real, torch.full_like(end, NEVER), end)
        survives = (end == NEVER) & (t < n_real)
        slot = torch.where(survives, survives.long().cumsum(dim=2) - 1, torch.full_like(end, -1))
        # back from sequence order to columns
        inverse = torch.argsort(order, dim=1)[:, None, :].expand(b, h, q)
        new_end = torch.gather(end, 2, inverse)
        write_slots = torch.gather(slot, 2, inverse)
        valid = pos[:, None, :] >= 0
        return SlotPlan(write_slots=torch.where(valid, write_slots, -1), old_end=None,  # the buffer is empty
                        new_end=torch.where(valid, new_end, torch.zeros_like(new_end)))

    def _score_decode(self, p: torch.Tensor, key_states, value_states) -> torch.Tensor:
        """Priority of the new token ``[b, h, 1]``; with the delayed readout also re-score token ``p - w`` (it
        leaves the window now) in its slot. ``p [b]`` positions of the new token."""
        if not self.stateful:
            with torch.no_grad():
                raw = self.scorer(key_states, value_states)
            return self._static(raw, p[:, None])
        k_t, v_t = key_states[:, :, 0], value_states[:, :, 0]
        if self.delay == 0:
            with torch.no_grad():
                score, self.scorer_state = self.scorer.step(k_t, v_t, None, None, self.scorer_state)
            return self._static(score[..., None], p[:, None])
        u = p - self.delay  # [b]
        slot_pos = self.slot_positions.long()
        has_u = (slot_pos == u[:, None, None]) & (u[:, None, None] >= 0)  # [b, h, C]
        slot_u = has_u.long().argmax(dim=2)  # [b, h]
        idx = slot_u[..., None, None].expand(-1, -1, 1, self.keys.shape[-1])
        k_u = torch.gather(self.keys, 2, idx)[:, :, 0]
        v_u = torch.gather(self.values, 2, slot_u[..., None, None].expand(-1, -1, 1, self.values.shape[-1]))[:, :, 0]
        with torch.no_grad():
            score_u, self.scorer_state = self.scorer.step(k_t, v_t, k_u, v_u, self.scorer_state)
        new_u = self._static(score_u[..., None], u[:, None])[..., 0]  # [b, h]
        found = has_u.any(dim=2)
        current = torch.gather(self.slot_priority, 2, slot_u[..., None])[..., 0]
        self.slot_priority.scatter_(2, slot_u[..., None], torch.where(found, new_u, current)[..., None])
        return torch.full_like(k_t[..., :1], float("-inf"))  # the new token is scored w tokens from now

    def _plan_decode(self, step: ForwardStep, key_states, value_states) -> SlotPlan:
        """One new token at position p: token p - w joins the eligible set; evict the worst of k + 1."""
        s, w, k = self.config.sinks, self.config.window, self.config.topk
        p = step.positions[:, 0]  # [b]
        check(not step.has_padding, "KVpop cache: a padding token while decoding is not supported")
        self._new_priority = self._score_decode(p, key_states, value_states)
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
        """K/V buffers, slot positions, slot priorities and the scorer memory."""
        extra = 0 if self.slot_priority is None else self.slot_priority.numel() * self.slot_priority.element_size()
        return super().allocated_bytes() + extra + self.allocated_state_bytes()

    def allocated_state_bytes(self) -> int:
        """Bytes of the scorer memory (mLSTM C, n, m) this layer holds for the batch."""
        if self.scorer_state is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self.scorer_state)

    def reset(self) -> None:
        super().reset()
        self.slot_priority = None
        self.scorer_state = None


class KVpopCache(CompactCache):
    """A KVpop cache for every decoder layer; ``scorers[i]`` and ``decays[i]`` are layer ``i``'s learned modules."""

    def __init__(self, config: KVpopConfig, scorers: list[nn.Module], decays: list[nn.Module]):
        check(len(scorers) == len(decays) and len(scorers) > 0,
              f"{len(scorers)} scorers and {len(decays)} decays: expected one of each per decoder layer")
        super().__init__([KVpopLayer(config, sc, dc) for sc, dc in zip(scorers, decays)])
        self.config = config
