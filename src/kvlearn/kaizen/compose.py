"""KV-Kaizen composed with token eviction: an eviction policy over a Kaizen configuration's stores, one total factor.

Issue #11 item 7; the paper's section 3.4 ("as we do not drop tokens, an evictor can run on the same cache and the
cache reduction factors due to each approach multiply"). The registry methods ``kaizen+snapkv``
(:mod:`kvlearn.kaizen.compose_snapkv`) and ``kaizen+kvpop`` (:mod:`kvlearn.kaizen.compose_kvpop`) share this module.

**The cache.** A :class:`~kvlearn.kaizen.cache.KaizenCache` whose own layers run the eviction's policy instead of
:class:`~kvlearn.cache.KeepAllPolicy`: layer ``l`` keeps ``budget`` tokens per KV head in its chosen representation
(a packed ``b``-bit store, or the model dtype at 16 bits). A sharing layer (a :class:`~kvlearn.cache.BorrowedLayer`)
reads its anchor's evicted store under the anchor's visibility, so **the anchor's policy decides for its group**:
SnapKV from the anchor's own attention (the sharing layers' queries do not vote), KVpop from the anchor's scorer.

**One total factor.** The user gives the total factor ``F`` (``--target``) and the eviction's budget ``B`` tokens
per KV head at the context ``n`` (``--budget``, ``--context``): the kept fraction is ``B / n``, the eviction factor
``ρ_evict = n / B``, and the representation target is

    ρ_rep* = F / ρ_evict = F · B / n,

which must lie in the feasible range ``[ρ_min, ρ_max]`` of the axes (:func:`~kvlearn.kaizen.actions.feasible_range`),
i.e. ``F ∈ [ρ_min · n / B, ρ_max · n / B]``; anything else is a one-line error naming that range
(:func:`check_total`). The configuration is chosen at ``ρ_rep*``: by the model's trained selector when it carries one
(a ``kvlearn kaizen-train`` folder loaded with :func:`kvlearn.load`), which reads each prompt and is conditioned on
``ρ_rep*`` (:func:`kvlearn.kaizen.apply.select`: its argmax, or its most likely configuration within the budget), so
the selector's budget counts the eviction's kept fraction; otherwise ``kaizen_static``'s least compressed uniform
configuration meeting it (:func:`~kvlearn.kaizen.fixed.static_config`). The realised factor
is ``ρ_rep · n / B`` with ``ρ_rep = C_ref / C`` of the chosen configuration (no metadata), so it is ``>= F``
(:meth:`KaizenCache.realised_factor`); ``n / B`` is nominal: a prompt shorter than ``n`` keeps a larger fraction.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from ..cache import Policy
from ..errors import KVLearnError, check, check_int
from ..kvpop.apply import KV_CONFIGURATION_KEY
from .actions import Backbone, KaizenConfig, check_axes, check_budget, feasible_range
from .apply import recorded_config, select
from .cache import KaizenCache
from .fixed import static_config
from .prompt import one_choice, prompt_rows
from .selector import SELECTOR_NAME, KaizenSelector

__all__ = ["ComposedConfig", "total_range", "check_total", "composed_choice", "composed_cache", "model_chooser",
           "composed_prompt_choices", "composed_prompt_cache", "refuse_make_cache", "need_budget_and_target"]


@dataclass(frozen=True)
class ComposedConfig:
    """A Kaizen configuration under eviction at one total factor.

    Attributes:
        target: the total cache reduction factor ``F`` (representation x eviction), e.g. 32.0.
        eviction: the eviction method's config, with ``budget`` (tokens kept per KV head) and ``context`` (the
            context ``n`` the kept fraction ``budget / n`` refers to): a ``SnapKVConfig`` or a ``KVpopConfig``.
        axes: the Kaizen axes (``None``: every axis of the backbone; precision and depth on GQA).
    """

    target: float
    eviction: object
    axes: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        t = self.target
        ok = isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t > 0
        check(ok, f"target={t!r} is invalid: expected the total compression factor > 0 (representation x eviction)")
        budget, context = getattr(self.eviction, "budget", None), getattr(self.eviction, "context", None)
        check(isinstance(budget, int), f"eviction={self.eviction!r} is invalid: expected an eviction config with a "
                                       "token budget (SnapKVConfig, KVpopConfig)")
        check(context is not None, f"context is missing: the total factor counts the kept fraction budget / context "
                                   f"(budget={budget}), so give the context (--context)")
        if self.axes is not None:
            object.__setattr__(self, "axes", tuple(self.axes))

    @property
    def budget(self) -> int:
        """Tokens kept per KV head."""
        return int(self.eviction.budget)

    @property
    def sinks(self) -> int:
        return int(self.eviction.sinks)

    @property
    def context(self) -> int:
        return int(self.eviction.context)

    @property
    def eviction_factor(self) -> float:
        """``ρ_evict = context / budget`` (the inverse of the kept fraction)."""
        return self.context / self.budget

    @property
    def representation_target(self) -> float:
        """``ρ_rep* = target / ρ_evict = target · budget / context``."""
        return self.target / self.eviction_factor


def total_range(config: ComposedConfig, backbone: Backbone) -> tuple[float, float]:
    """``(F_min, F_max)``: the feasible total factors, the axes' ``feasible_range`` times ``ρ_evict``."""
    lo, hi = feasible_range(backbone, config.axes, metadata=False)
    return lo * config.eviction_factor, hi * config.eviction_factor


