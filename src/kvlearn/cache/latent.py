"""The MLA latent store: per token, the latent prefix ``c[:d]`` and the shared decoupled RoPE key ``k_R``.

An MLA layer (:class:`kvlearn.kaizen.mla_attention.MLAAttention`) writes one "KV head" per token through the store
contract (:mod:`kvlearn.cache.store`): ``k = k_R [batch, 1, q, d_R]`` (after RoPE) and ``v = c[:d] [batch, 1, q, d]``.
:class:`LatentStore` is that store at a latent width ``d`` and a bit-width: the model dtype at 16 bits
(:class:`~kvlearn.cache.PlainStore`), packed codes with one scale per stored vector below
(:class:`~kvlearn.cache.PackedStore`: the latent and the RoPE key are two vectors). Bytes per token:
``(d + d_R) x element bytes`` at 16 bits, ``(d + d_R) b / 8 + 2 scales`` below: the cost model of
:func:`kvlearn.kaizen.actions.action_bits` (``(d + d_R) b`` codes + ``2 σ``).
"""

from __future__ import annotations

import torch

from ..errors import check, check_int
from .packed import store_for_bits
from .store import Store


class LatentStore(Store):
    """``rank`` (``d``) latent coordinates + ``rope_dim`` (``d_R``) RoPE-key coordinates per token at ``bits``."""

    def __init__(self, rank: int, rope_dim: int, bits: int = 16) -> None:
        self.rank = check_int("rank", rank, 1)
        self.rope_dim = check_int("rope_dim", rope_dim, 1)
        self.inner = store_for_bits(bits)
        self.bits = bits
        self.read_is_view = self.inner.read_is_view

    def allocate(self, batch, kv_heads, capacity, k_dim, v_dim, dtype, device) -> None:
        check(kv_heads == 1 and k_dim == self.rope_dim and v_dim == self.rank,
              f"LatentStore(d={self.rank}, d_R={self.rope_dim}) got (heads, k_dim, v_dim) = ({kv_heads}, {k_dim}, "
              f"{v_dim}): expected (1, {self.rope_dim}, {self.rank}) (the RoPE key and the latent prefix)")
        self.inner.allocate(batch, kv_heads, capacity, k_dim, v_dim, dtype, device)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.inner.write(slots, k, v)

    def round_trip(self, k, v):
        return self.inner.round_trip(k, v)

    def read(self):
        return self.inner.read()

    def allocated_bytes(self) -> int:
        return self.inner.allocated_bytes()

    def bytes_per_token(self) -> int:
        return self.inner.bytes_per_token()

    @property
    def shape(self):
        return self.inner.shape

    def __getattr__(self, name):  # the inner store's buffers (keys/values, codes/scales) for inspection
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


__all__ = ["LatentStore"]
