"""Prompt-independent KV-Kaizen configurations at a target compression: the baselines ``kaizen_static`` and
``kaizen_random`` (registry modules :mod:`kvlearn.kaizen.static_method` and :mod:`kvlearn.kaizen.random_method`).

- **static** (:func:`static_config`): the least compressed *uniform* configuration meeting the target, among every
  precision ``b`` in {16, 8, 4, 2} and every sharing group ``g`` in 1 .. L (``KaizenConfig.evenly_shared(g, b)``: an
  anchor at ``b`` bits every ``g`` layers, the others sharing it; ``g = 1`` is plain uniform precision). Ties go to
  the smaller group (less sharing), then the higher precision. With ``axes=("precision",)`` only ``g = 1``. On an
  MLA backbone with the rank axis the anchors also take one latent width ``d`` in {r, r/2, r/4, r/8} (ties: the
  wider latent).
- **random** (:func:`KaizenConfig.random`): a seeded random configuration meeting the target with little slack.

Both keep every token, need no trained modules (``apply``: :func:`kvlearn.kaizen.sharing.attach`), and build a
:class:`~kvlearn.kaizen.cache.KaizenCache` sized to the prompt under the per-prompt contract of
:mod:`kvlearn.kaizen.prompt` (every row chooses the same configuration, so a batch is one group), so the harness
reports their realised ``factor`` and ``target`` like ``kaizen``'s. Protocols: ``bounded`` and ``context`` (every
token kept: the two attend the same stored keys and values).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import KVLearnError, check, check_int
from ..ops.quant import BITS
from .actions import Backbone, KaizenConfig, LayerAction, check_axes, check_budget
from .cache import KaizenCache
from .prompt import choice_cache, one_choice, prompt_capacity, prompt_rows


@dataclass(frozen=True)
class FixedConfig:
    """``target``: the compression factor (default 4.0); ``axes``: the enabled axes (``None``: precision + depth);
    ``seed``: the random configuration's seed (random only)."""

    target: float = 4.0
    axes: tuple[str, ...] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        self.check_target()
        if self.axes is not None:
            object.__setattr__(self, "axes", tuple(self.axes))
        check_int("seed", self.seed, 0)

    def check_target(self) -> None:
        ok = isinstance(self.target, (int, float)) and not isinstance(self.target, bool) and math.isfinite(self.target)
        check(ok and self.target > 0, f"target={self.target!r} is invalid: expected a compression factor > 0")


def static_config(backbone: Backbone, target: float, axes=None) -> KaizenConfig:
    """The least compressed uniform configuration with compression (no metadata) ``>= target`` (module docstring)."""
    axes = check_axes(axes, backbone)
    target = check_budget(target, backbone, axes)
    bits = BITS[::-1] if "precision" in axes else (16,)
    groups = range(1, backbone.num_layers + 1) if "depth" in axes else (1,)
    ranks = (None,) + tuple(reversed(backbone.widths[:-1])) if "rank" in axes else (None,)
    best = None
    for g in groups:
        for b in bits:
            for d in ranks:
                cfg = KaizenConfig(backbone, tuple(LayerAction(bits=b, rank=d) if l % g == 0 else LayerAction.shared()
                                                   for l in range(backbone.num_layers)))
                rho = cfg.compression(metadata=False)
                if rho >= target * (1 - 1e-9) and (best is None or rho < best[0] - 1e-12):
                    best = (rho, cfg)
    check(best is not None, f"no uniform configuration reaches compression {target} on this backbone")
    return best[1]


def fixed_prompt_choices(config_fn, config: FixedConfig, model, input_ids, attention_mask) -> list[KaizenConfig]:
    """``config_fn(backbone, config)`` for every row of ``input_ids [batch, seq]`` (the same configuration: it does
    not read the prompt)."""
    kc = config_fn(Backbone.from_config(model.config), config)
    return [kc] * len(prompt_rows(input_ids, attention_mask))


def fixed_choice_cache(config: FixedConfig, model, choice: KaizenConfig, capacity: int) -> KaizenCache:
    """Registry ``make_choice_cache``: the :class:`KaizenCache` of ``choice``, recording ``config.target``; without
    one (a static configuration given alone, ``kaizen_static``'s ``configuration``), the configuration's own
    compression."""
    target = choice.compression(metadata=False) if config.target is None else config.target
    return choice_cache(choice, capacity, target)


def fixed_prompt_cache(config_fn, config: FixedConfig, model, input_ids, attention_mask, max_new_tokens: int):
    """Registry ``make_prompt_cache``: the cache of ``config_fn``'s configuration sized to the prompts
    ``input_ids [batch, seq]`` plus ``max_new_tokens``."""
    capacity = prompt_capacity(input_ids.shape[1], max_new_tokens)  # checked before the choice is computed
    choice = one_choice(fixed_prompt_choices(config_fn, config, model, input_ids, attention_mask))
    return fixed_choice_cache(config, model, choice, capacity)


def apply(model, config: FixedConfig):
    from . import sharing

    bb = Backbone.from_config(model.config)
    check_budget(config.target, bb, config.axes)
    return sharing.attach(model)


def make_cache(config, model):
    raise KVLearnError("this KV-Kaizen method sizes its cache to the prompt: use make_prompt_cache(config, model, "
                       "input_ids, attention_mask, max_new_tokens)")


def config_from_budget(budget=None, sinks: int = 4, context: int | None = None, target: float | None = None,
                       **extra) -> FixedConfig:
    check(budget is None, f"this KV-Kaizen method keeps every token: it takes --target (a compression factor), not "
                          f"--budget (got budget={budget!r})")
    return FixedConfig(**({"target": target} if target is not None else {}), **extra)
