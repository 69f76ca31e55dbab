"""Registry entry ``kaizen_static``: the least compressed uniform precision/sharing configuration meeting the target
(:mod:`kvlearn.kaizen.fixed`)."""

from .fixed import FixedConfig, apply, config_from_budget, fixed_prompt_cache, make_cache, static_config

CONFIG = FixedConfig
SUMMARY = ("KV-Kaizen static baseline: one uniform configuration (b bits, an anchor every g layers) meeting "
           "--target, the same for every prompt; every token kept")
PROTOCOLS = ("bounded",)
TOKEN_BUDGET = False


def make_prompt_cache(config: FixedConfig, model, input_ids, attention_mask, max_new_tokens: int):
    return fixed_prompt_cache(lambda bb, c: static_config(bb, c.target, c.axes), config, model, input_ids,
                              attention_mask, max_new_tokens)


__all__ = ["CONFIG", "SUMMARY", "PROTOCOLS", "TOKEN_BUDGET", "apply", "make_cache", "make_prompt_cache",
           "config_from_budget"]
