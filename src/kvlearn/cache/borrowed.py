"""Cross-layer sharing in a cache: a layer that keeps nothing and reads its anchor layer's store.

KV-Kaizen's depth axis: a *sharing* layer attends with the keys/values of its *anchor* (the nearest earlier layer
that keeps its own cache). In a cache it is a :class:`BorrowedLayer`: no buffers (0 allocated bytes), the anchor's
tokens seen and mask sizes, the anchor's visibility mask. Its ``update`` writes nothing and hands back the keys and
values it was given, which the attention function ignores: it attends with the anchor's K/V of the same forward,
taken from the per-forward anchor dictionary (ARCHITECTURE rule 6; :mod:`kvlearn.kaizen.sharing`), i.e. exactly the
tensors the anchor read from its store, so nothing is read or dequantized twice. :class:`BorrowedStore` is the
store view (:meth:`read` reads the anchor's store) for code that inspects stores.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from ..errors import KVLearnError, check
from .store import Store


class BorrowedStore(Store):
    """A view of another layer's store: reads it, owns nothing, cannot be written."""

    def __init__(self, anchor: Store) -> None:
        self.anchor = anchor

    def allocate(self, *args, **kwargs) -> None:
        raise KVLearnError("a borrowed store owns no buffers: its anchor layer allocates them")

    def write(self, *args, **kwargs) -> None:
        raise KVLearnError("a borrowed store cannot be written: only its anchor layer writes")

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.anchor.read()

    def allocated_bytes(self) -> int:
        return 0

    def bytes_per_token(self) -> int:
        return 0

    @property
    def shape(self):
        return self.anchor.shape


class BorrowedLayer(CacheLayerMixin):
    """The cache layer of a sharing layer: reads ``anchor`` (a :class:`~kvlearn.cache.CompactLayer` of an earlier
    layer, updated earlier in every forward)."""

    is_sliding = False
    supports_early_init = False
    borrows = True

    def __init__(self, anchor) -> None:
        super().__init__()
        check(not getattr(anchor, "borrows", False), "a sharing layer's anchor must keep its own cache, not share")
        self.anchor = anchor
        self.store = BorrowedStore(anchor.store)
        self.trace = None

    @property
    def policy(self):
        return self.anchor.policy

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write nothing; return ``key_states, value_states`` unchanged (the attention function uses the anchor's)."""
        check(self.anchor.is_initialized, "a sharing layer was updated before its anchor layer: anchors come first")
        self.is_initialized = True
        return key_states, value_states

    def visibility_mask(self, query_positions: torch.Tensor, has_padding: bool | None = None) -> torch.Tensor:
        """The anchor's mask of its last update (the same keys)."""
        return self.anchor.visibility_mask(query_positions, has_padding)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.anchor.get_mask_sizes(query_length)

    def get_seq_length(self) -> int:
        return self.anchor.get_seq_length()

    def get_max_length(self) -> int:
        return self.anchor.get_max_length()

    def allocated_bytes(self) -> int:
        return 0

    def chunk_bytes(self, chunk: int) -> int:
        return 0

    def reset(self) -> None:
        self.is_initialized = False

    def _unsupported(self, *args, **kwargs):
        raise KVLearnError("a sharing cache layer does not support beam search, cropping or batch reordering")

    reorder_cache = crop = batch_repeat_interleave = batch_select_indices = _unsupported
