"""Per-prompt KV-Kaizen caches for evaluation: read each prompt alone, group rows by their choice, one cache a group.

A prompt-dependent method (``kaizen``, and the prompt-independent ``kaizen_static``/``kaizen_random`` under the same
contract) exposes, in its registry module (:mod:`kvlearn.methods`):

- ``prompt_choices(config, model, input_ids [batch, seq], attention_mask [batch, seq] | None) -> list[KaizenConfig]``:
  one configuration per row, chosen from the row's real tokens alone (:func:`prompt_rows`), so a row chooses the
  same whatever the padding, the protocol's layout or the other rows of its batch;
- ``make_choice_cache(config, model, choice: KaizenConfig, capacity) -> KaizenCache``: the cache of one
  configuration (``capacity`` slots per own layer), with ``cache.target`` the target it was chosen for;
- ``make_prompt_cache(config, model, input_ids, attention_mask, max_new_tokens)``: both at once for rows that all
  choose the same configuration (:func:`one_choice`; a one-line error otherwise).

The harness (:mod:`kvlearn.eval.accuracy`) groups a batch's rows by their choice (``group_by_choice`` there) and runs
each group as its own left-padded sub-batch through one cache; a left-padded batch through a :class:`KaizenCache`
generates what its rows generate alone, so the batched evaluation equals evaluating each prompt alone.
"""

from __future__ import annotations

import torch

from ..errors import check, check_int
from .actions import KaizenConfig
from .cache import KaizenCache

__all__ = ["prompt_rows", "one_choice", "choice_cache", "prompt_capacity"]


def prompt_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """Each row's real tokens alone, in order: a list of ``[1, n_i]`` int64 (``n_i`` = the row's mask sum; the whole
    row when ``attention_mask`` is ``None``) from ``input_ids, attention_mask: [batch, seq]``."""
    check(input_ids.dim() == 2, f"input_ids of shape {tuple(input_ids.shape)} are invalid: expected [batch, seq]")
    if attention_mask is None:
        return [row[None] for row in input_ids]
    check(attention_mask.shape == input_ids.shape,
          f"attention_mask of shape {tuple(attention_mask.shape)} does not match input_ids {tuple(input_ids.shape)}")
    rows = [ids[m.bool()][None] for ids, m in zip(input_ids, attention_mask)]
    check(all(r.shape[1] > 0 for r in rows), "every prompt needs at least one non-pad token")
    return rows


def one_choice(choices: list[KaizenConfig]) -> KaizenConfig:
    """The configuration every row chose; a one-line error when rows differ (group them first:
    ``kvlearn.eval.accuracy.group_by_choice``)."""
    check(len(choices) > 0, "no prompt given: expected at least one row")
    differ = [i for i, c in enumerate(choices) if c != choices[0]]
    check(not differ, f"rows 0 and {differ[0] if differ else 0} choose different KV-Kaizen configurations: one cache "
                      "holds one configuration, so evaluate them in groups (kvlearn.eval.accuracy.group_by_choice)")
    return choices[0]


def prompt_capacity(width: int, max_new_tokens: int) -> int:
    """Slots a batch of ``width`` prompt columns needs to generate ``max_new_tokens``: every column (padding
    included: slot = the row's real position, and transformers counts columns seen) plus the new tokens, plus one.
    A negative ``max_new_tokens`` is a one-line error (it would size the cache below the prompt's need)."""
    check_int("max_new_tokens", max_new_tokens, 0)
    return width + max_new_tokens + 1


def choice_cache(choice: KaizenConfig, capacity: int, target: float) -> KaizenCache:
    """A :class:`KaizenCache` of ``choice`` with ``capacity`` slots, recording ``target`` (``cache.target``: the
    harness reports it beside the realised factor)."""
    cache = KaizenCache(choice, capacity=capacity)
    cache.target = float(target)
    return cache
