"""StreamingLLM+ : StreamingLLM's sinks + recent-window pattern with the model distilled under that pattern.

The baseline "StreamingLLM+" of the KVpop paper (Hauzenberger et al., "KVpop: Key-Value Cache Compression with Predictive Online Pruning"): the retention rule of
StreamingLLM (Xiao et al. 2024; :mod:`kvlearn.eviction.streaming`), but the model is retrofitted to it by the same
recipe as KVpop (``kvlearn retrofit --method streaming_plus``: KD to the dense teacher's top-256 logits), with no
new modules. Its inference cache *is* the streaming cache (:class:`~kvlearn.eviction.streaming.StreamingCache`,
``window = budget - sinks``).

The training attention is dense attention under the same mask, for query ``q`` and key ``k``::

    M[q, k] = k <= q and (k < sinks or q - k < window)

as a FlexAttention ``mask_mod`` (:func:`streaming_mask_mod`, the block-sparse CUDA execution) and as its dense twin
``[T, T]`` bool (:func:`streaming_mask_dense`, the CPU execution; :func:`streaming_attention`): the attention function ``"streaming_train"`` takes the per-forward
config as the keyword ``streaming_train`` (a :class:`~kvlearn.config.StreamingConfig`); without it, it is
transformers' SDPA attention unchanged. :func:`apply` records the config as ``model.config.streaming_plus`` (so a
checkpoint says which budget it was distilled for); :func:`kvlearn.load` loads such a checkpoint as a plain model.
"""

from __future__ import annotations

from dataclasses import asdict

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from ..config import StreamingConfig
from ..errors import check
from ..hf import attach
from ..ops.flex import autocast_qkv
from .streaming import StreamingCache
from .streaming import make_cache as _streaming_cache

CONFIG = StreamingConfig
SUMMARY = ("StreamingLLM+: sinks + recent window, the model distilled under that mask (kvlearn retrofit "
           "--method streaming_plus); its cache is the streaming cache")
PROTOCOLS = ("bounded", "context")
CONFIG_KEY = "streaming_plus"
TRAIN_ATTENTION = "streaming_train"


def streaming_mask_mod(sinks: int, window: int):
    """FlexAttention ``mask_mod(b, h, q_idx, kv_idx)`` of the rule (the same for every head)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & ((kv_idx < sinks) | (q_idx - kv_idx < window))

    return mask_mod


def streaming_mask_dense(T: int, sinks: int, window: int, device=None) -> Tensor:
    """``[T, T]`` bool: the mask_mod materialised (row = query, column = key)."""
    t = torch.arange(T, device=device)
    return streaming_mask_mod(sinks, window)(None, None, t[:, None], t[None, :])


def streaming_train_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                              attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                              streaming_train: StreamingConfig | None = None, **kwargs):
    """Attention function (transformers' signature): ``query [B, Hq, T, D]``, ``key``/``value [B, Hkv, T, D]`` (the
    whole sequence, no cache, no padding); returns ``(out [B, T, Hq, D], None)``."""
    if streaming_train is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    check(isinstance(streaming_train, StreamingConfig),
          f"streaming_train of type {type(streaming_train).__name__} is invalid: expected a StreamingConfig")
    check(key.shape[2] == query.shape[2],
          f"the StreamingLLM+ training attention needs the whole sequence in one forward (keys {key.shape[2]}, "
          f"queries {query.shape[2]}): call it without a cache")
    query, key, value = autocast_qkv(query, key, value)
    out = streaming_attention(query, key, value, streaming_train.sinks, streaming_train.window, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def streaming_attention(query: Tensor, key: Tensor, value: Tensor, sinks: int, window: int,
                        scale: float | None = None, backend: str = "auto") -> Tensor:
    """GQA attention under the rule: ``query [B, Hq, T, D]``, ``key``/``value [B, Hkv, T, D]`` -> ``[B, Hq, T, D]``.
    ``backend``: ``"dense"`` (SDPA with the ``[T, T]`` bool twin), ``"flex"`` (FlexAttention with the block mask of
    :func:`streaming_mask_mod`: block-sparse; no backward on the CPU) or ``"auto"`` (flex on CUDA, dense elsewhere)."""
    check(backend in ("auto", "dense", "flex"), f"backend={backend!r} is invalid: expected one of auto, dense, flex")
    T = query.shape[2]
    gqa = key.shape[1] != query.shape[1]
    if backend == "flex" or (backend == "auto" and query.device.type == "cuda"):
        from torch.nn.attention.flex_attention import create_block_mask

        from ..ops.flex import flex_attention_lse

        block_mask = create_block_mask(streaming_mask_mod(sinks, window), None, None, T, T, device=query.device)
        out, _ = flex_attention_lse(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                                    return_lse=False)
        return out
    mask = streaming_mask_dense(T, sinks, window, query.device)  # [T, T]
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=gqa)


def use_train_attention(model):
    """Register ``"streaming_train"`` (idempotent) and switch ``model`` to it; returns ``model``."""
    AttentionInterface.register(TRAIN_ATTENTION, streaming_train_attention)
    AttentionMaskInterface.register(TRAIN_ATTENTION, sdpa_mask)
    model.set_attn_implementation(TRAIN_ATTENTION)
    return model


def apply(model, config: StreamingConfig):
    """Registry ``apply``: record ``model.config.streaming_plus`` and attach the kvlearn attention (no modules)."""
    check(isinstance(config, StreamingConfig), f"config is {type(config).__name__}: expected a kvlearn.StreamingConfig")
    setattr(model.config, CONFIG_KEY, {k: v for k, v in asdict(config).items() if k != "context"})
    return attach(model)


def make_cache(config: StreamingConfig, model) -> StreamingCache:
    """Registry ``make_cache`` (a method with ``apply`` receives the model): the streaming cache."""
    return _streaming_cache(config, model.config)
