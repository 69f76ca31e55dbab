"""Registry entry ``kaizen_random``: a seeded random per-layer configuration meeting the target
(:meth:`kvlearn.kaizen.actions.KaizenConfig.random`, :mod:`kvlearn.kaizen.fixed`)."""

from .actions import KaizenConfig
from .fixed import FixedConfig, apply, config_from_budget, fixed_prompt_cache, make_cache

CONFIG = FixedConfig
SUMMARY = ("KV-Kaizen random baseline: a seeded random per-layer precision/sharing configuration meeting --target, "
           "the same for every prompt; every token kept")
PROTOCOLS = ("bounded",)
TOKEN_BUDGET = False


def make_prompt_cache(config: FixedConfig, model, input_ids, attention_mask, max_new_tokens: int):
    return fixed_prompt_cache(lambda bb, c: KaizenConfig.random(bb, c.target, c.axes, c.seed), config, model,
                              input_ids, attention_mask, max_new_tokens)


__all__ = ["CONFIG", "SUMMARY", "PROTOCOLS", "TOKEN_BUDGET", "apply", "make_cache", "make_prompt_cache",
           "config_from_budget"]
