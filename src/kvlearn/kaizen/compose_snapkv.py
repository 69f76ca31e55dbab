"""Registry entry ``kaizen+snapkv``: SnapKV's prompt selection over a KV-Kaizen configuration's stores, at one
total factor ``--target`` = representation x ``context / budget`` (:mod:`kvlearn.kaizen.compose`).

Each own layer runs :class:`~kvlearn.eviction.snapkv.SnapKVPolicy` over its packed (or 16-bit) store and keeps
``budget`` tokens per KV head (``budget + 1`` slots: SnapKV evicts after attending); a sharing layer reads its
anchor's evicted store, so the anchor's attention selects for the group. Protocol: ``context`` (SnapKV's).
"""

from __future__ import annotations

from ..eviction.snapkv import SnapKVConfig, SnapKVPolicy
from . import sharing
from .cache import KaizenCache
from .compose import (ComposedConfig, composed_cache, composed_prompt_cache, composed_prompt_choices, model_chooser,
                      need_budget_and_target, refuse_make_cache)

NAME = "kaizen+snapkv"
CONFIG = ComposedConfig
SUMMARY = ("KV-Kaizen configuration (kaizen_static's choice at --target x budget/context) under SnapKV's eviction: "
           "--budget tokens per KV head in each layer's precision, sharing layers follow their anchor; --target is "
           "the total factor")
PROTOCOLS = ("context",)
TOKEN_BUDGET = False  # its budget is a total compression factor; the token budget comes with it
make_cache = refuse_make_cache
prompt_choices = composed_prompt_choices


def apply(model, config: ComposedConfig):
    """Check the total target on the model's backbone (one line) and attach the Kaizen attention."""
    model_chooser(config, model)  # the total target, and what the model's selector or recorded configuration gives
    return sharing.attach(model)


def make_choice_cache(config: ComposedConfig, model, choice, capacity: int) -> KaizenCache:
    """The composed cache of ``choice`` (``capacity`` is ignored: the budget sizes the stores)."""
    return composed_cache(config, choice, lambda l: SnapKVPolicy(config.eviction))


def make_prompt_cache(config: ComposedConfig, model, input_ids, attention_mask, max_new_tokens: int) -> KaizenCache:
    return composed_prompt_cache(make_choice_cache, config, model, input_ids, attention_mask, max_new_tokens)


def config_from_budget(budget=None, sinks: int = 4, context: int | None = None, target: float | None = None,
                       axes=None, **extra) -> ComposedConfig:
    """``budget`` tokens per KV head and ``sinks`` for SnapKV (``extra``: its ``window``, ``kernel_size``,
    ``pooling``), ``target`` the total factor, ``axes`` the Kaizen axes."""
    need_budget_and_target(NAME, budget, target)
    return ComposedConfig(target, SnapKVConfig(budget=budget, sinks=sinks, context=context, **extra), axes)


__all__ = ["CONFIG", "SUMMARY", "PROTOCOLS", "TOKEN_BUDGET", "apply", "make_cache", "make_prompt_cache",
           "prompt_choices", "make_choice_cache", "config_from_budget"]
