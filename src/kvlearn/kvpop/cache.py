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
linear, MLP and mLSTM scorers (delayed or immediate readout), prefilled in one forward or in chunks into a non-empty
cache (the running top-k of the scored base, :class:`kvlearn.cache.ScoredPolicy`), then one token per forward (what
``generate`` does). A chunk continues the mLSTM memory from the policy's state
(:meth:`~kvlearn.kvpop.scorers.MLSTMScorer.continue_prefill`); with the delayed readout the held window tokens whose
``u + w`` falls into the chunk get their final scores there, in their slots, before the chunk is ranked. Padding may
sit anywhere in a row (each row's real tokens are scored as the row alone); a padding row of a one-token forward
keeps its memory.

This is the scored-eviction base with KVpop's static priority as the score; the priorities are the layer's declared
slot state ``"score"`` and the mLSTM memory is per-sequence state of the policy, so both live in the cache.
"""

from __future__ import annotations

import torch
from torch import nn

from ..cache import CompactCache, CompactLayer, ForwardStep, ScoredPolicy
from ..config import KVpopConfig
from ..errors import check
from .modules import has_kvpop, kvpop_modules


class KVpopPolicy(ScoredPolicy):
    """KVpop retention as a scored policy: ``capacity = sinks + window + topk`` slots per (batch row, KV head).

    Args:
        config: the budget (``sinks``, ``window``, ``topk``) and ``decay_step`` (must be 1).
        scorer: ``module(key, value) -> raw scores [batch, kv_heads, q]`` (float32), or a stateful mLSTM scorer.
        decay: ``module() -> log_gamma [kv_heads]`` (float32, negative).
    """

    def __init__(self, config: KVpopConfig, scorer: nn.Module, decay: nn.Module):
        check(config.decay_step == 1, f"decay_step={config.decay_step} is not supported by the cache: expected 1 (static priorities)")
        self.stateful = bool(getattr(scorer, "stateful", False))
        self.delay = int(getattr(scorer, "readout_delay", 0))
        check(self.delay in (0, config.window),
              f"scorer readout delay {self.delay} is invalid: expected 0 (immediate) or the window {config.window}")
        super().__init__(config.budget, config.sinks, config.window)
        self.config, self.scorer, self.decay = config, scorer, decay
        self.scorer_state = None  # the stateful scorer's memory after the last token (per sequence)

    def _static(self, raw: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Static priority ``raw - t log(gamma)`` (Eq. 20); ``raw [b, h, n]``, ``positions [b, n]`` (-1: -inf)."""
        with torch.no_grad():
            log_gamma = self.decay().float()
        prio = raw.float() - positions[:, None, :].float() * log_gamma[None, :, None]
        return torch.where(positions[:, None, :] >= 0, prio, torch.full_like(prio, float("-inf")))

    def score(self, layer, step: ForwardStep, key_states, value_states) -> torch.Tensor:
        """Static priorities of a multi-token forward's tokens ``[b, h, q]`` (provisional for the last ``delay``
        real tokens of a delayed stateful scorer).

        A stateful scorer continues its memory from the tokens seen (chunked prefill; padding anywhere in a row).
        With the delayed readout the held tokens ``u`` whose ``u + w`` arrives in this forward (the last ``w``
        tokens seen, all in the protected window) get their final score here, read from the memory after
        ``u + w`` with their key/value from the store; their slot priorities are updated before the running top-k
        ranks the buffer and the chunk."""
        with torch.no_grad():
            if not self.stateful:
                return self._static(self.scorer(key_states, value_states), step.positions)
            valid = step.positions >= 0
            past_key = past_value = None
            if self.delay > 0 and layer.seen > 0:
                past_key, past_value, want, match = self._window_tokens(layer, step, valid)
            # the delayed readout reads every token in its stored form: the past ones from the store, the chunk's
            # as the store will hold them (so prefill chunking changes nothing; mlstm_scores, read_key)
            read = layer.store.round_trip(key_states, value_states) if self.delay > 0 else (None, None)
            raw, past_raw, self.scorer_state = self.scorer.continue_prefill(
                key_states, value_states, valid, self.scorer_state, past_key, past_value, *read)
            if past_key is not None:  # re-score the window tokens in their slots (each slot holds one position)
                new = self._static(past_raw, want)  # [b, h, w]
                hit = match.any(dim=2)  # [b, h, C]
                value = torch.where(match, new[..., None], torch.zeros_like(new[..., None])).sum(dim=2)
                stored = layer.slot_state["score"]
                stored.copy_(torch.where(hit, value, stored))
            return self._static(raw, step.positions)

    def _window_tokens(self, layer, step: ForwardStep, valid: torch.Tensor):
        """Key/value ``[b, h, w, d]`` of the ``w`` real tokens before this forward, oldest first (zeros where a
        row has fewer), read from the store; with their positions ``[b, w]`` (negative: none) and the slot match
        ``[b, h, w, C]``. They are the protected window of the last query, so the cache holds all of them."""
        w = self.delay
        before = step.real_after - valid.sum(dim=1)  # [b] real tokens seen before this forward
        want = before[:, None] - w + torch.arange(w, device=before.device)  # [b, w]
        pos = layer.slot_positions.long()  # [b, h, C]
        match = (pos[:, :, None, :] == want[:, None, :, None]) & (want >= 0)[:, None, :, None]  # [b, h, w, C]
        slot = match.long().argmax(dim=3)  # [b, h, w]
        found = match.any(dim=3)[..., None]
        keys, values = layer.store.read()
        k = torch.gather(keys, 2, slot[..., None].expand(-1, -1, -1, keys.shape[-1]))
        v = torch.gather(values, 2, slot[..., None].expand(-1, -1, -1, values.shape[-1]))
        return torch.where(found, k, torch.zeros_like(k)), torch.where(found, v, torch.zeros_like(v)), want, match

    def decode_score(self, layer, step: ForwardStep, key_states, value_states) -> torch.Tensor:
        """Priority of the new token ``[b, h, 1]``; with the delayed readout also re-score token ``p - w`` (it
        leaves the window now) in its slot. A padding row (``p = -1``, e.g. a one-token prefill chunk of a padded
        batch) leaves its scorer memory and slots untouched."""
        p = step.positions[:, 0]  # [b]
        if not self.stateful:
            with torch.no_grad():
                raw = self.scorer(key_states, value_states)
            return self._static(raw, p[:, None])
        k_t, v_t = key_states[:, :, 0], value_states[:, :, 0]
        old = self.scorer_state
        if self.delay == 0:
            with torch.no_grad():
                score, new_state = self.scorer.step(k_t, v_t, None, None, old)
            self.scorer_state = self._keep_padding_rows(old, new_state, p)
            return self._static(score[..., None], p[:, None])
        u = p - self.delay  # [b]
        slot_pos = layer.slot_positions.long()
        has_u = (slot_pos == u[:, None, None]) & (u[:, None, None] >= 0) & (p[:, None, None] >= 0)  # [b, h, C]
        slot_u = has_u.long().argmax(dim=2)  # [b, h]
        keys, values = layer.store.read()
        k_u = torch.gather(keys, 2, slot_u[..., None, None].expand(-1, -1, 1, keys.shape[-1]))[:, :, 0]
        v_u = torch.gather(values, 2, slot_u[..., None, None].expand(-1, -1, 1, values.shape[-1]))[:, :, 0]
        with torch.no_grad():
            score_u, new_state = self.scorer.step(k_t, v_t, k_u, v_u, old)
        self.scorer_state = self._keep_padding_rows(old, new_state, p)
        new_u = self._static(score_u[..., None], u[:, None])[..., 0]  # [b, h]
        stored = layer.slot_state["score"]
        current = torch.gather(stored, 2, slot_u[..., None])[..., 0]
        stored.scatter_(2, slot_u[..., None], torch.where(has_u.any(dim=2), new_u, current)[..., None])
        return torch.full_like(k_t[..., :1], float("-inf"))  # the new token is scored w tokens from now

    def _keep_padding_rows(self, old, new, p: torch.Tensor):
        """The scorer state after a decode step: ``new`` for real rows, ``old`` (empty if None) for padding rows
        (tensor ops only: no device sync)."""
        if old is None:
            old = self.scorer.init_state(p.shape[0], p.device)
        real = p >= 0
        return type(new)(*(torch.where(real.view((-1,) + (1,) * (n.dim() - 1)), n, o) for n, o in zip(new, old)))

    def state_bytes(self) -> int:
        """Bytes of the scorer memory (mLSTM C, n, m) held for the batch."""
        if self.scorer_state is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self.scorer_state)

    def reset(self) -> None:
        self.scorer_state = None


