"""The compact-cache contract (v2): a layer = a store + a policy (see :mod:`kvlearn.cache.layer`).

- :mod:`~kvlearn.cache.store`: preallocated buffers (``PlainStore``); :mod:`~kvlearn.cache.packed`: ``PackedStore``
  (packed integer codes + one scale per vector).
- :mod:`~kvlearn.cache.policy`: slot choice and eviction (``Policy``, ``SlotPlan``, ``ForwardStep``, ``NEVER``).
- :mod:`~kvlearn.cache.layer`: ``CompactLayer`` (transformers' ``CacheLayerMixin``) and ``CompactCache``.
- :mod:`~kvlearn.cache.scored`: the scored-eviction base (``ScoredPolicy``, ``AttentionScoredPolicy``).
- :mod:`~kvlearn.cache.observe`: the attention handed back to attention-driven policies.
- :mod:`~kvlearn.cache.keepall`: ``KeepAllPolicy`` (no eviction, slot = position);
  :mod:`~kvlearn.cache.borrowed`: ``BorrowedLayer`` (a sharing layer reading its anchor's store);
  :mod:`~kvlearn.cache.kivi`: ``KIVIStore`` (KIVI's grouped quantization with a full-precision window);
  :mod:`~kvlearn.cache.latent`: ``LatentStore`` (an MLA layer's latent prefix + shared RoPE key).
- :mod:`~kvlearn.cache.prefill`: ``prefill(model, cache, ...)`` and ``DEFAULT_PREFILL_CHUNK``.
"""

from .borrowed import BorrowedLayer, BorrowedStore
from .keepall import KeepAllPolicy
from .kivi import KIVIStore
from .latent import LatentStore
from .layer import CompactCache, CompactLayer
from .observe import attention_summary
from .packed import PackedStore, store_for_bits
from .policy import NEVER, AttentionRequest, ChunkRetention, ForwardStep, Policy, SlotPlan
from .prefill import DEFAULT_PREFILL_CHUNK, prefill
from .scored import AttentionScoredPolicy, ScoredPolicy
from .store import PlainStore, Store

__all__ = [
    "NEVER", "AttentionRequest", "AttentionScoredPolicy", "BorrowedLayer", "BorrowedStore", "ChunkRetention",
    "CompactCache", "CompactLayer", "DEFAULT_PREFILL_CHUNK", "ForwardStep", "KIVIStore", "KeepAllPolicy",
    "LatentStore", "PackedStore", "PlainStore", "Policy", "ScoredPolicy", "SlotPlan", "Store", "attention_summary",
    "prefill", "store_for_bits",
]
