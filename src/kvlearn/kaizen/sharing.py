"""KV-Kaizen inside a transformers model: per-layer precision and cross-layer sharing, with and without a cache.

:func:`attach` registers the ``"kvlearn_kaizen"`` attention function, switches the model to it and adds one forward
pre-hook to the top-level model. Nothing is stored on modules between calls (ARCHITECTURE rules 2 and 6): for each
forward the hook finds the configuration (the :class:`~kvlearn.kaizen.cache.KaizenCache` passed as
``past_key_values``, or a ``kaizen_config=`` keyword for training and ``use_cache=False``) and passes a fresh
:class:`KaizenForward` (the configuration and an empty anchor dictionary) to every attention call as the keyword
``kaizen_forward``. Without either, the model runs unchanged (plain SDPA; a plain kvlearn cache works as with
:func:`kvlearn.attach`).

:func:`kaizen_attention`, for layer ``l`` with action ``a``:

- an own-cache layer (anchor) attends with its K/V ``[batch, kv_heads, kv, head_dim]``: without a kvlearn cache the
  keys and values of the forward fake-quantized to ``a.bits`` (:func:`kvlearn.ops.quant.fake_quantize`:
  straight-through gradient) under transformers' mask; with a :class:`KaizenCache` the keys/values its store returned
  (dequantized) under the layer's visibility mask. When a later layer shares it, it puts ``(K, V, mask)`` in the
  forward's anchor dictionary under ``l``.
- a sharing layer ignores its own K/V and attends its own queries over ``shared[anchor_of(l)]``: the same tensors the
  anchor attended, in the same forward. With ``use_cache=False`` that is the anchor's fake-quantized K/V of the
  whole sequence; with a cache, the anchor's store. Both give the same result (tested).

The sharing layers still compute their own ``k_proj``/``v_proj`` (unused): removing those projections is for the
method's ``apply``, not built yet. An MLA-converted layer (:mod:`kvlearn.kaizen.mla_attention`) does not call
this function: it reads its action from the same ``kaizen_forward`` itself.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from ..cache.observe import attention_summary
from ..errors import check
from ..hf import attach as attach_kvlearn
from ..hf import (SparseChunk, kvlearn_attention, masked_attention, sparse_chunk_attention,
                  sparse_chunk_visibility, store_decode_attention)
from ..ops.quant import fake_quantize
from .actions import KaizenConfig
from .cache import KaizenCache

ATTENTION_NAME = "kvlearn_kaizen"


class KaizenForward:
    """Per-forward state: the configuration, and ``shared {anchor layer: (K [batch, kv_heads, kv, head_dim], V,
    mask)}`` filled by the anchors of this forward and read by the layers sharing them (an MLA anchor that decodes
    absorbed puts its latent there instead, a :class:`~kvlearn.kaizen.mla_attention.SharedLatent`, which its sharers
    attend absorbed). Made fresh by the hook for
    every forward; never kept between forwards. A plain class, not a dataclass: FSDP's hooks rebuild dataclasses
    found in module arguments (the layers would fill copies of ``shared``)."""

    def __init__(self, config: KaizenConfig, shared: dict | None = None):
        self.config = config
        self.shared: dict[int, tuple] = {} if shared is None else shared  # (K, V, mask) or a SharedLatent
        self.needed = frozenset(config.anchor_of(l) for l, a in enumerate(config.actions) if a.share)


class KaizenTrainForward:
    """Per-forward state of a *training* forward (``use_cache=False``): the selector's straight-through one-hot
    weights ``weights [batch, layers, actions]`` over ``space`` (:func:`~kvlearn.kaizen.actions.action_space`) and
    ``carried``, the K/V ``(K, V) [batch, kv_heads, T, head_dim]`` the previous layer attended (what a ``share`` of
    the next layer attends). A plain class, not a dataclass: FSDP's hooks rebuild dataclasses found in module
    arguments. Made fresh for every forward (pass it as ``model(..., kaizen_train=state, use_cache=False)``).

    Layer ``l`` attends the mixture ``Σ_a w[:, l, a] KV_a`` with ``KV_b = fake_quantize(K/V, b)`` for an own-cache
    action at ``b`` bits and ``KV_share = carried`` (the previous layer's attended K/V; by induction that is the
    anchor's, since a sharing layer attends its anchor's). With hard one-hot weights this is exactly the chosen
    configuration's forward; the gradient reaches the weights (straight-through) and through them the selector."""

    def __init__(self, space, weights: torch.Tensor):
        check(weights.dim() == 3 and weights.shape[-1] == len(space),
              f"weights of shape {tuple(weights.shape)} are invalid: expected [batch, layers, {len(space)} actions]")
        self.space = tuple(space)
        self.weights = weights
        self.carried: tuple[torch.Tensor, torch.Tensor] | None = None


