"""The heterogeneous KV-Kaizen cache: one transformers ``Cache`` whose layers follow a :class:`KaizenConfig`.

Layer ``l`` with action:

- ``bits = b < 16``: a :class:`~kvlearn.cache.CompactLayer` on a :class:`~kvlearn.cache.PackedStore` ``(b)``
  (packed codes + one model-dtype scale per stored vector);
- ``bits = 16``: the same layer on a :class:`~kvlearn.cache.PlainStore` (the model dtype);
- ``share``: a :class:`~kvlearn.cache.BorrowedLayer` of its anchor (no buffers).

Every own layer runs the no-eviction :class:`~kvlearn.cache.KeepAllPolicy` over ``capacity`` slots (or the policy
``policy_factory(l)`` of layer ``l``: eviction composes with the configuration, as in the paper's section 3.4;
:mod:`kvlearn.kaizen.compose` builds the ``kaizen+snapkv``/``kaizen+kvpop`` caches that way), and attends the chunk
of a multi-token forward as its store reads it back (``attend_stored_form``), so prefill and decoding attend exactly
what a training forward with fake-quantized K/V attends.

``store_bytes()`` (the K/V buffers) equals :meth:`KaizenConfig.cache_bytes` exactly; ``allocated_bytes()`` adds the
slot positions (int32 per slot and own layer: 32 bits per token and layer, 0.4% of a 4-bit layer at 8 KV heads of
128).

On an MLA backbone (a model converted by :func:`kvlearn.kaizen.mla.convert_to_mla`) every own layer is a
:class:`~kvlearn.cache.LatentStore` of width ``d`` (the action's rank, ``r`` by default) and ``d_R`` at ``bits``:
one stored "KV head" per token, ``(d + d_R)`` elements, the cost model's ``(d + d_R) b + 2σ``; a sharing layer is a
``BorrowedLayer`` as on GQA. Not built yet on MLA: evicting policies (refused with a one-line error).
"""

from __future__ import annotations

from typing import Callable

from ..cache import BorrowedLayer, CompactCache, CompactLayer, KeepAllPolicy, LatentStore, Policy, store_for_bits
from ..errors import check, check_int
from .actions import Backbone, KaizenConfig


class KaizenCache(CompactCache):
    """A cache of per-layer stores following ``config`` (module docstring). Run it through
    :func:`kvlearn.kaizen.attach` ed models: ``model.generate(..., past_key_values=cache)``."""

    eviction_factor = 1.0  # context / budget of a composed cache (kvlearn.kaizen.compose); 1.0: every token kept

    def __init__(self, config: KaizenConfig, capacity: int, policy_factory: Callable[[int], Policy] | None = None):
        check(isinstance(config, KaizenConfig), f"config={config!r} is not a KaizenConfig")
        check_int("capacity", capacity, 1)
        backbone = config.backbone
        layers = []
        for l, action in enumerate(config.actions):
            if action.share:
                layers.append(BorrowedLayer(layers[config.anchor_of(l)]))
                continue
            if backbone.is_mla:  # TODO: evicting policies on the latent (they score per KV head; MLA has one)
                check(policy_factory is None, "an MLA backbone keeps every token (KeepAllPolicy): policy_factory is "
                                              "not supported with the rank axis yet (expected None)")
                d = backbone.mla_rank if action.rank is None else action.rank
                store = LatentStore(d, backbone.rope_dim, action.bits)
            else:
                store = store_for_bits(action.bits)
            policy = policy_factory(l) if policy_factory is not None else KeepAllPolicy(capacity)
            layers.append(CompactLayer(policy, store, attend_stored_form=True))
        super().__init__(layers)
        self.config = config
        self.capacity = capacity

    def realised_factor(self) -> float:
        """The cache reduction the harness reports as ``factor``: the configuration's ``C_ref / C`` (no metadata)
        times :attr:`eviction_factor` (``context / budget`` under eviction, :mod:`kvlearn.kaizen.compose`)."""
        return self.config.compression(metadata=False) * self.eviction_factor

    def check_model(self, num_layers: int, model=None) -> None:
        super().check_model(num_layers, model)
        if model is not None:
            self.config.backbone.check_model(model.config)


def make_cache(config: KaizenConfig, model_config, capacity: int,
               policy_factory: Callable[[int], Policy] | None = None) -> KaizenCache:
    """A :class:`KaizenCache` of ``config`` for a model of ``model_config`` (checked against the config's backbone);
    ``capacity`` slots per own layer (prompt + generated tokens); ``policy_factory(l)``: own layer ``l``'s policy."""
    config.backbone.check_model(model_config)
    return KaizenCache(config, capacity, policy_factory)


__all__ = ["Backbone", "KaizenCache", "KaizenConfig", "make_cache"]
