"""``apply_dms``: put DMS gates on a model, make its caches, load it back; and the ``dms`` registry entry.

A method is four things (ARCHITECTURE rule 1); for DMS (Łańcucki et al. 2025, arXiv 2506.05345) they are
:class:`~kvlearn.config.DMSConfig`, one :class:`~kvlearn.dms.gates.DMSGate` registered as ``self_attn.dms`` on every
decoder layer (state-dict keys ``model.layers.<i>.self_attn.dms.*``, float32), the attention functions (``"kvlearn"``
over the cache at inference, :func:`kvlearn.hf.attach`; ``"dms_train"`` in training,
:mod:`kvlearn.dms.attention`) and :class:`~kvlearn.dms.cache.DMSCache`.

The gate reads the decoder layer's *input* (the pre-``input_layernorm`` residual stream), which the attention
module never sees, so :func:`apply_dms` adds one forward pre-hook per decoder layer. The hook does nothing unless the
forward carries a DMS training state (keyword ``dms_train``) or a :class:`DMSCache` (keyword ``kvlearn_cache``, set
by the hook of :func:`kvlearn.hf.attach`); then it runs the gate on the detached residual ``[B, T, hidden]`` and
hands the logits ``[B, Hkv, T]`` to that per-forward state (or to the cache layer's policy). Nothing is stored on
modules between calls. The config is recorded as ``model.config.dms`` (a dict), so ``save_pretrained`` writes it
and :func:`kvlearn.load` re-applies DMS and loads the gate weights (:func:`load_dms`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, replace

import torch

from ..config import DMSConfig, windowed_budget
from ..errors import KVLearnError, check
from ..hf import attach, check_supported, load_added_weights
from .cache import DMSCache
from .gates import MODULE_NAME, DMSGate, decoder_layers, dms_gates, has_dms

__all__ = ["apply_dms", "has_dms", "dms_gates", "make_dms_cache", "load_dms", "recorded_config", "config_from_budget"]

CONFIG_KEY = "dms"  # the entry of model.config
# fields a trained checkpoint fixes for its evaluation (kvlearn.methods.trained_options); the gates' own learned
# fields come from the modules themselves (:func:`apply`)
TRAINED_FIELDS = ("window",)
LEARNED_FIELDS = ("gate_hidden", "alpha_scale", "alpha_offset")


def _gate_hook(layer, args, kwargs):
    """Decoder-layer forward pre-hook: run the gate on the layer's input and hand the logits to the forward's DMS
    state (training) or DMS cache (inference)."""
    from .attention import DMSTrainForward

    state = kwargs.get("dms_train")
    cache = kwargs.get("kvlearn_cache")
    if not isinstance(state, DMSTrainForward) and not isinstance(cache, DMSCache):
        return None
    hidden = args[0] if args else kwargs["hidden_states"]  # [B, T, hidden], before input_layernorm
    attn = layer.self_attn
    alpha = getattr(attn, MODULE_NAME)(hidden.detach())  # [B, Hkv, T] float32; detached input (rule 5)
    if isinstance(state, DMSTrainForward):
        state.add_gate(attn.layer_idx, alpha)
    else:
        cache.layers[attn.layer_idx].policy.set_logits(alpha)
    return None


def recorded_config(model) -> DMSConfig | None:
    """The :class:`DMSConfig` recorded on ``model.config`` by :func:`apply_dms` (``None`` if none)."""
    saved = getattr(getattr(model, "config", None), CONFIG_KEY, None)
    if saved is None:
        return None
    check(isinstance(saved, dict), f"model.config.{CONFIG_KEY}={saved!r} is invalid: expected the dict apply_dms records")
    try:
        return DMSConfig(**saved)
    except TypeError as err:
        raise KVLearnError(f"model.config.{CONFIG_KEY} is not a DMSConfig ({err}): expected the dict apply_dms records") from None


def apply_dms(model, config: DMSConfig):
    """Make ``model`` a DMS model (in place; returns it): a zero-initialised float32 :class:`DMSGate` as
    ``self_attn.dms`` of every decoder layer, the gate hooks, ``model.config.dms = asdict(config)`` and the kvlearn
    attention. On a model that already has gates (a loaded checkpoint) they are kept with their weights; ``config``
    must agree on the learned fields (``gate_hidden``, ``alpha_scale``, ``alpha_offset``)."""
    check(isinstance(config, DMSConfig), f"config is {type(config).__name__}: expected a kvlearn.config.DMSConfig")
    check_supported(model)
    layers = decoder_layers(model)
    if has_dms(model):
        first = dms_gates(model)[0]
        for name in LEARNED_FIELDS:
            have, want = getattr(first, name), getattr(config, name)
            check(have == want, f"apply_dms on a model that already has DMS gates: {name}={want!r} but the gates were "
                                f"built with {name}={have!r}: only sinks, window and budget may differ")
    else:
        hidden = model.config.hidden_size
        eps = float(getattr(model.config, "rms_norm_eps", 1e-6))
        for layer in layers:
            attn = layer.self_attn
            heads = attn.k_proj.out_features // int(attn.head_dim)
            gate = DMSGate(hidden, heads, config.gate_hidden, config.alpha_scale, config.alpha_offset, eps)
            attn.add_module(MODULE_NAME, gate.to(device=attn.k_proj.weight.device, dtype=torch.float32))
    for layer in layers:
        if not any(h is _gate_hook for h in layer._forward_pre_hooks.values()):
            layer.register_forward_pre_hook(_gate_hook, with_kwargs=True)
    setattr(model.config, CONFIG_KEY, asdict(config))
    return attach(model)


def make_dms_cache(model, config: DMSConfig | None = None) -> DMSCache:
    """A fresh :class:`DMSCache` for one batch of ``model`` (``config``: default the recorded one; it needs a
    budget)."""
    config = config if config is not None else recorded_config(model)
    check(config is not None, f"{type(model).__name__} has no DMS config: call apply_dms(model, config) first")
    check(isinstance(config, DMSConfig), f"config is {type(config).__name__}: expected a kvlearn.config.DMSConfig")
    dms_gates(model)
    return DMSCache(config, model.config.num_hidden_layers)


def load_dms(model, path: str | os.PathLike):
    """Apply the DMS config saved in the checkpoint folder ``path`` to ``model`` and load its gate weights; returns
    ``model``. A base of another shape is a one-line :class:`KVLearnError`."""
    path = os.fspath(path)
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        saved = json.load(f)
    check(isinstance(saved.get(CONFIG_KEY), dict),
          f"checkpoint {path!r} has no DMS config ({CONFIG_KEY!r} in config.json): expected a model saved after apply_dms")
    try:
        config = DMSConfig(**saved[CONFIG_KEY])
    except TypeError as err:
        raise KVLearnError(f"checkpoint {path!r}: its {CONFIG_KEY!r} entry is not a DMSConfig ({err})") from None
    apply_dms(model, config)
    load_added_weights(model, path, lambda k: f".{MODULE_NAME}." in k, "DMS checkpoint",
                       f"the gates of gate_hidden={config.gate_hidden} differ: load it onto the base it was trained on")
    return model


# ----------------------------------------------------------------------------------------------------------------
# the method registry entry (kvlearn.methods)

CONFIG = DMSConfig
SUMMARY = ("DMS: sinks + window + the older tokens a learned per-KV-head gate keeps (logit > 0 evicts on leaving the "
           "window; at a full budget the highest-logit kept token goes; gates added by apply_dms)")
PROTOCOLS = ("bounded", "context")


def make_cache(config: DMSConfig, model) -> DMSCache:
    """Registry ``make_cache``: the cache checks the model's gates, so it receives the model."""
    return make_dms_cache(model, config)


def apply(model, config: DMSConfig):
    """Registry ``apply``: :func:`apply_dms`. On a model that already has gates (a trained checkpoint) the gates'
    own learned fields (``gate_hidden``, ``alpha_scale``, ``alpha_offset``) replace the harness config's defaults,
    so ``kvlearn eval --method dms --budget B`` evaluates any DMS checkpoint at budget ``B``."""
    if has_dms(model):
        first = dms_gates(model)[0]
        config = replace(config, **{name: getattr(first, name) for name in LEARNED_FIELDS})
    return apply_dms(model, config)


def config_from_budget(budget: int, sinks: int = 4, context: int | None = None, window: int | None = None,
                       **extra) -> DMSConfig:
    """The harness's DMS config from a budget (``window`` default 32, like the eviction methods)."""
    window = windowed_budget("DMS", budget, sinks, window)
    return DMSConfig(sinks=sinks, window=window, budget=budget, context=context, **extra)
