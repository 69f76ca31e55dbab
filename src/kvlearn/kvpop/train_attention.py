"""The KVpop training attention: one full-sequence forward under the running top-k of the model's own priorities.

Registered with transformers' ``AttentionInterface`` as ``"kvpop_train"`` (:func:`use_train_attention`). Per
layer, with the forward's :class:`TrainForward` passed as the attention keyword ``kvpop_train``:

1. raw scores ``r̂ [B, Hkv, T]`` from the layer's scorer on the *detached* keys/values (rule 5);
2. static priorities ``p̂ = r̂ - t log γ`` (:func:`~kvlearn.kvpop.policy.static_priorities`, float32);
3. ranks and running cutoffs of ``p̂`` (:func:`~kvlearn.ops.fenwick.running_topk_cutoff`; integers, no gradient);
4. :func:`~kvlearn.ops.retention_attention.sparse_retention_attention` with ``return_lse=True`` (the attention output
   carries the backbone's gradient; the CPU path is the dense-mask twin);
5. the future-attention target from this layer's queries/keys and the *sparse* LSE of step 4 (the approximate
   target of the paper's appendix D.3, Eq. 9/34: the normaliser the sparse pass already computed is reused),
   computed without gradient.

With ``kv_bits`` (per layer a bit-width or ``"share"``, :class:`TrainForward`), steps 4-5 read the layer's keys and values through
the symmetric per-vector quantizer (:func:`kvlearn.ops.quant.fake_quantize`: forward the stored form, backward the
identity), as the ``kaizen+kvpop`` cache stores and attends them at that precision; the scorer (step 1) still writes
its memory from (and a stateless scorer scores) the full-precision keys and values, as that cache's scorer does, while
a delayed mLSTM readout reads each token in its stored form (``read_key``), as the cache reads it back from the store. A student retrofitted so is served at that
precision under its own eviction (a KVpop student that never saw quantized keys loses most where composition
needs it: docs/DESIGN.md section 8, "Composition with eviction"). A ``"share"`` layer keeps no cache: it runs no
scorer, records nothing, and attends its own queries over its anchor's (the nearest earlier own layer's) quantized
keys and values under the anchor's ranks and cutoffs, as a sharing layer of that cache reads its anchor's evicted
store; the anchor's tensors carry the sharing layer's gradient back to the anchor's projections.

With ``scorer_kd`` (:class:`~kvlearn.kvpop.scorer_kd.ScorerKD`), step 4's output also carries, on the sampled
query rows, the straight-through soft retention of :mod:`kvlearn.kvpop.scorer_kd`: the forward is unchanged and the
distillation loss's gradient reaches the priorities (a sharing layer sends none to its anchor's).

Steps 1-2 run with autocast disabled (float32 scores and rankings, rule 5); the attention itself runs in the
model's (or autocast's) dtype.

What a layer computed is recorded on the per-forward :class:`TrainForward` (``records[layer_idx]``), never on the
module. Without ``kvpop_train`` the function is transformers' SDPA attention unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from ..config import KVpopConfig
from ..errors import check
from ..ops.fenwick import running_topk_cutoff
from ..ops.flex import autocast_qkv
from ..ops.future_target import future_attention_target
from ..ops.quant import fake_quantize
from ..ops.retention_attention import sparse_retention_attention
from .policy import static_priorities
from .scorer_kd import ScorerKD, straight_through_retention

__all__ = ["TRAIN_ATTENTION", "LayerRecord", "TrainForward", "kvpop_train_attention", "use_train_attention"]

TRAIN_ATTENTION = "kvpop_train"
SHARE = "share"  # a kv_bits entry: the layer reads its anchor's keys and values (no cache of its own)


@dataclass
class LayerRecord:
    """What one layer's training attention computed (all ``[batch, kv_heads, T]``).

    ``priorities``: float32 student static priorities (differentiable in the scorer and decay parameters only).
    ``target``: float32 future-attention target ``r^tgt`` (detached). ``ranks``, ``cutoffs``: int32 student
    ranks and running top-k cutoffs. ``log_gamma``: ``[kv_heads]`` float32 log-decay (differentiable).
    """

    priorities: Tensor
    target: Tensor
    ranks: Tensor
    cutoffs: Tensor
    log_gamma: Tensor


class TrainForward:
    """Per-forward state of the training attention: the budget (``config``) and, filled by the forward, one
    :class:`LayerRecord` per decoder layer. Make a new one for every forward.

    A plain class on purpose, not a dataclass: FSDP's forward hooks rebuild the dataclasses, dicts and lists they
    find in a module's arguments (to move their tensors), so the layers would fill copies of ``records`` and the
    trainer would see only some of them."""

    def __init__(self, config: KVpopConfig, kv_bits: tuple[int | str, ...] | None = None,
                 scorer_kd: ScorerKD | None = None) -> None:
        self.config = config
        check(scorer_kd is None or isinstance(scorer_kd, ScorerKD),
              f"scorer_kd of type {type(scorer_kd).__name__} is invalid: expected None or a ScorerKD")
        self.scorer_kd = scorer_kd  # the straight-through scorer distillation of this forward (None: off)
        self.kv_bits = None if kv_bits is None else tuple(kv_bits)  # per layer: the attended K/V's precision or "share"
        check(self.kv_bits is None or (len(self.kv_bits) > 0 and self.kv_bits[0] != SHARE),
              f"kv_bits={self.kv_bits!r}: layer 0 cannot share (it has no earlier anchor)")
        self.records: dict[int, LayerRecord] = {}
        self.anchors: dict[int, tuple[Tensor, Tensor, Tensor, Tensor]] = {}  # layer -> (key, value, ranks, cutoffs)

    def bits_of(self, layer_idx: int) -> int | str:
        """The bit-width layer ``layer_idx`` attends its keys and values at (16: unquantized), or ``"share"``."""
        if self.kv_bits is None:
            return 16
        check(0 <= layer_idx < len(self.kv_bits),
              f"kv_bits lists {len(self.kv_bits)} layers, but layer {layer_idx} ran: expected one entry per layer")
        return self.kv_bits[layer_idx]

    def anchor_of(self, layer_idx: int) -> int:
        """The nearest layer at or before ``layer_idx`` that keeps its own cache."""
        while self.bits_of(layer_idx) == SHARE:
            layer_idx -= 1
        return layer_idx

    def keeps_anchor(self, layer_idx: int) -> bool:
        """Whether a later layer shares ``layer_idx``'s keys and values (so this forward keeps them)."""
        return self.kv_bits is not None and layer_idx + 1 < len(self.kv_bits) and self.kv_bits[layer_idx + 1] == SHARE

    def __repr__(self) -> str:
        return f"TrainForward(kv_bits={self.kv_bits}, layers recorded={sorted(self.records)})"