class KVpopLayer(CompactLayer):
    """One layer of the KVpop cache (a :class:`KVpopPolicy` over a plain store)."""

    def __init__(self, config: KVpopConfig, scorer: nn.Module, decay: nn.Module):
        super().__init__(KVpopPolicy(config, scorer, decay))
        self.config = config

    @property
    def scorer_state(self):
        return self.policy.scorer_state

    @property
    def slot_priority(self) -> torch.Tensor | None:
        """``[batch, kv_heads, capacity]`` float32 static priority of each held token."""
        return self.slot_state.get("score")

    def allocated_state_bytes(self) -> int:
        """Bytes of the scorer memory (mLSTM C, n, m) this layer holds for the batch."""
        return self.policy.state_bytes()


class KVpopCache(CompactCache):
    """A KVpop cache for every decoder layer; ``scorers[i]`` and ``decays[i]`` are layer ``i``'s learned modules."""

    def __init__(self, config: KVpopConfig, scorers: list[nn.Module], decays: list[nn.Module]):
        check(len(scorers) == len(decays) and len(scorers) > 0,
              f"{len(scorers)} scorers and {len(decays)} decays: expected one of each per decoder layer")
        super().__init__([KVpopLayer(config, sc, dc) for sc, dc in zip(scorers, decays)])
        self.config = config

    def check_model(self, num_layers: int, model=None) -> None:
        """Also, for a model with KVpop modules (:func:`kvlearn.kvpop.apply.apply_kvpop`): one-line error unless
        this cache was made from that model's own scorers and decays (a cache serves one batch of one model)."""
        super().check_model(num_layers, model)
        if model is None:
            return
        if not has_kvpop(model):
            return
        scorers, decays = kvpop_modules(model)
        mine = [(layer.policy.scorer, layer.policy.decay) for layer in self.layers]
        check(all(a is s and b is d for (a, b), s, d in zip(mine, scorers, decays)),
              "this KVpop cache was made from another model's scorers: make one cache per model and batch "
              "(kvlearn.kvpop.apply.make_kvpop_cache(model))")
