"""DMS training: the attention with delayed, soft eviction, the Gumbel-sigmoid relaxation and the compression loss.

Source: Łańcucki et al. 2025, "Inference-Time Hyper-Scaling with KV Cache Compression" (arXiv 2506.05345), and the
reference code (NVIDIA Model-Optimizer ``experimental/dms``: ``core.get_gating_with_noise``,
``attention.dms_attn_train_mode``, ``training/engine.py``); see docs/DESIGN.md, "DMS and StreamingLLM+".

Per layer, with ``alpha [B, Hkv, T]`` the gate logits (:class:`~kvlearn.dms.gates.DMSGate`, produced at token ``t``):

* **Relaxation** (training): ``z = (alpha + g1 - g2) / tau`` with ``g1, g2 ~ Gumbel(0, 1)`` (logistic noise),
  ``tau = 0.1``; straight-through decisions ``d = 1[sigmoid(z) > 1/2] - sigmoid(z).detach() + sigmoid(z)``.
  ``hard=True`` (the inference rule): ``z = alpha`` and decisions ``1[alpha > 0]``, no noise.
* **Shift by one**: the decision for key ``k`` is ``z[k + 1]`` (:func:`shift_left`); the last key has none yet.
* **Attention bias** ``[B, Hkv, q, k]`` float32 (:func:`dms_bias`): ``-inf`` for ``k > q`` (causal); for ``k >=
  sinks`` and ``q - k >= window`` (the key has left the window; ``window`` counts the query itself) the log keep
  probability ``logsigmoid(-z[k + 1])`` (hard: ``-inf`` iff ``alpha[k + 1] > 0``); 0 otherwise. The query heads of a
  KV head share its bias (GQA).
* **Compression loss** (:func:`compression_loss`): per layer the closed fraction ``mean(d)`` over KV heads and keys
  ``0..T-2`` (the keys that have a decision), per batch row, averaged over layers; the one-sided hinge
  ``mean_b clamp(target - closed_b, min=0)``; ``target = 1 - 1/cr`` ramped (:meth:`kvlearn.config.DMSConfig.target_fraction`).
  With ``DMSConfig.compression_scope="head"`` the hinge is taken per (row, layer, KV head) and averaged.

Three executions of the bias (:func:`dms_attention`): ``"dense"`` materialises it (the CPU reference; memory
``B * Hq * T^2`` per layer); ``"flex"`` is FlexAttention with a causal block mask and a
``score_mod`` that adds the per-key penalty ``[B, Hkv, T]`` (what the reference compiles; its backward accumulates the
penalty's gradient from every score into a captured buffer: 26.6 ms of the H200 step against 5.8 ms for
StreamingLLM+'s mask-only backward); ``"flex_channel"`` (:func:`penalty_channel_inputs`, the CUDA default) carries the
penalty as one more key channel over two copies of the keys, so FlexAttention runs with a ``mask_mod`` only and the
penalty's gradient is an ordinary key gradient (equal to the dense bias on the CPU in float64, forward and, through
``"dense_channel"``, gradients, and on the H200 forward and gradients; the DMS retrofit step there is 1.57x a
distillation step with it against 2.21x with the score_mod, in one run:
``results/raw/retrofit_step_speed_dms_channel_h200_7fce8b6.json``). FlexAttention has no backward on the CPU, so
``"auto"`` picks flex_channel on CUDA (the score_mod for ``hard`` logits) and dense elsewhere.
Gate inputs are detached from the backbone (ARCHITECTURE rule 5): the KD loss reaches the gates through the bias
and the backbone through the attention; the compression loss reaches only the gates.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from ..config import DMS_COMPRESSION_SCOPES, DMS_TRAIN_ATTENTIONS, DMSConfig
from ..errors import check
from ..ops.flex import autocast_qkv

__all__ = ["TRAIN_ATTENTION", "BACKENDS", "DMSRecord", "DMSTrainForward", "shift_left", "dms_penalty", "dms_bias",
           "penalty_channel_inputs", "channel_mask_mod", "resolve_backend", "channel_block_mask", "dms_attention", "logistic_noise", "compression_loss", "dms_train_attention", "use_train_attention"]

BACKENDS = DMS_TRAIN_ATTENTIONS

TRAIN_ATTENTION = "dms_train"


def shift_left(x: Tensor, fill: float) -> Tensor:
    """``out[..., t] = x[..., t + 1]``, ``out[..., -1] = fill``: the decision of token ``t + 1`` applied to key ``t``."""
    return torch.cat([x[..., 1:], torch.full_like(x[..., :1], fill)], dim=-1)


def logistic_noise(shape, generator: torch.Generator | None, device) -> Tensor:
    """``g1 - g2`` with ``g1, g2 ~ Gumbel(0, 1)`` (= Logistic(0, 1)), float32, drawn on the CPU generator."""
    u = torch.rand(shape, generator=generator, dtype=torch.float32).clamp_(1e-6, 1 - 1e-6)
    return (u.log() - (-u).log1p()).to(device)


def dms_penalty(z: Tensor, hard: bool = False) -> Tensor:
    """Per-key log keep-probability ``[B, Hkv, T]`` float32 once the key has left the window: ``logsigmoid(-z[k+1])``
    (``hard``: ``-inf`` iff ``z[k + 1] > 0``, else 0); the last key (no decision yet) gets 0."""
    decision = shift_left(z.float(), float("-inf"))  # [B, H, T]: decision logit of key k (the last key: keep)
    if hard:
        return torch.where(decision > 0, torch.full_like(decision, float("-inf")), torch.zeros_like(decision))
    return F.logsigmoid(-decision)


def dms_bias(z: Tensor, sinks: int, window: int, hard: bool = False) -> Tensor:
    """Additive attention bias ``[B, Hkv, T, T]`` float32 from the (relaxed) logits ``z [B, Hkv, T]`` produced at
    each token (see the module docstring; the shift by one is applied here)."""
    T = z.shape[-1]
    penalty = dms_penalty(z, hard)
    t = torch.arange(T, device=z.device)
    q, k = t[:, None], t[None, :]
    causal = k <= q
    evictable = causal & (k >= sinks) & (q - k >= window)  # [T, T]
    bias = torch.where(evictable, penalty[:, :, None, :], torch.zeros((), device=z.device))
    return bias.masked_fill(~causal, float("-inf"))


def _causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def penalty_channel_inputs(query: Tensor, key: Tensor, value: Tensor, penalty: Tensor, sinks: int, window: int,
                           scale: float) -> tuple[Tensor, Tensor, Tensor, Callable]:
    """DMS attention as plain masked attention over two copies of the keys, the penalty in one extra key channel.

    ``query [B, Hq, T, D]``, ``key``/``value [B, Hkv, T, D]``, ``penalty [B, Hkv, T]`` (:func:`dms_penalty`, finite:
    soft mode), ``scale`` the attention's (the caller must pass it: the widened head would change the default).
    Returns ``query' [B, Hq, T, D + 1] = [query, 1]``, ``key' [B, Hkv, 2T, D + 1]`` (copy 0: ``[key, 0]``, copy 1:
    ``[key, penalty / scale]``), ``value' [B, Hkv, 2T, D] = [value; value]`` and ``mask_mod(b, h, q, kv)``: copy 0
    holds the keys the bias leaves alone (causal and, for ``k = kv``, a sink or inside the window, ``q - k < window``),
    copy 1 those it penalises (``k = kv - T >= sinks`` and ``q - k >= window``). Every causal key is visible in exactly
    one copy, with score ``scale * q.k`` in copy 0 and ``scale * q.k + penalty[k]`` in copy 1, so one softmax over the
    ``2T`` keys is :func:`dms_bias`'s attention, and the penalty's gradient comes through the extra channel's key
    gradient (the sum of the score gradients over the queries that penalise the key), not through a captured
    buffer. In bf16 the channel rounds ``penalty / scale`` to 8 significant bits (a relative 0.4% of the penalty)."""
    T = key.shape[2]
    ones = torch.ones(*query.shape[:-1], 1, dtype=query.dtype, device=query.device)
    query2 = torch.cat([query, ones], dim=-1)
    channel = torch.cat([torch.zeros_like(penalty), penalty / scale], dim=-1).to(key.dtype)  # [B, Hkv, 2T]
    key2 = torch.cat([torch.cat([key, key], dim=2), channel[..., None]], dim=-1)
    value2 = torch.cat([value, value], dim=2)

    return query2, key2, value2, channel_mask_mod(T, sinks, window)


def channel_mask_mod(T: int, sinks: int, window: int) -> Callable:
    """``mask_mod(b, h, q, kv)`` over the ``2T`` keys of :func:`penalty_channel_inputs`: copy 0 (``kv < T``) the
    causal keys the bias leaves alone, copy 1 the ones it penalises."""

    def mask_mod(b, h, q_idx, kv_idx):
        first = kv_idx < T
        k = torch.where(first, kv_idx, kv_idx - T)
        causal = k <= q_idx
        kept = (k < sinks) | (q_idx - k < window)
        return causal & torch.where(first, kept, ~kept)

    return mask_mod


@functools.lru_cache(maxsize=8)
def channel_block_mask(T: int, sinks: int, window: int, device: str):
    """The BlockMask of :func:`channel_mask_mod` (batch- and head-independent), built once per ``(T, sinks, window,
    device)`` instead of once per layer and step."""
    from torch.nn.attention.flex_attention import create_block_mask

    return create_block_mask(channel_mask_mod(T, sinks, window), None, None, T, 2 * T, device=device)


def resolve_backend(backend: str, device_type: str, hard: bool) -> str:
    """The execution :func:`dms_attention` runs for ``backend`` on a ``device_type`` (``"cuda"``, ``"cpu"``, ...):
    ``"auto"`` is ``"flex_channel"`` on CUDA and ``"dense"`` elsewhere (FlexAttention has no CPU backward); hard
    logits (penalty ``-inf``, which a key channel cannot carry) take the score_mod where the channel was asked."""
    check(backend in BACKENDS, f"backend={backend!r} is invalid: expected one of {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = "flex_channel" if device_type == "cuda" else "dense"
    if backend == "flex_channel" and hard:
        backend = "flex"
    return backend


def dms_attention(query: Tensor, key: Tensor, value: Tensor, z: Tensor, sinks: int, window: int,
                  scale: float | None = None, hard: bool = False, backend: str = "auto") -> Tensor:
    """Causal GQA attention with DMS's delayed soft eviction: ``query [B, Hq, T, D]``, ``key``/``value [B, Hkv, T,
    D]``, ``z [B, Hkv, T]`` (relaxed logits produced at each token); returns ``[B, Hq, T, D]``. Query head ``h`` reads
    KV head ``h // (Hq / Hkv)`` (transformers' ``repeat_kv`` order) and its penalty. ``backend``: ``"dense"`` (the
    bias materialised), ``"flex"`` (the score_mod), ``"flex_channel"`` (the penalty channel,
    :func:`penalty_channel_inputs`; ``hard`` logits, whose penalty is ``-inf``, take the score_mod),
    ``"dense_channel"`` (the penalty channel with a dense mask: the CPU check of the channel's gradients), ``"auto"``
    (flex_channel on CUDA, dense elsewhere); an unknown ``backend`` is a one-line error (:func:`resolve_backend`)."""
    b, hq, T, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    backend = resolve_backend(backend, query.device.type, hard)
    scale = d ** -0.5 if scale is None else scale
    if backend in ("flex_channel", "dense_channel"):
        q2, k2, v2, mask_mod = penalty_channel_inputs(query, key, value, dms_penalty(z, hard), sinks, window, scale)
        if backend == "dense_channel":
            t = torch.arange(T, device=query.device)
            mask = mask_mod(None, None, t[:, None], torch.arange(2 * T, device=query.device)[None, :])
            return F.scaled_dot_product_attention(q2, k2, v2, attn_mask=mask, scale=scale, enable_gqa=g > 1)
        from ..ops.flex import flex_attention_lse

        block_mask = channel_block_mask(T, sinks, window, str(query.device))
        out, _ = flex_attention_lse(q2, k2, v2, block_mask=block_mask, scale=scale, enable_gqa=g > 1,
                                    return_lse=False)
        return out
    if backend == "flex":
        from torch.nn.attention.flex_attention import create_block_mask

        from ..ops.flex import flex_attention_lse

        penalty = dms_penalty(z, hard)  # [B, Hkv, T] float32

        def score_mod(score, bi, hi, q_idx, kv_idx):
            evict = (kv_idx >= sinks) & (q_idx - kv_idx >= window)
            return torch.where(evict, score + penalty[bi, hi // g, kv_idx], score)

        block_mask = create_block_mask(_causal, None, None, T, T, device=query.device)
        out, _ = flex_attention_lse(query, key, value, score_mod=score_mod, block_mask=block_mask, scale=scale,
                                    enable_gqa=g > 1, return_lse=False)
        return out
    bias = dms_bias(z, sinks, window, hard=hard)  # [B, Hkv, T, T]
    qf = query.reshape(b, hkv, g * T, d)  # the g query heads of a KV head share its bias
    bf = bias[:, :, None].expand(b, hkv, g, T, T).reshape(b, hkv, g * T, T).to(query.dtype)
    return F.scaled_dot_product_attention(qf, key, value, attn_mask=bf, scale=scale).reshape(b, hq, T, d)


@dataclass
class DMSRecord:
    """One layer of one forward: ``alpha`` raw gate logits ``[B, Hkv, T]`` (differentiable in the gate), ``z`` the
    relaxed logits used by the attention, ``decisions [B, Hkv, T-1]`` (straight-through; key ``k`` <- token
    ``k + 1``)."""

    alpha: Tensor
    z: Tensor
    decisions: Tensor


class DMSTrainForward:
    """Per-forward state of the DMS training attention (make one per forward; nothing is kept on modules). A plain
    class, not a dataclass: FSDP's forward hooks rebuild the dataclasses and dicts in module arguments, and the
    layers would record into copies (see ``kvlearn.kvpop.train_attention.TrainForward``).

    ``hard``: the inference rule (``alpha > 0``, no noise, no budget). ``backend``: see :func:`dms_attention`. ``noise``: Gumbel noise in soft mode (off:
    deterministic ``sigmoid(alpha / tau)``). ``generator``: CPU generator of the noise (seeded per step by the
    trainer). ``keep_mask``: tests only, ``fn(alpha [B, Hkv, T]) -> bool [B, Hkv, T, T]`` replacing the rule by an
    independent reference (the decisions of the same logits)."""

    def __init__(self, config: DMSConfig, hard: bool = False, noise: bool = True,
                 generator: torch.Generator | None = None, keep_mask: Callable[[Tensor], Tensor] | None = None,
                 backend: str = "auto") -> None:
        self.config, self.hard, self.noise, self.generator = config, hard, noise, generator
        self.keep_mask, self.backend = keep_mask, backend
        self.records: dict[int, DMSRecord] = {}

    def __repr__(self) -> str:
        return f"DMSTrainForward(hard={self.hard}, noise={self.noise}, layers recorded={sorted(self.records)})"

    def add_gate(self, layer_idx: int, alpha: Tensor) -> None:
        """Record layer ``layer_idx``'s gate logits ``alpha [B, Hkv, T]`` (called by the gate hook)."""
        if self.hard or self.keep_mask is not None:
            z = alpha
            decisions = (alpha[..., 1:] > 0).float()
        else:
            noisy = alpha
            if self.noise:
                noisy = alpha + logistic_noise(alpha.shape, self.generator, alpha.device)
            z = noisy / self.config.tau
            probs = torch.sigmoid(z[..., 1:])
            decisions = (probs > 0.5).float() - probs.detach() + probs
        self.records[layer_idx] = DMSRecord(alpha, z, decisions)


def compression_loss(records: dict[int, DMSRecord], target: float,
                     scope: str = "model") -> tuple[Tensor, float, Tensor]:
    """``(loss, closed, per_head)``: the one-sided hinge on the closed fraction, the mean straight-through decision
    over keys. ``scope="model"`` (the reference): ``mean_b clamp(target - closed_b, min=0)`` with ``closed_b`` over
    the layers, KV heads and keys of row ``b`` (a head over the target pays for one under it). ``scope="head"``:
    ``mean_{b,l,h} clamp(target - closed_{b,l,h}, min=0)``, each layer's KV head held to the target on its own.
    ``closed`` is the batch mean over the model either way (a float); ``per_head`` the detached closed fractions
    ``[layers, B, Hkv]`` (layers in index order), for the trainer's log."""
    check(len(records) > 0, "compression_loss: no DMS gate ran in this forward (apply_dms first)")
    check(scope in DMS_COMPRESSION_SCOPES, f"scope={scope!r} is invalid: expected one of {', '.join(DMS_COMPRESSION_SCOPES)}")
    per_head = torch.stack([r.decisions.float().mean(dim=2) for _, r in sorted(records.items())])  # [L, B, Hkv]
    closed = per_head.mean(dim=(0, 2))  # [B]: every layer has the same heads and keys, so this is the row's mean
    gap = (target - closed) if scope == "model" else (target - per_head)
    loss = torch.clamp(gap, min=0).mean()
    return loss, float(closed.detach().mean()), per_head.detach()


def dms_train_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                        attention_mask: Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                        dms_train: DMSTrainForward | None = None, **kwargs):
    """Attention function (transformers' signature): ``query [B, Hq, T, D]``, ``key``/``value [B, Hkv, T, D]``
    (post-RoPE, the whole sequence, no cache, no padding); returns ``(out [B, T, Hq, D], None)``. Without
    ``dms_train`` it is transformers' SDPA attention unchanged."""
    if dms_train is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    check(isinstance(dms_train, DMSTrainForward),
          f"dms_train of type {type(dms_train).__name__} is invalid: expected a DMSTrainForward")
    check(key.shape[2] == query.shape[2],
          f"the DMS training attention needs the whole sequence in one forward (keys {key.shape[2]}, queries "
          f"{query.shape[2]}): call it without a cache")
    query, key, value = autocast_qkv(query, key, value)
    rec = dms_train.records.get(module.layer_idx)
    check(rec is not None, "the DMS training attention found no gate logits: apply_dms(model, config) first")
    cfg = dms_train.config
    b, hq, T, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    if dms_train.keep_mask is None:
        out = dms_attention(query, key, value, rec.z, cfg.sinks, cfg.window, scale=scaling, hard=dms_train.hard,
                            backend=dms_train.backend)
        return out.transpose(1, 2).contiguous(), None
    keep = dms_train.keep_mask(rec.alpha.detach())  # [B, Hkv, T, T]
    bias = torch.zeros(keep.shape, dtype=torch.float32, device=query.device).masked_fill(~keep, float("-inf"))
    # GQA: query head h reads KV head h // g (transformers' repeat_kv order); the g heads of a group share the bias
    qf = query.reshape(b, hkv, g * T, d)
    bf = bias[:, :, None].expand(b, hkv, g, T, T).reshape(b, hkv, g * T, T).to(query.dtype)
    out = F.scaled_dot_product_attention(qf, key, value, attn_mask=bf, scale=scaling).reshape(b, hq, T, d)
    return out.transpose(1, 2).contiguous(), None


def use_train_attention(model):
    """Register ``"dms_train"`` (idempotent) and switch ``model`` to it; returns ``model``. A forward without the
    ``dms_train`` keyword stays plain SDPA attention."""
    AttentionInterface.register(TRAIN_ATTENTION, dms_train_attention)
    AttentionMaskInterface.register(TRAIN_ATTENTION, sdpa_mask)
    model.set_attn_implementation(TRAIN_ATTENTION)
    return model
