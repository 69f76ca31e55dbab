"""Registry entry ``kaizen_static``: the least compressed uniform precision/sharing configuration meeting the target
(:mod:`kvlearn.kaizen.fixed`), or one given configuration (``StaticConfig.configuration``, ``kvlearn eval
--configuration``), e.g. the one a KVpop student was retrofitted under."""

from dataclasses import dataclass

from ..errors import check
from .actions import Backbone, KaizenConfig
from .fixed import (FixedConfig, fixed_choice_cache, fixed_prompt_cache, fixed_prompt_choices, make_cache,
                    static_config)
from .fixed import apply as fixed_apply
from .fixed import config_from_budget as fixed_config_from_budget

SUMMARY = ("KV-Kaizen static baseline: one uniform configuration (b bits, an anchor every g layers) meeting "
           "--target, or the one --configuration gives, the same for every prompt; every token kept")
PROTOCOLS = ("bounded", "context")
TOKEN_BUDGET = False


@dataclass(frozen=True)
class StaticConfig(FixedConfig):
    """:class:`FixedConfig` plus ``configuration``: one explicit per-layer configuration in
    :meth:`KaizenConfig.parse`'s form (``"b4 b4 share b4"``) instead of the uniform choice; ``target`` may then be
    ``None`` (the configuration's own compression) and otherwise must not exceed it."""

    configuration: str | None = None

    def check_target(self) -> None:
        check(self.configuration is None or (isinstance(self.configuration, str) and self.configuration.split()),
              f"configuration={self.configuration!r} is invalid: expected per-layer actions like 'b4 b4 share b2'")
        if self.target is None:
            check(self.configuration is not None,
                  "target=None is invalid without a configuration: expected a compression factor > 0")
        else:
            super().check_target()


CONFIG = StaticConfig


def given_config(backbone: Backbone, config: StaticConfig) -> KaizenConfig:
    """``config.configuration`` parsed on ``backbone`` (one-line errors: a bad word, another number of layers, layer 0
    sharing), checked to compress (no metadata) at least ``config.target`` when one is given."""
    choice = KaizenConfig.parse(backbone, config.configuration)
    got = choice.compression(metadata=False)
    if config.target is not None:
        check(got >= config.target * (1 - 1e-9), f"configuration {config.configuration!r} compresses {got:.4g}x, below "
                                                 f"target={config.target:g}: expected a target <= its compression (or none)")
    return choice


def configuration(backbone, config: StaticConfig):
    """The one configuration of every prompt: ``config.configuration`` when given (:func:`given_config`), else
    :func:`kvlearn.kaizen.fixed.static_config`."""
    if config.configuration is not None:
        return given_config(backbone, config)
    return static_config(backbone, config.target, config.axes)


def apply(model, config: StaticConfig):
    """Check the configuration (or the target) on the model's backbone (one line), then attach the Kaizen attention."""
    if config.configuration is None:
        return fixed_apply(model, config)
    from . import sharing

    given_config(Backbone.from_config(model.config), config)
    return sharing.attach(model)


make_choice_cache = fixed_choice_cache  # records the configuration's own compression when no target is given


def prompt_choices(config: StaticConfig, model, input_ids, attention_mask):
    return fixed_prompt_choices(configuration, config, model, input_ids, attention_mask)


def make_prompt_cache(config: StaticConfig, model, input_ids, attention_mask, max_new_tokens: int):
    return fixed_prompt_cache(configuration, config, model, input_ids, attention_mask, max_new_tokens)


def config_from_budget(budget=None, sinks: int = 4, context: int | None = None, target: float | None = None,
                       configuration: str | None = None, **extra) -> StaticConfig:
    """:func:`kvlearn.kaizen.fixed.config_from_budget`'s checks, as a :class:`StaticConfig`: without ``target``, a given
    ``configuration`` sets its own (``target=None``), otherwise the default 4.0."""
    base = fixed_config_from_budget(budget, sinks, context, target, **extra)  # the budget check, the default target
    return StaticConfig(target=None if target is None and configuration is not None else base.target,
                        axes=base.axes, seed=base.seed, configuration=configuration)


__all__ = ["CONFIG", "SUMMARY", "PROTOCOLS", "TOKEN_BUDGET", "apply", "make_cache", "make_prompt_cache",
           "prompt_choices", "make_choice_cache", "config_from_budget", "StaticConfig"]
