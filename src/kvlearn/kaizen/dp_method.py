"""Registry entry ``kaizen_dp``: KV-Kaizen's offline dynamic-programming search baseline (the paper's appendix E.2,
:mod:`kvlearn.kaizen.dp_search`), the same contract as ``kaizen_static`` and ``kaizen_random``
(:mod:`kvlearn.kaizen.fixed`): one prompt-independent configuration at ``--target``, every token kept.

The configuration depends on the model, so it is searched in ``apply`` (the harness calls it once per evaluation,
before any prompt): the per-layer loss increases are measured on ``examples`` testbed training rows of ``length``
tokens (calibration batch ``seed``), the DP picks the configuration at ``target``, and the result is recorded on the
model as ``model.config.kaizen_dp`` (a small JSON-able dict: the settings, the chosen action indices and their
names, the predicted loss increase, the base loss and the measured table). Deterministic for a given model and
settings; nothing is kept outside the model. ``make_prompt_cache`` builds the :class:`KaizenCache` of the recorded
configuration (one-line error when ``apply`` was not run with the same settings).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import check, check_int
from ..testbed.tasks import MAX_LENGTH, MIN_LENGTH
from .actions import Backbone, KaizenConfig, check_axes, check_budget
from .cache import KaizenCache
from .fixed import FixedConfig, make_cache
from .prompt import choice_cache, one_choice, prompt_capacity, prompt_rows

CONFIG_KEY = "kaizen_dp"  # the entry of model.config recording the search


@dataclass(frozen=True)
class DPConfig(FixedConfig):
    """``target``: the compression factor ``ρ*`` (default 4.0); ``axes``: the enabled axes (``None``: every axis of
    the backbone); ``seed``: the calibration batch; ``examples`` rows of ``length`` tokens; ``batch_size``: rows
    per calibration forward. ``target``, ``axes`` and ``seed`` are validated as in :class:`FixedConfig`."""

    examples: int = 8
    length: int = 1024
    batch_size: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("examples", self.examples, 1, 4096)
        check_int("length", self.length, MIN_LENGTH, MAX_LENGTH, hint=" (testbed calibration rows)")
        check_int("batch_size", self.batch_size, 1)

    def settings(self) -> dict:
        """The fields the search depends on, as recorded in ``model.config.kaizen_dp``."""
        return {"target": float(self.target), "axes": None if self.axes is None else list(self.axes),
                "seed": self.seed, "examples": self.examples, "length": self.length}


CONFIG = DPConfig
SUMMARY = ("KV-Kaizen DP-search baseline: per-layer loss increases on testbed calibration rows, then an exact DP "
           "picks the per-layer precision/sharing configuration of least predicted loss meeting --target, the same "
           "for every prompt; every token kept")
PROTOCOLS = ("bounded", "context")
TOKEN_BUDGET = False


def apply(model, config: DPConfig):
    """Search the configuration of ``model`` at ``config.target`` and record it (module docstring); returns the
    model, attached (:func:`kvlearn.kaizen.sharing.attach`)."""
    from .dp_search import search

    check(isinstance(config, DPConfig), f"config={config!r} is not a DPConfig")
    backbone = Backbone.from_model(model)
    axes = check_axes(config.axes, backbone)
    check_budget(config.target, backbone, axes)  # before any forward
    limit = getattr(model.config, "max_position_embeddings", None)
    check(limit is None or config.length <= limit, f"length={config.length} exceeds the model's "
                                                   f"max_position_embeddings={limit}: expected length <= {limit}")
    found = search(model, config.target, axes, config.examples, config.length, config.seed, config.batch_size)
    space = found.table.actions
    setattr(model.config, CONFIG_KEY, {
        **config.settings(),
        "indices": list(found.choice.indices),
        "actions": [str(space[i]) for i in found.choice.indices],
        "predicted_increase": found.choice.loss,
        "bits_per_token": found.choice.bits,
        "base_loss": found.table.base_loss,
        "increases": [[x if math.isfinite(x) else None for x in row] for row in found.table.increases.tolist()],
    })
    return model


def recorded_config(model, config: DPConfig) -> KaizenConfig:
    """The :class:`KaizenConfig` that ``apply(model, config)`` recorded; one-line error if none was, or with other
    settings."""
    saved = getattr(model.config, CONFIG_KEY, None)
    check(isinstance(saved, dict) and {k: saved.get(k) for k in config.settings()} == config.settings(),
          "method 'kaizen_dp' has no search recorded on this model for these settings: run apply(model, config) "
          "(the harness's prepare) first")
    return KaizenConfig.from_indices(Backbone.from_config(model.config), saved["indices"], config.axes)


def prompt_choices(config: DPConfig, model, input_ids, attention_mask) -> list[KaizenConfig]:
    """Registry ``prompt_choices``: the recorded configuration for every row of ``input_ids [batch, seq]`` (the
    search does not read the prompt)."""
    return [recorded_config(model, config)] * len(prompt_rows(input_ids, attention_mask))


def make_choice_cache(config: DPConfig, model, choice: KaizenConfig, capacity: int) -> KaizenCache:
    """Registry ``make_choice_cache``: the :class:`KaizenCache` of ``choice``, recording ``config.target``."""
    return choice_cache(choice, capacity, config.target)


def make_prompt_cache(config: DPConfig, model, input_ids, attention_mask, max_new_tokens: int) -> KaizenCache:
    """The :class:`KaizenCache` of the recorded configuration for one batch ``input_ids [batch, seq]`` (capacity:
    the prompt width + ``max_new_tokens``)."""
    capacity = prompt_capacity(input_ids.shape[1], max_new_tokens)  # checked before the choice is computed
    choice = one_choice(prompt_choices(config, model, input_ids, attention_mask))
    return make_choice_cache(config, model, choice, capacity)


def config_from_budget(budget=None, sinks: int = 4, context: int | None = None, target: float | None = None,
                       **extra) -> DPConfig:
    check(budget is None, f"method 'kaizen_dp' keeps every token: it takes --target (a compression factor), not "
                          f"--budget (got budget={budget!r})")
    return DPConfig(**({"target": target} if target is not None else {}), **extra)


__all__ = ["CONFIG", "CONFIG_KEY", "SUMMARY", "PROTOCOLS", "TOKEN_BUDGET", "DPConfig", "apply", "make_cache",
           "make_prompt_cache", "prompt_choices", "make_choice_cache", "config_from_budget", "recorded_config"]