def _mixture(state: KaizenTrainForward, layer: int, key: torch.Tensor, value: torch.Tensor):
    """The layer's mixed ``(K, V)`` (class docstring)."""
    w = state.weights[:, layer].to(key.dtype)  # [B, A]
    k_out, v_out = torch.zeros_like(key), torch.zeros_like(value)
    for a, action in enumerate(state.space):
        wa = w[:, a].view(-1, 1, 1, 1)
        if action.share:
            if state.carried is None:  # layer 0: share is masked (weight 0); nothing to mix
                continue
            k_a, v_a = state.carried
        else:
            k_a, v_a = fake_quantize(key, action.bits), fake_quantize(value, action.bits)
        k_out = k_out + wa * k_a
        v_out = v_out + wa * v_a
    state.carried = (k_out, v_out)
    return k_out, v_out


def _kaizen_hook(module, args, kwargs):
    cache = kwargs.get("past_key_values")
    config = kwargs.get("kaizen_config")
    if isinstance(cache, KaizenCache):
        check(config is None or config == cache.config,
              "kaizen_config differs from the KaizenCache's configuration: pass one of them")
        config = cache.config
    if config is None:
        return None
    check(isinstance(config, KaizenConfig), f"kaizen_config={config!r} is not a KaizenConfig")
    config.backbone.check_model(module.config)
    kwargs = dict(kwargs)
    kwargs.pop("kaizen_config", None)
    kwargs["kaizen_forward"] = KaizenForward(config)
    return args, kwargs


def attach(model):
    """Make ``model`` run KV-Kaizen configurations (and kvlearn caches, and normally without either). Returns it."""
    attach_kvlearn(model)  # the cache-routing hook: begin_forward, kvlearn_cache=
    AttentionInterface.register(ATTENTION_NAME, kaizen_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    model.set_attn_implementation(ATTENTION_NAME)
    if not any(h is _kaizen_hook for h in model._forward_pre_hooks.values()):
        model.register_forward_pre_hook(_kaizen_hook, with_kwargs=True)
    return model


def kaizen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    kvlearn_cache=None,
    kaizen_forward: KaizenForward | None = None,
    kaizen_train: KaizenTrainForward | None = None,
    **kwargs,
):
    """Attention of one layer under its KV-Kaizen action (module docstring).

    Args:
        query: ``[batch, q_heads, q, head_dim]`` (after RoPE).
        key, value: ``[batch, kv_heads, kv, head_dim]``: the forward's own (no cache) or the cache's return.
    Returns:
        ``(out [batch, q, q_heads, head_dim], None)``.
    """
    if kaizen_train is not None:  # training: the selector's mixture of candidate actions
        check(kaizen_forward is None and kvlearn_cache is None,
              "kaizen_train is for use_cache=False training forwards without kaizen_config: pass one of them")
        key, value = _mixture(kaizen_train, module.layer_idx, key, value)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if kaizen_forward is None:  # no configuration: kvlearn's attention (a plain compact cache, or plain SDPA)
        return kvlearn_attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                 kvlearn_cache=kvlearn_cache, **kwargs)
    l = module.layer_idx
    config = kaizen_forward.config
    action = config.actions[l]
    layer = None if kvlearn_cache is None else kvlearn_cache.layers[l]
    if action.share:
        anchor = config.anchor_of(l)
        check(anchor in kaizen_forward.shared, f"layer {l} shares layer {anchor}, which has not run in this forward")
        key, value, mask = kaizen_forward.shared[anchor]
    else:
        if layer is None:
            key, value = fake_quantize(key, action.bits), fake_quantize(value, action.bits)
            mask = attention_mask
        else:
            step = kvlearn_cache.step
            # a long chunk of a static-score policy: sparse retention (its sharers attend under it too), else the mask
            mask = sparse_chunk_visibility(kvlearn_cache, layer, query, step)
            if mask is None:
                mask = layer.visibility_mask(step.positions, step.has_padding)  # [batch, P, q, kv]
        if l in kaizen_forward.needed:
            kaizen_forward.shared[l] = (key, value, mask)
    if layer is None:
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
    source = getattr(layer, "anchor", layer)  # the layer whose store holds these keys (a sharer reads its anchor's)
    if source.store_attends:  # a decode step over a store that attends itself (packed codes: no keys were read)
        return store_decode_attention(source, query, mask, scaling), None
    if isinstance(mask, SparseChunk):
        return sparse_chunk_attention(mask, query, key, value, scaling), None
    out = masked_attention(query, key, value, mask, scaling)
    if not action.share and layer.policy.observes:  # an evicting anchor decides after attending
        step = kvlearn_cache.step
        request = layer.policy.attention_request(step)
        attention = None if request is None else attention_summary(query, key, mask, scaling, request, step.positions)
        layer.observe_attention(step, attention)
    return out, None
