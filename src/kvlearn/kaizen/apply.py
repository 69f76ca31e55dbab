"""The ``kaizen`` method: a model with a KV-Kaizen selector, its caches, and its checkpoints.

:func:`apply_kaizen` puts a :class:`~kvlearn.kaizen.selector.KaizenSelector` on the model as the submodule
``kaizen_selector`` (float32; state-dict keys ``kaizen_selector.*``, so optimizers and ``save_pretrained`` see
it), records the :class:`KaizenMethodConfig` as ``model.config.kaizen`` (a dict, written into ``config.json``) and
attaches the ``kvlearn_kaizen`` attention (:func:`kvlearn.kaizen.sharing.attach`). :func:`kvlearn.load` re-applies
it and loads the selector's weights (:func:`load_kaizen`).

Registry entry (:mod:`kvlearn.methods`): ``CONFIG``, ``SUMMARY``, ``PROTOCOLS``, ``apply``, ``config_from_budget``
(a target compression factor, not a token budget: every token is kept) and the per-prompt contract of
:mod:`kvlearn.kaizen.prompt`: ``prompt_choices`` runs the selector once on each prompt alone (argmax of its logits at
the target), ``make_choice_cache`` builds the :class:`~kvlearn.kaizen.cache.KaizenCache` of one chosen
configuration, which holds for the whole generation, and ``make_prompt_cache`` does both for rows that agree. The
harness groups a batch's rows by their choice and runs each group through its own cache.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass

import torch

from ..errors import KVLearnError, check, check_int
from .actions import Backbone, check_axes, check_budget, check_share_layers
from .cache import KaizenCache
from .prompt import choice_cache, one_choice, prompt_capacity, prompt_rows
from .selector import SELECTOR_NAME, KaizenSelector

__all__ = ["KaizenMethodConfig", "apply_kaizen", "selector_of", "load_kaizen", "load_selector_onto", "select", "prompt_choices",
           "make_choice_cache", "make_prompt_cache", "config_from_budget", "CONFIG_KEY"]

CONFIG_KEY = "kaizen"  # the entry of model.config


@dataclass(frozen=True)
class KaizenMethodConfig:
    """The ``kaizen`` method.

    Attributes:
        target: the target compression ``ρ*`` the selector is conditioned on at evaluation (``None``: the first of
            ``train_targets``, the budget it was trained for).
        axes: the enabled compression axes (``None``: precision and depth on a GQA backbone).
        width, heads, blocks, max_positions, init_margin, target_head: the selector (:class:`KaizenSelector`;
            ``target_head`` False in records written before it existed).
        train_targets: the targets it was trained on (recorded by the trainer; informational).
        share_layers: the layers whose selector head may choose ``share`` (``None``: every layer but 0, and in
            records written before the field existed; :func:`~kvlearn.kaizen.actions.check_share_layers`).
    """

    target: float | None = None
    axes: tuple[str, ...] | None = None
    width: int = 64
    heads: int = 2
    blocks: int = 2
    max_positions: int = 8192
    init_margin: float = 2.0
    train_targets: tuple[float, ...] = (4.0,)
    target_head: bool = False
    share_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.axes is not None:
            object.__setattr__(self, "axes", tuple(self.axes))
        object.__setattr__(self, "train_targets", tuple(float(t) for t in self.train_targets))
        if self.share_layers is not None:
            check(isinstance(self.share_layers, (list, tuple)),
                  f"share_layers={self.share_layers!r} is invalid: expected a list of layer indices >= 1, or None")
            object.__setattr__(self, "share_layers", tuple(self.share_layers))
        check(self.target is None or (isinstance(self.target, (int, float)) and not isinstance(self.target, bool)
                                      and math.isfinite(self.target) and self.target > 0),
              f"target={self.target!r} is invalid: expected a compression factor > 0 (e.g. 4.0)")
        check(len(self.train_targets) > 0 and all(math.isfinite(t) and t > 0 for t in self.train_targets),
              f"train_targets={self.train_targets!r} is invalid: expected compression factors > 0")
        check_int("width", self.width, 1)
        check_int("heads", self.heads, 1)
        check_int("blocks", self.blocks, 1)
        check_int("max_positions", self.max_positions, 1)
        check(isinstance(self.target_head, bool), f"target_head={self.target_head!r} is invalid: expected True or False")

    @property
    def resolved_target(self) -> float:
        return float(self.target if self.target is not None else self.train_targets[0])

    def check_targets(self, backbone: Backbone) -> None:
        """One-line error unless every target is in the feasible range of the axes on ``backbone``."""
        check_axes(self.axes, backbone)
        check_share_layers(self.share_layers, backbone)
        for t in (self.resolved_target, *self.train_targets):
            check_budget(t, backbone, self.axes, share_layers=self.share_layers)


def selector_of(model) -> KaizenSelector:
    sel = getattr(model, SELECTOR_NAME, None)
    check(isinstance(sel, KaizenSelector),
          "this model has no KV-Kaizen selector: apply_kaizen(model, config) or load a model trained with kaizen-train")
    return sel


def recorded_config(model) -> KaizenMethodConfig | None:
    saved = getattr(getattr(model, "config", None), CONFIG_KEY, None)
    if saved is None:
        return None
    try:
        return KaizenMethodConfig(**saved)
    except TypeError as err:
        raise KVLearnError(f"model.config.{CONFIG_KEY} is not a KaizenMethodConfig ({err})") from None


def apply_kaizen(model, config: KaizenMethodConfig):
    """Make ``model`` a KV-Kaizen model (in place; module docstring). A model that already has a selector (a loaded
    checkpoint) keeps it: only ``target`` may differ from the recorded config."""
    from . import sharing

    check(isinstance(config, KaizenMethodConfig), f"config={config!r} is not a KaizenMethodConfig")
    backbone = Backbone.from_config(model.config)
    config.check_targets(backbone)
    existing = getattr(model, SELECTOR_NAME, None)
    if isinstance(existing, KaizenSelector):
        recorded = recorded_config(model)
        if recorded is not None:
            mine = {k: v for k, v in asdict(config).items() if k not in ("target", "train_targets")}
            theirs = {k: v for k, v in asdict(recorded).items() if k not in ("target", "train_targets")}
            check(mine == theirs, f"the model's selector was built with {theirs}, not {mine}: only target may differ")
            config = KaizenMethodConfig(**{**asdict(recorded), "target": config.target})
    else:
        device = next(model.parameters()).device
        sel = KaizenSelector(model.config.vocab_size, backbone, config.axes, config.width, config.heads,
                             config.blocks, config.max_positions, config.init_margin,
                             target_head=config.target_head, share_layers=config.share_layers).to(device)
        setattr(model, SELECTOR_NAME, sel)
    saved = asdict(config)
    saved["axes"] = None if config.axes is None else list(config.axes)
    saved["train_targets"] = list(config.train_targets)
    saved["share_layers"] = None if config.share_layers is None else list(config.share_layers)
    setattr(model.config, CONFIG_KEY, saved)
    sharing.attach(model)
    return model


def load_kaizen(model, path) -> object:
    """Re-apply the recorded :class:`KaizenMethodConfig` of checkpoint ``path`` to ``model`` (loaded by
    :func:`kvlearn.hf.load_model`) and load its selector weights. One-line errors for a missing or mismatching
    selector."""
    from ..hf import load_added_weights

    path = os.fspath(path)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        saved = json.load(f).get(CONFIG_KEY)
    check(isinstance(saved, dict), f"checkpoint {path!r} has no {CONFIG_KEY!r} entry in config.json")
    try:
        config = KaizenMethodConfig(**saved)
    except TypeError as err:
        raise KVLearnError(f"checkpoint {path!r}: its {CONFIG_KEY!r} entry is not a KaizenMethodConfig ({err})") from None
    if isinstance(getattr(model, SELECTOR_NAME, None), KaizenSelector):
        delattr(model, SELECTOR_NAME)
    apply_kaizen(model, config)
    load_added_weights(selector_of(model), path, lambda k: True, "kaizen checkpoint",
                       "the selector's weights do not fit its recorded config", prefix=SELECTOR_NAME + ".")
    return model


def load_selector_onto(model, path) -> object:
    """The trained selector of checkpoint ``path`` on another backbone ``model`` (in place; e.g. the original teacher
    the selector was never trained with: the comparison table's ``untrained_backbone`` row). Only the selector's
    weights and recorded config come from ``path``; every backbone weight stays ``model``'s. One-line error unless
    the two backbones have the same shape (:class:`Backbone` and vocabulary)."""
    from ..hf import read_model_config

    path = os.fspath(path)
    theirs, mine = read_model_config(path), model.config
    check(Backbone.from_config(theirs) == Backbone.from_config(mine) and theirs.vocab_size == mine.vocab_size,
          f"selector checkpoint {path!r} was trained on a backbone of {Backbone.from_config(theirs)} and vocabulary "
          f"{theirs.vocab_size}, this model is {Backbone.from_config(mine)} with vocabulary {mine.vocab_size}: "
          "expected the same shapes")
    return load_kaizen(model, path)


@torch.no_grad()
def select(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, target=None):
    """``(configs, logits)``: the evaluation choice (the argmax, or the most likely configuration within the budget
    when the argmax lies over it: :meth:`KaizenSelector.choose_within_budget`) for each prompt of ``input_ids [batch, seq]`` at
    ``target`` (``None``: the recorded target), a :class:`KaizenConfig` per row and the logits ``[batch, layers,
    actions]``."""
    sel = selector_of(model)
    if target is None:
        recorded = recorded_config(model)
        target = recorded.resolved_target if recorded is not None else 1.0
    logits = sel(input_ids, attention_mask, target)
    return sel.configs(sel.choose_within_budget(logits, target)), logits


# ----------------------------------------------------------------------------------------------------------------
# the method registry entry (kvlearn.methods)

CONFIG = KaizenMethodConfig
SUMMARY = ("KV-Kaizen: a learned selector picks per prompt each layer's precision (2/4/8/16 bits) or sharing of an "
           "earlier layer's cache, at a target compression (--target); every token kept")
PROTOCOLS = ("bounded", "context")
TOKEN_BUDGET = False  # its budget is a compression factor, not tokens


def apply(model, config: KaizenMethodConfig):
    """Registry ``apply``: the model must carry a trained selector (``kvlearn.load`` of a kaizen-train folder);
    an untrained one is built when it has none (the least compressed choice everywhere). A loaded model keeps its
    recorded selector settings; ``config.target`` (when given) replaces the recorded target."""
    recorded = recorded_config(model)
    if recorded is not None and isinstance(getattr(model, SELECTOR_NAME, None), KaizenSelector):
        target = config.target if config.target is not None else recorded.target
        config = KaizenMethodConfig(**{**asdict(recorded), "target": target})
    return apply_kaizen(model, config)


def make_cache(config: KaizenMethodConfig, model):
    raise KVLearnError("method 'kaizen' chooses its configuration per prompt: use make_prompt_cache(config, model, "
                       "input_ids, attention_mask, max_new_tokens)")


def resolved_target(config: KaizenMethodConfig, model) -> float:
    """The target the selector is conditioned on: ``config.target``, else the model's recorded one, else 1.0."""
    if config.target is not None:
        return float(config.target)
    recorded = recorded_config(model)
    return recorded.resolved_target if recorded is not None else 1.0


def prompt_choices(config: KaizenMethodConfig, model, input_ids: torch.Tensor,
                   attention_mask: torch.Tensor | None) -> list:
    """One :class:`~kvlearn.kaizen.actions.KaizenConfig` per row of ``input_ids [batch, seq]``: the selector's
    argmax on the row's real tokens alone (``[1, n_i]``, :func:`kvlearn.kaizen.prompt.prompt_rows`), so a row
    chooses the same in any batch, layout or protocol."""
    target = resolved_target(config, model)
    return [select(model, row, None, target)[0][0] for row in prompt_rows(input_ids, attention_mask)]


def make_choice_cache(config: KaizenMethodConfig, model, choice, capacity: int) -> KaizenCache:
    """The :class:`KaizenCache` of one chosen configuration ``choice`` with ``capacity`` slots per own layer."""
    return choice_cache(choice, capacity, resolved_target(config, model))


def make_prompt_cache(config: KaizenMethodConfig, model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                      max_new_tokens: int) -> KaizenCache:
    """The :class:`KaizenCache` of the selector's choice for the prompts ``input_ids [batch, seq]`` (capacity: the
    prompt width + ``max_new_tokens`` + 1). Every row must choose the same configuration (a single prompt always
    does); a one-line error otherwise."""
    capacity = prompt_capacity(input_ids.shape[1], max_new_tokens)  # checked before the choice is computed
    choice = one_choice(prompt_choices(config, model, input_ids, attention_mask))
    return make_choice_cache(config, model, choice, capacity)


def config_from_budget(budget=None, sinks: int = 4, context: int | None = None, target: float | None = None,
                       **extra) -> KaizenMethodConfig:
    """The harness's config: ``target`` (a compression factor, e.g. 4.0; ``None``: the trained one). ``budget`` in
    tokens does not apply (every token is kept) and is refused."""
    check(budget is None, f"method 'kaizen' keeps every token: it takes --target (a compression factor), not "
                          f"--budget (got budget={budget!r})")
    return KaizenMethodConfig(target=target, **extra)
