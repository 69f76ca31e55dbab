"""Registry entry ``kaizen+kvpop``: KVpop's learned retention over a KV-Kaizen configuration's stores, at one
total factor ``--target`` = representation x ``context / budget`` (:mod:`kvlearn.kaizen.compose`).

Each own layer runs a :class:`~kvlearn.kvpop.cache.KVpopPolicy` (that layer's scorer and decay, added by
:func:`~kvlearn.kvpop.apply.apply_kvpop` or loaded with a KVpop checkpoint) over its packed (or 16-bit) store and keeps
``budget = sinks + window + topk`` tokens per KV head; a sharing layer reads its anchor's evicted store, so the
anchor's scorer decides for the group (the sharing layers' scorers are unused). The scorer reads the keys and values
the layer receives (full precision), except the delayed mLSTM readout, which reads every token in its stored form:
the window's tokens back from the store, a prefill chunk's own tokens through ``Store.round_trip`` (so the chunk size
changes nothing; the retrofit under ``--kv-bits`` trains the readout on the same form). A trained KVpop checkpoint
fixes the scorer fields (``TRAINED_FIELDS``, read from ``config.json["kvpop"]``). Protocols: ``bounded`` and
``context``.
"""

from __future__ import annotations

from ..kvpop.apply import TRAINED_FIELDS, apply_kvpop, make_kvpop_cache
from ..kvpop.apply import config_from_budget as kvpop_config_from_budget
from . import sharing
from .cache import KaizenCache
from .compose import (ComposedConfig, composed_cache, composed_prompt_cache, composed_prompt_choices, model_chooser,
                      need_budget_and_target, refuse_make_cache)

NAME = "kaizen+kvpop"
CONFIG = ComposedConfig
CONFIG_KEY = "kvpop"  # a KVpop checkpoint's recorded config (kvlearn.methods.trained_options)
SUMMARY = ("KV-Kaizen configuration (kaizen_static's choice at --target x budget/context) under KVpop's learned "
           "eviction: --budget tokens per KV head in each layer's precision, sharing layers follow their anchor; "
           "--target is the total factor")
PROTOCOLS = ("bounded", "context")
TOKEN_BUDGET = False
make_cache = refuse_make_cache
prompt_choices = composed_prompt_choices

__all__ = ["CONFIG", "CONFIG_KEY", "SUMMARY", "PROTOCOLS", "TOKEN_BUDGET", "TRAINED_FIELDS", "apply", "make_cache",
           "make_prompt_cache", "prompt_choices", "make_choice_cache", "config_from_budget"]


def apply(model, config: ComposedConfig):
    """Check the total target (one line), add (or keep) the KVpop modules, then attach the Kaizen attention."""
    model_chooser(config, model)  # the total target, and what the model's selector or recorded configuration gives
    apply_kvpop(model, config.eviction)
    return sharing.attach(model)


def make_choice_cache(config: ComposedConfig, model, choice, capacity: int) -> KaizenCache:
    """The composed cache of ``choice``: own layer ``l`` takes the KVpop policy of the model's layer-``l`` scorer
    and decay (checked against ``config.eviction`` by :func:`~kvlearn.kvpop.apply.make_kvpop_cache`); ``capacity``
    is ignored (the budget sizes the stores)."""
    policies = [layer.policy for layer in make_kvpop_cache(model, config.eviction).layers]  # fresh, never used
    return composed_cache(config, choice, lambda l: policies[l])


def make_prompt_cache(config: ComposedConfig, model, input_ids, attention_mask, max_new_tokens: int) -> KaizenCache:
    return composed_prompt_cache(make_choice_cache, config, model, input_ids, attention_mask, max_new_tokens)


def config_from_budget(budget=None, sinks: int = 4, context: int | None = None, target: float | None = None,
                       axes=None, **extra) -> ComposedConfig:
    """``budget``, ``sinks`` and ``extra`` (``window``, ``scorer``, ...) for KVpop
    (:func:`kvlearn.kvpop.apply.config_from_budget`), ``target`` the total factor, ``axes`` the Kaizen axes."""
    need_budget_and_target(NAME, budget, target)
    return ComposedConfig(target, kvpop_config_from_budget(budget, sinks, context, **extra), axes)