def kvpop_train_attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    kvpop_train: TrainForward | None = None,
    **kwargs,
):
    """Attention function (transformers' signature). ``query [B, Hq, T, D]``, ``key``/``value [B, Hkv, T, D]``
    (post-RoPE, the whole sequence, no cache); returns ``(out [B, T, Hq, D], None)``."""
    if kvpop_train is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    check(isinstance(kvpop_train, TrainForward),
          f"kvpop_train of type {type(kvpop_train).__name__} is invalid: expected a TrainForward")
    check(key.shape[2] == query.shape[2],
          f"the KVpop training attention needs the whole sequence in one forward (keys {key.shape[2]}, queries "
          f"{query.shape[2]}): call it without a cache")
    query, key, value = autocast_qkv(query, key, value)
    kv = getattr(module, "kvpop", None)
    check(kv is not None, "the KVpop training attention needs KVpop modules: call apply_kvpop(model, config) first")
    cfg = kvpop_train.config
    if kvpop_train.bits_of(module.layer_idx) == SHARE:  # the anchor's stored K/V under the anchor's retention
        anchor = kvpop_train.anchor_of(module.layer_idx)
        check(anchor in kvpop_train.anchors,
              f"layer {module.layer_idx} shares layer {anchor}'s cache, which did not run first in this forward")
        a_key, a_value, a_ranks, a_cutoffs = kvpop_train.anchors[anchor]
        out, _ = sparse_retention_attention(query, a_key, a_value, a_ranks, a_cutoffs, cfg.sinks, cfg.window,
                                            scale=scaling, return_lse=False, topk=cfg.topk)
        return out.transpose(1, 2).contiguous(), None
    bits = kvpop_train.bits_of(module.layer_idx)
    stored = (fake_quantize(key, bits), fake_quantize(value, bits)) if bits < 16 else None
    # a delayed stateful readout reads each token back from the store: at this precision, its stored form
    read = {} if stored is None or getattr(kv.scorer, "readout_delay", 0) == 0 else \
        {"read_key": stored[0].detach(), "read_value": stored[1].detach()}
    with torch.autocast(device_type=key.device.type, enabled=False):  # rule 5: scores and rankings in float32
        raw = kv.scorer(key.detach(), value.detach(), **read)  # [B, Hkv, T]; detached: no gradient into the backbone
        log_gamma = kv.decay()  # [Hkv]
        priorities = static_priorities(raw, log_gamma)
    ranks, cutoffs = running_topk_cutoff(priorities.detach(), cfg.sinks, cfg.window, cfg.topk)
    if stored is not None:  # the stored form the cache attends at this precision; straight-through gradients
        key, value = stored
    if kvpop_train.keeps_anchor(module.layer_idx):
        kvpop_train.anchors[module.layer_idx] = (key, value, ranks, cutoffs)
    out, lse = sparse_retention_attention(query, key, value, ranks, cutoffs, cfg.sinks, cfg.window, scale=scaling,
                                          return_lse=True, topk=cfg.topk)
    if kvpop_train.scorer_kd is not None:  # the forward unchanged; the KD gradient also reaches the priorities
        out = straight_through_retention(out, query, key, value, priorities, cutoffs, cfg.sinks, cfg.window, scaling,
                                         kvpop_train.scorer_kd)
    with torch.no_grad():
        target = future_attention_target(query.detach(), key.detach(), lse.detach(), cfg.window, eps=cfg.target_eps,
                                         aggregation=cfg.target_aggregation,
                                         count_normalize=cfg.target_count_normalize, scale=scaling,
                                         reduction=cfg.target_reduction)
    kvpop_train.records[module.layer_idx] = LayerRecord(priorities, target.float(), ranks, cutoffs, log_gamma)
    return out.transpose(1, 2).contiguous(), None


def use_train_attention(model):
    """Register ``"kvpop_train"`` (attention and mask functions, idempotent) and switch ``model`` to it; returns
    ``model``. A forward without the ``kvpop_train`` keyword stays plain SDPA attention."""
    AttentionInterface.register(TRAIN_ATTENTION, kvpop_train_attention)
    AttentionMaskInterface.register(TRAIN_ATTENTION, sdpa_mask)
    model.set_attn_implementation(TRAIN_ATTENTION)
    return model
