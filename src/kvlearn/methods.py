"""The method registry: ``name -> Method``, the one place that knows which cache methods exist.

Every evaluation path (``kvlearn eval``, ``kvlearn demo``, :mod:`kvlearn.eval.accuracy`, the benchmarks and the
contract test matrix) resolves a method here, so a method registered once is evaluated everywhere.

- ``dense``: transformers' ``DynamicCache`` (every token kept; the reference).
- the eviction methods :data:`EVICTION_METHODS`: each is a module ``kvlearn.eviction.<name>`` exposing ``CONFIG``
  (a frozen dataclass config taking at least ``budget`` and ``sinks``, validated on creation), ``SUMMARY`` (one
  line), ``PROTOCOLS`` (a tuple from :data:`PROTOCOLS`) and ``make_cache(config, model_config) -> Cache``.
- the trained methods :data:`LEARNED_METHODS` (``kvlearn retrofit --method NAME``): ``streaming_plus``
  (:mod:`kvlearn.eviction.streaming_plus`: the streaming rule, model distilled under it, no modules) and ``dms``
  (:mod:`kvlearn.dms.apply`: learned per-layer eviction gates) besides KVpop.
- ``kvpop`` (:mod:`kvlearn.kvpop.apply`): the same contract plus ``apply(model, config)``, which adds the learned
  modules to the model, and ``config_from_budget(budget, sinks, context, **extra)`` (its config has no ``budget``
  field). A method with ``apply`` needs the model's modules for its caches, so its ``make_cache`` receives the
  model instead of the model config: callers use :meth:`Method.prepare` and :meth:`Method.new_cache`, which pass
  the right one.
- ``kaizen`` (:mod:`kvlearn.kaizen.apply`): a learned method whose budget is a compression factor, not tokens
  (``TOKEN_BUDGET = False``: ``make_config(name, target=...)`` without ``budget``), and whose cache depends on the
  prompt (:mod:`kvlearn.kaizen.prompt`): ``prompt_choices(config, model, input_ids, attention_mask)`` (one choice
  per row, its selector run once on each prompt alone), ``make_choice_cache(config, model, choice, capacity)`` and
  ``make_prompt_cache(config, model, input_ids, attention_mask, max_new_tokens)`` (rows that choose alike); the
  harness groups a batch's rows by their choice and runs each group through its own cache. Its
  prompt-independent baselines ``kaizen_static`` and ``kaizen_random`` (:mod:`kvlearn.kaizen.fixed`) and
  ``kaizen_dp`` (:mod:`kvlearn.kaizen.dp_method`: the offline DP search, calibrated in ``apply``) follow the same
  contract, and so do ``kaizen+snapkv`` and ``kaizen+kvpop`` (:mod:`kvlearn.kaizen.compose`: eviction over a Kaizen
  configuration; ``budget`` in tokens and ``target`` the total factor, representation x ``context / budget``), and
  ``kivi`` (:mod:`kvlearn.kaizen.kivi_method`: post-hoc KIVI quantization at ``16 / target`` bits, every token kept).

Modules are imported lazily, on :func:`get_method`: a method whose module is not in this checkout fails with a
one-line :class:`~kvlearn.errors.KVLearnError` when it is asked for, never when this module is imported.

Protocols (see :mod:`kvlearn.eval.protocols`): ``bounded`` (the whole prompt goes through the bounded cache) and
``context`` (everything before the final question is prefilled densely and compressed once, kvpress's setting).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import Any, Callable

from .errors import KVLearnError, check

PROTOCOLS: tuple[str, ...] = ("bounded", "context")
EVICTION_METHODS: tuple[str, ...] = ("streaming", "tova", "h2o", "snapkv", "pyramidkv", "knorm", "random")
LEARNED_METHODS: tuple[str, ...] = ("kvpop", "streaming_plus", "dms", "kaizen", "kaizen_static", "kaizen_random",
                                     "kaizen_dp", "kaizen+snapkv", "kaizen+kvpop", "kivi")
MODULES: dict[str, str] = {**{n: f"kvlearn.eviction.{n}" for n in EVICTION_METHODS}, "kvpop": "kvlearn.kvpop.apply",
                           "streaming_plus": "kvlearn.eviction.streaming_plus", "dms": "kvlearn.dms.apply",
                           "kaizen": "kvlearn.kaizen.apply", "kaizen_static": "kvlearn.kaizen.static_method",
                           "kaizen_random": "kvlearn.kaizen.random_method", "kaizen_dp": "kvlearn.kaizen.dp_method",
                           "kaizen+snapkv": "kvlearn.kaizen.compose_snapkv",
                           "kaizen+kvpop": "kvlearn.kaizen.compose_kvpop", "kivi": "kvlearn.kaizen.kivi_method"}


@dataclass(frozen=True)
class Method:
    """One registered cache method.

    Attributes:
        name: the registry name (``kvlearn eval --method NAME``).
        summary: one line saying what the method keeps.
        config_cls: the dataclass config (validated on creation).
        make_cache: ``make_cache(config, model_config) -> transformers.Cache``, a fresh cache for one batch; for a
            method with ``apply``, ``make_cache(config, model)`` (its caches use the model's modules).
        apply: ``apply(model, config) -> model`` that adds the method's modules and makes the model run with its
            caches; ``None`` means :func:`kvlearn.hf.attach` (the shared attention function, no added modules).
        protocols: the evaluation protocols the method defines, a subset of :data:`PROTOCOLS`.
        config_from_budget: ``(budget=, sinks=, context=, **extra) -> config`` for a config class that does not
            take ``budget`` itself (KVpop's ``sinks + window + topk``); ``None``: ``config_cls(budget=, sinks=, ...)``.
        make_prompt_cache: ``(config, model, input_ids [batch, seq], attention_mask, max_new_tokens) -> Cache`` for
            a method that configures its cache from the prompt (``kaizen``; the rows must choose alike); ``None``:
            :meth:`new_cache`. Such a method also has the two below.
        prompt_choices: ``(config, model, input_ids [batch, seq], attention_mask [batch, seq]) -> list`` of one
            choice per row (compared with ``==``), each made from the row's real tokens alone.
        make_choice_cache: ``(config, model, choice, capacity) -> Cache``: the cache of one choice, ``capacity``
            tokens (prompt columns + generated + 1).
        token_budget: whether the budget is in tokens (``False``: ``kaizen``, a compression ``target``).
        trained_fields: config fields a trained checkpoint fixes (module ``TRAINED_FIELDS``, recorded under
            ``config.json[config_key]``): its evaluation takes them from the checkpoint (:func:`trained_options`).
        config_key: the ``config.json`` entry where the method records its config (module ``CONFIG_KEY``).

    Use :meth:`prepare` and :meth:`new_cache` rather than ``apply``/``make_cache`` directly.
    """

    name: str
    summary: str
    config_cls: type
    make_cache: Callable[[Any, Any], Any]
    apply: Callable[[Any, Any], Any] | None = None
    protocols: tuple[str, ...] = PROTOCOLS
    config_from_budget: Callable[..., Any] | None = None
    make_prompt_cache: Callable[..., Any] | None = None
    prompt_choices: Callable[..., Any] | None = None
    make_choice_cache: Callable[..., Any] | None = None
    token_budget: bool = True
    trained_fields: tuple[str, ...] = ()
    config_key: str | None = None

    def prepare(self, model, config):
        """Make ``model`` run with this method's caches (``apply(model, config)``, or :func:`kvlearn.hf.attach`)."""
        if self.apply is not None:
            return self.apply(model, config)
        from .hf import attach

        return attach(model)

    def new_cache(self, model, config):
        """A fresh cache of this method for one batch of ``model`` (after :meth:`prepare`)."""
        return self.make_cache(config, model if self.apply is not None else model.config)

    @property
    def compresses(self) -> bool:
        """Whether the method has a budget (every method but ``dense``)."""
        return self.name != "dense"

    def check_protocol(self, protocol: str) -> None:
        """One-line error unless ``protocol`` is one this method defines."""
        check(protocol in PROTOCOLS, f"protocol={protocol!r} is unknown: expected one of {', '.join(PROTOCOLS)}")
        check(
            protocol in self.protocols,
            f"method {self.name!r} does not define protocol {protocol!r}: expected one of {', '.join(self.protocols)}",
        )


# ----------------------------------------------------------------------------------------------------------
# dense


@dataclass(frozen=True)
class DenseConfig:
    """The full cache: no budget, every token kept."""


def _make_dense_cache(config: DenseConfig, model_config):
    from transformers import DynamicCache

    return DynamicCache(config=model_config)


DENSE = Method("dense", "full cache (transformers DynamicCache): every token kept, the reference", DenseConfig,
               _make_dense_cache, None, PROTOCOLS)


# ----------------------------------------------------------------------------------------------------------
# eviction methods, imported lazily


def _load_eviction(name: str) -> Method:
    modname = MODULES[name]
    try:
        module = importlib.import_module(modname)
    except ModuleNotFoundError as e:
        if e.name != modname:  # the module exists but one of its imports is missing: not ours to hide
            raise
        raise KVLearnError(
            f"method {name!r} is registered but its module {modname} is not in this checkout yet: "
            f"available now: {', '.join(available_methods())}"
        ) from None
    missing = [a for a in ("CONFIG", "SUMMARY", "PROTOCOLS", "make_cache") if not hasattr(module, a)]
    check(not missing, f"module {modname} does not implement the method contract: missing {', '.join(missing)}")
    protocols = tuple(module.PROTOCOLS)
    check(protocols and set(protocols) <= set(PROTOCOLS),
          f"{modname}.PROTOCOLS={protocols!r} is invalid: expected a non-empty subset of {PROTOCOLS}")
    per_prompt = [a for a in ("make_prompt_cache", "prompt_choices", "make_choice_cache") if hasattr(module, a)]
    check(len(per_prompt) in (0, 3), f"module {modname} implements {', '.join(per_prompt)} but not all of "
                                     "make_prompt_cache, prompt_choices and make_choice_cache")
    return Method(name, str(module.SUMMARY), module.CONFIG, module.make_cache, getattr(module, "apply", None), protocols,
                  getattr(module, "config_from_budget", None), getattr(module, "make_prompt_cache", None),
                  getattr(module, "prompt_choices", None), getattr(module, "make_choice_cache", None),
                  bool(getattr(module, "TOKEN_BUDGET", True)), tuple(getattr(module, "TRAINED_FIELDS", ())),
                  getattr(module, "CONFIG_KEY", None))


_LOADED: dict[str, Method] = {"dense": DENSE}


def method_names() -> tuple[str, ...]:
    """Every registered method name, ``dense`` first (whether or not its module is in this checkout)."""
    return ("dense",) + EVICTION_METHODS + LEARNED_METHODS


def get_method(name: str) -> Method:
    """The registered method ``name``; a one-line error for an unknown name or a module not in this checkout."""
    check(name in method_names(), f"method={name!r} is unknown: expected one of {', '.join(method_names())}")
    if name not in _LOADED:
        _LOADED[name] = _load_eviction(name)
    return _LOADED[name]


def is_available(name: str) -> bool:
    """Whether ``name`` is registered and its module imports in this checkout."""
    try:
        get_method(name)
        return True
    except KVLearnError:
        return False


def available_methods() -> tuple[str, ...]:
    """The registered methods whose modules import in this checkout."""
    out = []
    for n in method_names():
        if n in _LOADED:
            out.append(n)
            continue
        try:
            importlib.import_module(MODULES[n])
            out.append(n)
        except ModuleNotFoundError:
            pass
    return tuple(out)


def make_config(name: str, budget: int | None = None, sinks: int = 4, context: int | None = None, **extra):
    """The validated config of method ``name``; every bad value is a one-line :class:`KVLearnError`.

    ``dense`` takes no budget. Every other method needs ``budget`` (and ``sinks``, plus its own ``extra`` fields);
    with ``context`` given the budget must also be below it (otherwise nothing is compressed).
    """
    method = get_method(name)
    if not method.compresses:
        check(budget is None, f"method 'dense' keeps every token: it takes no budget (got budget={budget!r})")
        check(not extra, f"method 'dense' has no options (got {', '.join(sorted(extra))})")
        return DenseConfig()
    if not method.token_budget:  # a compression target (kaizen), every token kept
        try:
            return method.config_from_budget(budget=budget, sinks=sinks, context=context, **extra)
        except TypeError as e:
            # the options it takes, except for a composition (kaizen+...), whose other options go to its eviction's
            # config, which the TypeError names
            fields = sorted(f.name for f in dataclasses.fields(method.config_cls)) \
                if dataclasses.is_dataclass(method.config_cls) else []
            takes = f"; its config takes {', '.join(fields)}" if fields and "eviction" not in fields else ""
            raise KVLearnError(f"method {name!r}: bad config arguments ({e}){takes}") from None
    check(budget is not None, f"method {name!r} needs a budget: expected sinks + 1 = {sinks + 1} <= budget"
          + (f" < context = {context}" if context is not None else ""))
    fields = {f.name for f in dataclasses.fields(method.config_cls)}
    if method.config_from_budget is not None:  # the budget decides these
        fields -= {"budget", "sinks", "topk", "context"}
    unknown = sorted(set(extra) - fields)
    check(not unknown, f"method {name!r} has no option(s) {', '.join(unknown)}: its config takes {', '.join(sorted(fields))}")
    if context is not None and "context" in fields:
        extra = {**extra, "context": context}
    build = method.config_from_budget or method.config_cls
    if method.config_from_budget is not None:
        extra = {**extra, "context": context}
    try:
        config = build(budget=budget, sinks=sinks, **extra)
    except TypeError as e:
        raise KVLearnError(f"method {name!r}: bad config arguments ({e})") from None
    if context is not None:
        check(budget < context,
              f"budget={budget} is invalid: expected sinks + 1 = {sinks + 1} <= budget < context = {context}")
    return config


def describe() -> list[str]:
    """One line per registered method: name, protocols, summary (``kvlearn methods``)."""
    lines = []
    width = max(len(n) for n in method_names())
    for n in method_names():
        try:
            m = get_method(n)
            lines.append(f"{n:<{width}}  {','.join(m.protocols):<16}  {m.summary}")
        except KVLearnError:
            lines.append(f"{n:<{width}}  {'-':<16}  (registered; module {MODULES[n]} not in this checkout yet)")
    return lines


def trained_options(name: str, path) -> dict:
    """The config fields of method ``name`` that the checkpoint folder ``path`` was trained with (its
    ``TRAINED_FIELDS`` found in ``config.json[CONFIG_KEY]``; KVpop: the scorer, its readout, the decay range and
    the window), for ``make_config(name, budget=..., **options)``: a trained model is evaluated under the pattern it
    was trained for, and only the budget comes from the caller. ``{}`` for a method without such fields, or a folder
    that records none or cannot be read (the model loader reports a bad folder)."""
    import json
    import os

    method = get_method(name)
    if not method.trained_fields or method.config_key is None:
        return {}
    try:
        with open(os.path.join(os.fspath(path), "config.json"), encoding="utf-8") as f:
            saved = json.load(f).get(method.config_key)
    except (OSError, ValueError, AttributeError, TypeError):
        return {}
    if not isinstance(saved, dict):
        return {}
    saved = {**getattr(method.config_cls, "RECORD_DEFAULTS", {}), **saved}  # fields older records lack
    return {k: saved[k] for k in method.trained_fields if k in saved}
