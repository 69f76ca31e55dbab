"""Registry entry ``kaizen_random``: a seeded random per-layer configuration meeting the target
(:meth:`kvlearn.kaizen.actions.KaizenConfig.random`, :mod:`kvlearn.kaizen.fixed`)."""

from .actions import KaizenConfig
from .fixed import (FixedConfig, apply, config_from_budget, fixed_choice_cache, fixed_prompt_cache,
                    fixed_prompt_choices, make_cache)

CONFIG = FixedConfig
SUMMARY = ("KV-Kaizen random baseline: a seeded random per-layer precision/sharing configuration meeting --target, "
           "the same for every prompt; every token kept")
PROTOCOLS = ("bounded", "context")
TOKEN_BUDGET = False


def configuration(backbone, config: FixedConfig):
    """The one configuration of every prompt (:meth:`KaizenConfig.random`, seeded)."""
    return KaizenConfig.random(backbone, config.target, config.axes, config.seed)


make_choice_cache = fixed_choice_cache


def prompt_choices(config: FixedConfig, model, input_ids, attention_mask):
    return fixed_prompt_choices(configuration, config, model, input_ids, attention_mask)


def make_prompt_cache(config: FixedConfig, model, input_ids, attention_mask, max_new_tokens: int):
    return fixed_prompt_cache(configuration, config, model, input_ids, attention_mask, max_new_tokens)


__all__ = ["CONFIG", "SUMMARY", "PROTOCOLS", "TOKEN_BUDGET", "apply", "make_cache", "make_prompt_cache",
           "prompt_choices", "make_choice_cache", "config_from_budget"]
