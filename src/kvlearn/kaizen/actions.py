"""KV-Kaizen's per-layer action space and its cost in bits per token (``docs/DESIGN.md``, section 8).

The paper's section 2.2 (the action space and the cost equations) is missing from our copy; this is our design
from what the rest of the paper states (its Table 5 ranges and the section 4 factors are reproduced by it, tested).

A layer takes exactly one :class:`LayerAction`:

- **precision** ``bits`` in {2, 4, 8, 16}: the layer's cache is held at ``bits`` with the symmetric per-vector
  quantizer of :mod:`kvlearn.ops.quant` (16 = the model dtype, no quantization);
- **rank** ``rank = d`` in {r/8, r/4, r/2, r}: the MLA latent truncated to its first ``d`` coordinates (only on an
  MLA backbone, latent width ``r``; ``None`` = the full latent, or a GQA layer);
- **share** (depth): the layer keeps no cache and attends with the keys/values of its *anchor*, the nearest earlier
  layer that keeps its own; layer 0 always keeps its own.

Precision and rank compose (16 actions on MLA); ``share`` is one more action (17 in all: the paper's count).

Cost of one token in one layer, in bits (``σ`` = scale bits, one scale per stored vector):

- GQA (``n_kv`` heads of ``d_h``), ``b`` bits: ``2 n_kv d_h b`` codes + ``2 n_kv σ`` metadata if ``b < 16``;
- MLA, width ``d`` and RoPE key ``d_R``: ``(d + d_R) b`` codes + ``2 σ`` metadata if ``b < 16`` (the latent and
  the positional key are two stored vectors, quantized at the same bit-width);
- share: 0.

The reference is the uncompressed bf16 GQA cache, ``C_ref = L · 2 n_kv d_h · 16`` bits per token (on an MLA backbone,
the GQA model it was converted from), and the realised compression of a configuration is ``ρ = C_ref / Σ_l c_l``.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from ..errors import check, check_int, is_int
from ..ops.quant import BITS

AXES = ("precision", "rank", "depth")
"""The compression axes: precision (bits), rank (MLA latent width), depth (cross-layer sharing)."""

REFERENCE_BITS = 16
"""The reference cache's element width (bf16)."""


