"""``apply_kvpop``: put KVpop's learned modules on a model, make its caches, and load it back from a checkpoint.

A method is four things (DESIGN.md section 0, rule 1); for KVpop they are :class:`~kvlearn.config.KVpopConfig`,
one :class:`KVpopModules` (the layer's scorer and its per-KV-head :class:`~kvlearn.kvpop.policy.LearnedDecay`)
registered as ``self_attn.kvpop`` on every decoder layer, the shared ``"kvlearn"`` attention
(:func:`kvlearn.hf.attach`) and :class:`~kvlearn.kvpop.cache.KVpopCache`. The modules are ordinary submodules, so
optimizers, FSDP and ``save_pretrained`` see them (state-dict keys ``model.layers.<i>.self_attn.kvpop.scorer.*`` and
``...kvpop.decay.alpha``); the config is recorded as ``model.config.kvpop`` (a dict), so ``save_pretrained`` writes
it into ``config.json`` and :func:`kvlearn.load` (:mod:`kvlearn.checkpoint`) re-applies KVpop and loads
the weights (:func:`load_kvpop`).
Per-sequence state (slot priorities, the mLSTM memory) lives in the cache; the modules hold parameters only.

This module is also the ``kvpop`` entry of the method registry (:mod:`kvlearn.methods`): ``CONFIG``, ``SUMMARY``,
``PROTOCOLS``, ``make_cache(config, model)``, ``apply(model, config)`` and ``config_from_budget``. What the
evaluation harness supports: every scorer (``linear``, ``mlp``, ``mlstm`` with the delayed or immediate readout)
under both protocols; both prefill in several forwards, which the mLSTM scorer continues from its memory
(:meth:`~kvlearn.kvpop.scorers.MLSTMScorer.continue_prefill`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, replace

import torch
from torch import nn

from ..config import KVpopConfig, windowed_budget
from ..errors import KVLearnError, check
from ..hf import attach, check_supported, load_added_weights
from .cache import KVpopCache
from .modules import MODULE_NAME, KVpopModules, attention_modules, has_kvpop, kvpop_modules

__all__ = ["KVpopModules", "apply_kvpop", "kvpop_modules", "has_kvpop", "make_kvpop_cache", "model_budget_config",
           "state_budget_config", "load_kvpop", "recorded_config", "config_from_budget"]

CONFIG_KEY = "kvpop"  # the entry of model.config
# the entry of model.config naming the KV-Kaizen configuration a student was retrofitted under (kvlearn retrofit
# --kv-bits, e.g. "b4 b4 share b4"): kaizen+kvpop serves it under that configuration (kvlearn.kaizen.compose)
KV_CONFIGURATION_KEY = "kvpop_kv_configuration"
# fields a trained checkpoint fixes for its evaluation (kvlearn.methods.trained_options); the budget's top-k is free.
# state_in_budget: an mLSTM student trained with its recurrent state counted in the budget (fewer top-k slots) is
# served so, its cache within the same bytes as a stateless scorer's (before 2026-12-04 `kvlearn eval` served such a
# student with the full top-k plus its state: more bytes than its budget)
# mlstm_use_norm, mlstm_value_dim (the parameter set) and mlstm_gate_softcap (the function) are the mLSTM's learned
# options; a record without them (before they existed) was built with their defaults
TRAINED_FIELDS = ("scorer", "delayed_readout", "mlstm_skip", "decay_min", "decay_max", "window", "state_in_budget",
                  "mlstm_use_norm", "mlstm_value_dim", "mlstm_gate_softcap")

# ----------------------------------------------------------------------------------------------------------------
# model structure


def _kv_shape(attn: nn.Module) -> tuple[int, int]:
    """``(num_kv_heads, head_dim)`` of one attention module."""
    head_dim = int(attn.head_dim)
    return attn.k_proj.out_features // head_dim, head_dim


def recorded_config(model) -> KVpopConfig | None:
    """The :class:`KVpopConfig` recorded on ``model.config`` by :func:`apply_kvpop` (``None`` if none)."""
    saved = getattr(getattr(model, "config", None), CONFIG_KEY, None)
    if saved is None:
        return None
    check(isinstance(saved, dict), f"model.config.{CONFIG_KEY}={saved!r} is invalid: expected the dict apply_kvpop records")
    try:
        return KVpopConfig.from_record(saved)
    except TypeError as err:
        raise KVLearnError(f"model.config.{CONFIG_KEY} is not a KVpopConfig ({err}): expected the dict apply_kvpop records") from None


def _check_modules_fit(model, config: KVpopConfig, what: str) -> None:
    """One-line error unless the model's KVpop modules are what ``config``'s learned fields describe (read from the
    modules themselves: scorer kind, decay range; the mLSTM's readout, skip, norm, value width and gate cap)."""
    attns = attention_modules(model)
    kvpop_modules(model)  # one-line error without modules
    mods = [getattr(a, MODULE_NAME) for a in attns]
    first = mods[0]
    built = {"scorer": first.scorer_kind, "decay_min": first.decay.decay_min, "decay_max": first.decay.decay_max}
    if first.scorer_kind == "mlstm":  # the readout only exists for the stateful scorer
        built["delayed_readout"] = first.scorer.delayed_readout
        built["mlstm_skip"] = first.scorer.skip
        built["mlstm_use_norm"] = first.scorer.use_norm
        built["mlstm_value_dim"] = first.scorer.value_dim
        built["mlstm_gate_softcap"] = first.scorer.gate_softcap
    for name, have in built.items():
        want = getattr(config, name)
        if name == "mlstm_value_dim" and want is None and have == first.scorer.head_dim // 2:
            continue  # None: the scorer's default width, head_dim / 2
        check(have == want,
              f"{what}: {name}={want!r} but the model's KVpop modules were built with {name}={have!r}: only the "
              "budget (sinks, window, topk) may differ from the applied config")
    if config.scorer == "mlstm" and config.delayed_readout:
        delay = first.scorer.readout_delay
        check(delay == config.window,
              f"{what}: window={config.window} but the model's delayed mLSTM scorers read out {delay} tokens late "
              f"(the window they were built with): use window={delay}")


# ----------------------------------------------------------------------------------------------------------------
# apply / cache


def apply_kvpop(model, config: KVpopConfig):
    """Make ``model`` a KVpop model: returns ``model`` (modified in place).

    Adds a :class:`KVpopModules` (scorer from ``config.scorer`` with ``config.delayed_readout``, decay in
    ``[config.decay_min, config.decay_max]``, float32, on the model's device) as ``self_attn.kvpop`` of every
    decoder layer, records ``model.config.kvpop = asdict(config)`` and attaches the kvlearn attention. On a model
    that already has KVpop modules (a loaded checkpoint) they are kept, with their weights: ``config`` must then
    agree on the learned fields (scorer, decay range; the mLSTM's readout, skip, norm, value width and gate cap, and
    the window of a delayed mLSTM scorer) and only the budget may differ; the recorded config becomes ``config``.
    """
    check(isinstance(config, KVpopConfig), f"config is {type(config).__name__}: expected a kvlearn.KVpopConfig")
    check_supported(model)
    check(config.decay_step == 1,
          f"decay_step={config.decay_step} is not supported by apply_kvpop: expected 1 (static priorities)")
    attns = attention_modules(model)
    if has_kvpop(model):
        _check_modules_fit(model, config, "apply_kvpop on a model that already has KVpop modules")
    else:
        for attn in attns:
            heads, head_dim = _kv_shape(attn)
            device = attn.k_proj.weight.device
            attn.add_module(MODULE_NAME, KVpopModules(config, heads, head_dim).to(device=device, dtype=torch.float32))
    setattr(model.config, CONFIG_KEY, asdict(config))
    return attach(model)


def make_kvpop_cache(model, config: KVpopConfig | None = None) -> KVpopCache:
    """A fresh :class:`KVpopCache` for one batch of ``model``, built from the model's own scorers and decays.

    ``config`` defaults to the one :func:`apply_kvpop` recorded; another config must agree on the learned fields
    (its budget may differ)."""
    recorded = recorded_config(model)
    if config is None:
        check(recorded is not None,
              f"{type(model).__name__} has no KVpop config: call apply_kvpop(model, config) first")
        config = recorded
    check(isinstance(config, KVpopConfig), f"config is {type(config).__name__}: expected a kvlearn.KVpopConfig")
    _check_modules_fit(model, config, "make_kvpop_cache")
    scorers, decays = kvpop_modules(model)
    return KVpopCache(model_budget_config(model, config), scorers, decays)


def model_budget_config(model, config: KVpopConfig, kv_dtype: torch.dtype | None = None) -> KVpopConfig:
    """:func:`state_budget_config` for ``model``'s own scorer, its keys and values stored in ``kv_dtype`` (default:
    the model's parameter dtype, what its cache stores). The retrofit trainer passes ``torch.bfloat16``, the dtype a
    student is served in, so that a float32 training run holds the top-k its bf16 cache will hold."""
    scorers, _ = kvpop_modules(model)
    _, head_dim = _kv_shape(attention_modules(model)[0])
    dtype = kv_dtype if kv_dtype is not None else next(model.parameters()).dtype
    token_bytes = 2 * head_dim * dtype.itemsize  # one token's key + value per KV head
    return state_budget_config(config, scorers[0], token_bytes)


def state_budget_config(config: KVpopConfig, scorer, token_bytes: int) -> KVpopConfig:
    """``config`` with ``state_in_budget`` applied: a stateful scorer's recurrent state per KV head
    (``scorer.state_bytes_per_head()``) takes ``ceil(state / token_bytes)`` of the ``topk`` long-range slots, so
    the cache's K/V plus the state stay within the budget's bytes (``token_bytes``: one token's key and value in
    one KV head). Unchanged without the flag or for a stateless scorer; a one-line error when the state would take
    every long-range slot."""
    if not config.state_in_budget or not scorer.stateful:
        return config
    slots = -(-scorer.state_bytes_per_head() // token_bytes)
    check(slots < config.topk,
          f"state_in_budget: the mLSTM state ({scorer.state_bytes_per_head()} bytes per KV head) takes {slots} of "
          f"topk={config.topk} long-range slots: expected a budget with more than {slots} long-range slots")
    return replace(config, topk=config.topk - slots)


# ----------------------------------------------------------------------------------------------------------------
# loading


def load_kvpop(model, path: str | os.PathLike):
    """Apply the KVpop config saved in the checkpoint folder ``path`` to ``model`` and load its scorer and decay
    weights; returns ``model``. ``model`` must have the checkpoint's base shape (decoder layers, KV heads,
    head_dim): anything else is a one-line :class:`KVLearnError`."""
    path = os.fspath(path)
    config_path = os.path.join(path, "config.json")
    check(os.path.isfile(config_path), f"KVpop checkpoint {path!r} has no config.json: expected a save_pretrained folder")
    with open(config_path, encoding="utf-8") as f:
        saved = json.load(f)
    check(isinstance(saved.get(CONFIG_KEY), dict),
          f"checkpoint {path!r} has no KVpop config ({CONFIG_KEY!r} in config.json): expected a model saved after apply_kvpop")
    try:
        config = KVpopConfig.from_record(saved[CONFIG_KEY])
    except TypeError as err:
        raise KVLearnError(f"checkpoint {path!r}: its {CONFIG_KEY!r} entry is not a KVpopConfig ({err})") from None
    check_supported(model)
    attns = attention_modules(model)
    heads, head_dim = _kv_shape(attns[0])
    want_heads = saved.get("num_key_value_heads", saved.get("num_attention_heads"))
    want_dim = saved.get("head_dim") or saved.get("hidden_size", 0) // max(1, saved.get("num_attention_heads", 1))
    got = (len(attns), heads, head_dim)
    want = (saved.get("num_hidden_layers"), want_heads, want_dim)
    check(got == want,
          f"KVpop checkpoint {path!r} was trained on a base with (layers, kv_heads, head_dim) = {want} but the model "
          f"has {got}: load it onto the base it was trained on")
    apply_kvpop(model, config)
    load_added_weights(model, path, lambda k: f".{MODULE_NAME}." in k, "KVpop checkpoint",
                       f"the modules of scorer {config.scorer!r} differ: expected a checkpoint saved after apply_kvpop")
    return model


# ----------------------------------------------------------------------------------------------------------------
# the method registry entry (kvlearn.methods)

CONFIG = KVpopConfig
SUMMARY = ("KVpop: sinks + window + the top-k older tokens by a learned per-KV-head scorer and decay "
           "(modules added by apply_kvpop; scorer linear/mlp/mlstm)")
PROTOCOLS = ("bounded", "context")


def make_cache(config: KVpopConfig, model) -> KVpopCache:
    """Registry ``make_cache``: KVpop needs the model's modules, so it receives the model (not its config)."""
    return make_kvpop_cache(model, config)


def apply(model, config: KVpopConfig):
    """Registry ``apply``: :func:`apply_kvpop`."""
    return apply_kvpop(model, config)


def config_from_budget(budget: int, sinks: int = 4, context: int | None = None, window: int | None = None,
                       scorer: str = "mlp", **extra) -> KVpopConfig:
    """The harness's KVpop config from a budget: ``topk = budget - sinks - window`` (``window`` default 32, like the
    eviction methods), the ``mlp`` scorer by default (``scorer='mlstm'``: the paper's stateful scorer)."""
    window = windowed_budget("KVpop", budget, sinks, window)
    return KVpopConfig(sinks=sinks, window=window, topk=budget - sinks - window, context=context, scorer=scorer, **extra)
