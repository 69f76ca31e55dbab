"""Registry entry ``kaizen_static``: the least compressed uniform precision/sharing configuration meeting the target,
or one given configuration (``FixedConfig.configuration``, ``kvlearn eval --configuration``) (:mod:`kvlearn.kaizen.fixed`)."""

from .fixed import (FixedConfig, apply, config_from_budget, fixed_choice_cache, fixed_prompt_cache,
                    fixed_prompt_choices, given_config, make_cache, static_config)

CONFIG = FixedConfig
SUMMARY = ("KV-Kaizen static baseline: one uniform configuration (b bits, an anchor every g layers) meeting "
           "--target, the same for every prompt; every token kept")
PROTOCOLS = ("bounded", "context")
TOKEN_BUDGET = False


def configuration(backbone, config: FixedConfig):
    """The one configuration of every prompt: ``config.configuration`` when given
    (:func:`kvlearn.kaizen.fixed.given_config`), else :func:`kvlearn.kaizen.fixed.static_config`."""
    if config.configuration is not None:
        return given_config(backbone, config)
    return static_config(backbone, config.target, config.axes)


make_choice_cache = fixed_choice_cache


def prompt_choices(config: FixedConfig, model, input_ids, attention_mask):
    return fixed_prompt_choices(configuration, config, model, input_ids, attention_mask)


def make_prompt_cache(config: FixedConfig, model, input_ids, attention_mask, max_new_tokens: int):
    return fixed_prompt_cache(configuration, config, model, input_ids, attention_mask, max_new_tokens)


__all__ = ["CONFIG", "SUMMARY", "PROTOCOLS", "TOKEN_BUDGET", "apply", "make_cache", "make_prompt_cache",
           "prompt_choices", "make_choice_cache", "config_from_budget"]