@dataclass(frozen=True)
class Backbone:
    """The cache dimensions of a model.

    Attributes:
        num_layers: ``L``, decoder layers.
        kv_heads: ``n_kv``, KV heads per layer of the GQA model (for an MLA backbone: of the model it was converted
            from, which defines the reference cost).
        head_dim: ``d_h``.
        mla_rank: ``r``, the MLA latent width (``None``: a GQA backbone, no rank axis). Divisible by 8.
        rope_dim: ``d_R``, the MLA decoupled RoPE key width (MLA only; the paper uses 64).
        scale_bits: ``σ``, bits of one quantization scale (16: a bf16 scale).
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    mla_rank: int | None = None
    rope_dim: int = 0
    scale_bits: int = 16

    def __post_init__(self) -> None:
        check_int("num_layers", self.num_layers, 1)
        check_int("kv_heads", self.kv_heads, 1)
        check_int("head_dim", self.head_dim, 1)
        check_int("scale_bits", self.scale_bits, 1)
        if self.mla_rank is None:
            check(self.rope_dim == 0, f"rope_dim={self.rope_dim!r} is invalid without an MLA latent: expected 0")
        else:
            check(is_int(self.mla_rank) and self.mla_rank >= 8 and self.mla_rank % 8 == 0,
                  f"mla_rank={self.mla_rank!r} is invalid: expected a positive multiple of 8 (widths r/8 .. r)")
            check_int("rope_dim", self.rope_dim, 0)

    @classmethod
    def from_config(cls, model_config, scale_bits: int = 16) -> "Backbone":
        """The backbone of a transformers config: GQA (``num_key_value_heads``, ``head_dim``), or MLA when the config
        has ``kv_lora_rank`` (DeepSeek naming; ``qk_rope_head_dim`` is ``d_R``)."""
        heads = model_config.num_attention_heads
        kv = getattr(model_config, "num_key_value_heads", None) or heads
        head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
        rank = getattr(model_config, "kv_lora_rank", None)
        rope = getattr(model_config, "qk_rope_head_dim", 0) if rank is not None else 0
        return cls(model_config.num_hidden_layers, kv, head_dim, rank, rope, scale_bits)

    @classmethod
    def from_model(cls, model, scale_bits: int = 16) -> "Backbone":
        """The backbone of a loaded model: :meth:`from_config`, checked against its attention modules (an MLA
        backbone exactly when :func:`kvlearn.kaizen.mla.convert_to_mla` converted it, so rank actions are valid)."""
        from .mla import is_mla

        backbone = cls.from_config(model.config, scale_bits)
        converted = is_mla(model)
        check(backbone.is_mla == converted,
              f"the model's config says {'MLA' if backbone.is_mla else 'GQA'} (kv_lora_rank="
              f"{getattr(model.config, 'kv_lora_rank', None)}) but its attention modules are "
              f"{'MLA' if converted else 'GQA'}: convert it with kvlearn.kaizen.mla.convert_to_mla")
        return backbone

    def check_model(self, model_config) -> None:
        """One-line error unless this backbone has the layers, KV heads, head dim and latent of ``model_config``."""
        theirs = Backbone.from_config(model_config)
        ours = (self.num_layers, self.kv_heads, self.head_dim, self.mla_rank)
        got = (theirs.num_layers, theirs.kv_heads, theirs.head_dim, theirs.mla_rank)
        check(ours == got, f"the KV-Kaizen configuration is for (layers, kv_heads, head_dim, mla_rank) = {ours}, the "
                           f"model has {got}: build it with Backbone.from_config(model.config)")
        check(self.rope_dim == theirs.rope_dim, f"the KV-Kaizen configuration's MLA RoPE key width rope_dim="
                                                f"{self.rope_dim} differs from the model's {theirs.rope_dim}: build it "
                                                "with Backbone.from_model(model)")

    @property
    def is_mla(self) -> bool:
        return self.mla_rank is not None

    @property
    def widths(self) -> tuple[int, ...]:
        """The latent widths of the rank axis, ``(r/8, r/4, r/2, r)`` (empty for GQA)."""
        r = self.mla_rank
        return () if r is None else (r // 8, r // 4, r // 2, r)

    @property
    def reference_bits(self) -> int:
        """``C_ref = L · 2 n_kv d_h · 16``: bits per token of the uncompressed bf16 GQA cache, all layers."""
        return self.num_layers * 2 * self.kv_heads * self.head_dim * REFERENCE_BITS


@dataclass(frozen=True)
class LayerAction:
    """One layer's cache choice.

    ``LayerAction(bits=b, rank=d)`` keeps the layer's own cache at ``b`` bits (and, on MLA, latent width ``d``;
    ``None`` = full); ``LayerAction.shared()`` inherits the anchor's cache. Backbone-dependent checks (a rank on a
    GQA backbone, a width not in {r/8, r/4, r/2, r}) are made by :class:`KaizenConfig`.
    """

    bits: int = 16
    rank: int | None = None
    share: bool = False

    def __post_init__(self) -> None:
        check(is_int(self.bits) and self.bits in BITS,
              f"bits={self.bits!r} is invalid: expected one of {', '.join(map(str, BITS))} (16 = no quantization)")
        check(self.rank is None or (is_int(self.rank) and self.rank >= 1),
              f"rank={self.rank!r} is invalid: expected a positive latent width or None (the full latent)")
        check(isinstance(self.share, bool), f"share={self.share!r} is invalid: expected True or False")
        check(not self.share or (self.bits == 16 and self.rank is None),
              f"a shared layer keeps no cache of its own: bits={self.bits}, rank={self.rank} are invalid with "
              "share=True (expected the defaults)")

    @classmethod
    def shared(cls) -> "LayerAction":
        return cls(share=True)

    def __str__(self) -> str:
        if self.share:
            return "share"
        return f"b{self.bits}" + ("" if self.rank is None else f"/d{self.rank}")


def check_action(action: LayerAction, backbone: Backbone, layer: int) -> LayerAction:
    """One-line error unless ``action`` is valid at ``layer`` of ``backbone`` (no share at layer 0; a rank only on
    MLA, one of r/8 .. r)."""
    check(isinstance(action, LayerAction), f"layer {layer}: {action!r} is not a LayerAction")
    check(not (action.share and layer == 0),
          "layer 0 cannot share: it has no earlier anchor (share is valid at layers 1 .. L-1)")
    if action.rank is not None:
        check(backbone.is_mla, f"layer {layer}: rank={action.rank} needs an MLA backbone; this one is GQA "
                               "(convert it to MLA first, or use the precision and depth axes)")
        check(action.rank in backbone.widths, f"layer {layer}: rank={action.rank} is invalid: expected one of "
                                              f"{', '.join(map(str, backbone.widths))} (r={backbone.mla_rank})")
    return action


def action_bits(action: LayerAction, backbone: Backbone, metadata: bool = True) -> int:
    """Bits of one token in one layer under ``action`` (module docstring); ``metadata=False`` leaves out the scales
    (the paper's cost equations exclude them)."""
    if action.share:
        return 0
    b = action.bits
    if backbone.is_mla:
        d = backbone.mla_rank if action.rank is None else action.rank
        codes, vectors = (d + backbone.rope_dim) * b, 2
    else:
        codes, vectors = 2 * backbone.kv_heads * backbone.head_dim * b, 2 * backbone.kv_heads
    return codes + (vectors * backbone.scale_bits if metadata and b < 16 else 0)


def action_space(backbone: Backbone, axes: tuple[str, ...] | None = None) -> tuple[LayerAction, ...]:
    """The per-layer actions of the enabled ``axes`` (a subset of :data:`AXES`; ``None``: every axis of the
    backbone), least compressed first (the
    selector's initial choice), then by decreasing cost; ``share`` last. The rank axis needs an MLA backbone."""
    axes = check_axes(axes, backbone)
    bits = BITS[::-1] if "precision" in axes else (16,)
    ranks = tuple(reversed(backbone.widths)) if "rank" in axes else (None,)
    own = [LayerAction(bits=b, rank=None if d == backbone.mla_rank else d) for b in bits for d in ranks]
    own.sort(key=lambda a: -action_bits(a, backbone, metadata=False))
    return tuple(own) + ((LayerAction.shared(),) if "depth" in axes else ())


def check_share_layers(share_layers, backbone: Backbone) -> tuple[int, ...] | None:
    """One-line error unless ``share_layers`` is ``None`` (every layer but 0 may share) or a collection of distinct
    layer indices in ``[1, L-1]`` (layer 0 has no earlier cache to read); return it as a sorted tuple (or None)."""
    if share_layers is None:
        return None
    L = backbone.num_layers
    try:
        layers = tuple(share_layers)
    except TypeError:
        layers = None
    ok = layers is not None and all(isinstance(l, int) and not isinstance(l, bool) for l in layers)
    check(ok and all(1 <= l < L for l in layers) and len(set(layers)) == len(layers),
          f"share_layers={share_layers!r} is invalid: expected distinct layer indices in [1, {L - 1}] (layer 0 cannot "
          "share: no earlier layer), or None for every one of them")
    return tuple(sorted(layers))


def action_mask(backbone: Backbone, axes: tuple[str, ...] | None = None,
                share_layers=None) -> list[list[bool]]:
    """``[L][A]`` which actions of ``action_space(backbone, axes)`` each layer may take (the selector sets the logits
    of the others to -inf): every action, except ``share`` at layer 0 and, when ``share_layers`` lists layers
    (:func:`check_share_layers`), ``share`` at every layer it does not list."""
    space = action_space(backbone, axes)
    layers = check_share_layers(share_layers, backbone)
    allowed = range(1, backbone.num_layers) if layers is None else layers
    return [[not a.share or l in allowed for a in space] for l in range(backbone.num_layers)]


def check_axes(axes, backbone: Backbone) -> tuple[str, ...]:
    """One-line error unless ``axes`` is a non-empty subset of :data:`AXES` valid on ``backbone``; return it.
    ``None``: every axis the backbone has (rank only on MLA)."""
    if axes is None:
        return AXES if backbone.is_mla else ("precision", "depth")
    axes = tuple(axes)
    bad = [a for a in axes if a not in AXES]
    check(axes and not bad, f"axes={axes!r} is invalid: expected a non-empty subset of {', '.join(AXES)}")
    check("rank" not in axes or backbone.is_mla,
          "axis 'rank' needs an MLA backbone; this one is GQA (expected a subset of precision, depth)")
    return axes


def feasible_range(backbone: Backbone, axes: tuple[str, ...] | None = None, metadata: bool = False,
                   share_layers=None) -> tuple[float, float]:
    """``(ρ_min, ρ_max)``: the least and the most compression reachable with the enabled ``axes`` (and, with depth,
    sharing only at ``share_layers``: :func:`action_mask`).

    ``ρ_min``: every layer at its most expensive allowed action; ``ρ_max``: every layer at its cheapest allowed action
    (``share``, at cost 0, where allowed; layer 0 at the cheapest own-cache action). On an MLA backbone
    ``ρ_min > 1`` (the conversion itself compresses)."""
    space = action_space(backbone, axes)
    mask = action_mask(backbone, axes, share_layers)
    costs = [[action_bits(a, backbone, metadata) for a, ok in zip(space, row) if ok] for row in mask]
    ref = backbone.reference_bits
    return ref / sum(max(c) for c in costs), ref / sum(min(c) for c in costs)


def check_budget(target: float, backbone: Backbone, axes: tuple[str, ...] | None = None, metadata: bool = False,
                 share_layers=None) -> float:
    """One-line error unless the target compression ``target`` (``ρ*``, e.g. 4.0 for a 4x smaller cache) is within
    :func:`feasible_range`; return it as a float."""
    lo, hi = feasible_range(backbone, axes, metadata, share_layers)
    ok = isinstance(target, (int, float)) and not isinstance(target, bool) and math.isfinite(target)
    check(ok and lo * (1 - 1e-9) <= target <= hi * (1 + 1e-9),
          f"target compression {target!r} is outside the feasible range [{lo:.4g}x, {hi:.4g}x] for axes "
          f"{'+'.join(check_axes(axes, backbone))} on this backbone"
          + ("" if share_layers is None or "depth" not in check_axes(axes, backbone) else
             f" with sharing only at layers {','.join(map(str, check_share_layers(share_layers, backbone))) or 'none'}"))
    return float(target)


@dataclass(frozen=True)
class KaizenConfig:
    """A cache configuration: one :class:`LayerAction` per layer of ``backbone``, validated on creation.

    The selector outputs one action index per layer into :func:`action_space`; :meth:`from_indices` turns that into
    a config. Shared layers inherit from :meth:`anchor_of`.
    """

    backbone: Backbone
    actions: tuple[LayerAction, ...] = field(default=())

    def __post_init__(self) -> None:
        check(isinstance(self.backbone, Backbone), f"backbone={self.backbone!r} is not a kaizen Backbone")
        actions = tuple(self.actions)
        object.__setattr__(self, "actions", actions)
        n = self.backbone.num_layers
        check(len(actions) == n, f"{len(actions)} actions given for a backbone of {n} layers: expected one per layer")
        for layer, action in enumerate(actions):
            check_action(action, self.backbone, layer)

    # ----- constructors -----
    @classmethod
    def parse(cls, backbone: Backbone, text: str) -> "KaizenConfig":
        """The configuration ``str`` writes (``"b4 b4 share b8"``: ``b<bits>`` or ``b<bits>/d<rank>`` or ``share`` per
        layer, space-separated); one-line error for any other word or a wrong number of layers."""
        check(isinstance(text, str), f"configuration {text!r} is invalid: expected a string like 'b4 share b8'")
        actions = []
        for word in text.split():
            if word == "share":
                actions.append(LayerAction.shared())
                continue
            bits, _, rank = word.partition("/d")
            check(bits.startswith("b") and bits[1:].isdigit() and (not rank or rank.isdigit()),
                  f"configuration {text!r}: {word!r} is invalid: expected b<bits>, b<bits>/d<rank> or share per layer")
            actions.append(LayerAction(int(bits[1:]), int(rank) if rank else None))
        return cls(backbone, tuple(actions))

    @classmethod
    def static(cls, backbone: Backbone, bits: int = 16, rank: int | None = None) -> "KaizenConfig":
        """The uniform configuration: every layer at ``bits`` (and latent width ``rank``)."""
        return cls(backbone, (LayerAction(bits=bits, rank=rank),) * backbone.num_layers)

    @classmethod
    def evenly_shared(cls, backbone: Backbone, group: int, bits: int = 16) -> "KaizenConfig":
        """Groups of ``group`` consecutive layers, the first of each an anchor at ``bits``, the others sharing."""
        check_int("group", group, 1, backbone.num_layers)
        return cls(backbone, tuple(LayerAction(bits=bits) if l % group == 0 else LayerAction.shared()
                                   for l in range(backbone.num_layers)))

    @classmethod
    def from_indices(cls, backbone: Backbone, indices, axes: tuple[str, ...] | None = None) -> "KaizenConfig":
        """The config of per-layer indices into ``action_space(backbone, axes)`` (the selector's output)."""
        space = action_space(backbone, axes)
        indices = [int(i) for i in indices]
        bad = [i for i in indices if not 0 <= i < len(space)]
        check(not bad, f"action index {bad[0] if bad else ''} is invalid: expected 0 .. {len(space) - 1}")
        return cls(backbone, tuple(space[i] for i in indices))

    @classmethod
    def random(cls, backbone: Backbone, target: float, axes: tuple[str, ...] | None = None, seed: int = 0,
               metadata: bool = False) -> "KaizenConfig":
        """A random configuration meeting the target compression ``target`` (``ρ >= target``), seeded.

        From the least compressed configuration, a random layer moves to a random cheaper action until the budget
        ``C_ref / target`` is met; then, in random order, layers move back to random dearer actions that still fit,
        so the slack left is small. Layer 0 never shares."""
        target = check_budget(target, backbone, axes, metadata)
        rng = random.Random(seed)
        space = action_space(backbone, axes)
        cost = {a: action_bits(a, backbone, metadata) for a in space}
        budget = backbone.reference_bits / target
        L = backbone.num_layers
        allowed = [[a for a in space if not (a.share and l == 0)] for l in range(L)]
        chosen = [space[0]] * L
        total = sum(cost[a] for a in chosen)
        while total > budget * (1 + 1e-12):
            movable = [l for l in range(L) if any(cost[a] < cost[chosen[l]] for a in allowed[l])]
            l = rng.choice(movable)
            new = rng.choice([a for a in allowed[l] if cost[a] < cost[chosen[l]]])
            total += cost[new] - cost[chosen[l]]
            chosen[l] = new
        for l in rng.sample(range(L), L):
            dearer = [a for a in allowed[l] if cost[chosen[l]] < cost[a] <= budget - total + cost[chosen[l]]]
            if dearer:
                new = rng.choice(dearer)
                total += cost[new] - cost[chosen[l]]
                chosen[l] = new
        return cls(backbone, tuple(chosen))

    # ----- structure -----
    def anchor_of(self, layer: int) -> int:
        """The layer whose cache ``layer`` reads: itself, or for a shared layer the nearest earlier own-cache one."""
        check_int("layer", layer, 0, self.backbone.num_layers - 1)
        while self.actions[layer].share:
            layer -= 1
        return layer

    @property
    def anchors(self) -> tuple[int, ...]:
        """The layers that keep their own cache."""
        return tuple(l for l, a in enumerate(self.actions) if not a.share)

    # ----- cost -----
    def layer_bits(self, metadata: bool = True) -> tuple[int, ...]:
        """Bits per token of each layer (0 for a shared layer)."""
        return tuple(action_bits(a, self.backbone, metadata) for a in self.actions)

    def bits_per_token(self, metadata: bool = True) -> int:
        """``Σ_l c_l``: bits of one token over every layer."""
        return sum(self.layer_bits(metadata))

    def compression(self, metadata: bool = True) -> float:
        """Realised compression ``ρ = C_ref / Σ_l c_l`` against the bf16 GQA cache."""
        return self.backbone.reference_bits / self.bits_per_token(metadata)

    def cache_bytes(self, batch: int, tokens: int, dtype_bits: int = 16) -> int:
        """Bytes of the K/V stores of ``batch`` sequences of ``tokens`` slots, metadata included: ``batch · tokens ·
        Σ_l c_l / 8``, where a 16-bit layer is held in the compute dtype of ``dtype_bits`` bits (32 for float32; the
        scales are ``backbone.scale_bits``, which a store keeps in the compute dtype too). The cache's slot
        bookkeeping (positions) comes on top."""
        bits = sum(c * dtype_bits // 16 if not a.share and a.bits == 16 else c
                   for a, c in zip(self.actions, self.layer_bits(metadata=True)))
        return batch * tokens * bits // 8

    def __str__(self) -> str:
        return " ".join(map(str, self.actions))