def check_total(config: ComposedConfig, backbone: Backbone) -> float:
    """One-line error unless ``config.target`` is feasible (module docstring); returns ``ρ_rep*``."""
    axes = check_axes(config.axes, backbone)
    lo, hi = total_range(config, backbone)
    rep, ef = config.representation_target, config.eviction_factor
    check(lo * (1 - 1e-9) <= config.target <= hi * (1 + 1e-9),
          f"total target {config.target:g}x is infeasible with budget {config.budget} of context {config.context} "
          f"(eviction {ef:.4g}x): the representation would need {rep:.4g}x, outside "
          f"[{lo / ef:.4g}x, {hi / ef:.4g}x] for axes {'+'.join(axes)}; expected a total target in "
          f"[{lo:.4g}x, {hi:.4g}x]")
    return rep


def composed_choice(config: ComposedConfig, backbone: Backbone) -> KaizenConfig:
    """The Kaizen configuration at ``ρ_rep*`` (the static choice: the least compressed uniform configuration meeting
    it, :func:`~kvlearn.kaizen.fixed.static_config`)."""
    check(not backbone.is_mla, "eviction over a Kaizen cache is built for GQA backbones only: an MLA (converted) "
                               "model stores one latent per token, and the eviction policies score per KV head")
    return static_config(backbone, check_total(config, backbone), config.axes)


def composed_cache(config: ComposedConfig, choice: KaizenConfig, policy_of: Callable[[int], Policy]) -> KaizenCache:
    """The :class:`KaizenCache` of ``choice`` with ``policy_of(l)`` (the eviction policy of own layer ``l``) under
    every own layer; ``cache.target`` = the total target, ``cache.eviction_factor`` = ``context / budget``."""
    cache = KaizenCache(choice, capacity=config.budget, policy_factory=policy_of)
    cache.target = float(config.target)
    cache.eviction_factor = config.eviction_factor
    return cache


def model_chooser(config: ComposedConfig, model) -> tuple[str, KaizenConfig | None]:
    """Who chooses the composed configuration of ``model``, checked now (one-line errors, before any prompt): ``("selector",
    None)`` for a trained selector on the model (``ρ_rep*`` must lie in what its axes and sharing mask reach),
    ``("trained", choice)`` for a KVpop student retrofitted under a configuration (``kvlearn retrofit --kv-bits``,
    recorded as ``model.config.kvpop_kv_configuration``; it must compress at least ``ρ_rep*``), else ``("static",
    choice)`` (:func:`composed_choice`). The total target must be feasible on the backbone (:func:`check_total`) and
    the backbone GQA in every case."""
    backbone = Backbone.from_config(model.config)
    static = composed_choice(config, backbone)  # GQA only, total target feasible for the axes (one-line errors)
    rep, ef = config.representation_target, config.eviction_factor
    if isinstance(getattr(model, SELECTOR_NAME, None), KaizenSelector):
        recorded = recorded_config(model)
        if recorded is not None:
            try:
                check_budget(rep, backbone, recorded.axes, share_layers=recorded.share_layers)
            except KVLearnError as err:
                raise KVLearnError(f"total target {config.target:g}x over eviction {ef:.4g}x asks the model's selector "
                                   f"for {rep:.4g}x: {err}") from None
        return "selector", None
    trained = getattr(model.config, KV_CONFIGURATION_KEY, None)
    if trained is not None:
        choice = KaizenConfig.parse(backbone, trained)
        got = choice.compression(metadata=False)
        check(got >= rep * (1 - 1e-9),
              f"total target {config.target:g}x over eviction {ef:.4g}x needs {rep:.4g}x from the representation, but "
              f"this model was retrofitted under {trained!r} ({got:.4g}x): ask for at most {got * ef:.4g}x, or keep "
              "fewer tokens")
        return "trained", choice
    return "static", static


def composed_prompt_choices(config: ComposedConfig, model, input_ids, attention_mask) -> list[KaizenConfig]:
    """Registry ``prompt_choices``: one configuration per row of ``input_ids [batch, seq]`` at ``ρ_rep*``
    (:func:`model_chooser`): the model's selector's choice for the row's real tokens alone
    (:func:`kvlearn.kaizen.apply.select` conditioned on ``ρ_rep*``), else the configuration a KVpop student was
    retrofitted under, else :func:`composed_choice`, the same for every row."""
    rows = prompt_rows(input_ids, attention_mask)
    who, choice = model_chooser(config, model)
    if who == "selector":
        return [select(model, row, None, config.representation_target)[0][0] for row in rows]
    return [choice] * len(rows)


def composed_prompt_cache(make_choice_cache, config: ComposedConfig, model, input_ids, attention_mask,
                          max_new_tokens: int) -> KaizenCache:
    """Registry ``make_prompt_cache``: ``make_choice_cache`` of the one choice of ``input_ids [batch, seq]``
    (the budget, not the prompt, sizes the stores; ``max_new_tokens`` is checked all the same)."""
    check_int("max_new_tokens", max_new_tokens, 0)
    choice = one_choice(composed_prompt_choices(config, model, input_ids, attention_mask))
    return make_choice_cache(config, model, choice, config.budget)


def refuse_make_cache(config, model):
    raise KVLearnError("this composed KV-Kaizen method picks its configuration for the prompt: use "
                       "make_prompt_cache(config, model, input_ids, attention_mask, max_new_tokens)")


def need_budget_and_target(name: str, budget, target) -> None:
    """One-line error unless both the token budget and the total target are given."""
    check(budget is not None and target is not None,
          f"method {name!r} needs --budget (tokens kept per KV head, the eviction) and --target (the total "
          f"compression factor, representation x eviction); got budget={budget!r}, target={target!r}")
