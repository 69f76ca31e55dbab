"""The store half of a compact cache layer: preallocated per-head buffers and nothing else.

A store holds ``capacity`` slots per (batch row, KV head). It knows nothing about positions or eviction: it writes
tokens into slots and reads every slot back in the compute dtype. The interface is what a packed-integer store
(KIVI, KV-Kaizen: ``write`` quantizes, ``read`` dequantizes) or a latent store (MLA: ``k_dim``/``v_dim`` are the
latent widths, ``read`` returns the latents the attention expands) implements in the same way.

- :meth:`Store.allocate` ``(batch, kv_heads, capacity, k_dim, v_dim, dtype, device)``: once, at the first update.
- :meth:`Store.write` ``(slots [batch, kv_heads, q] int64 (-1 = skip), k [batch, kv_heads, q, k_dim], v [...,
  v_dim])``: in place. With ``q == 1`` (decoding) a fixed-shape gather/``scatter_``: no host sync, no data-dependent
  shape, so the step can be compiled and captured in a CUDA graph.
- :meth:`Store.read` ``-> (k [batch, kv_heads, capacity, k_dim], v [..., v_dim])`` in the compute dtype.
- :meth:`Store.allocated_bytes`: bytes of the buffers.
- :attr:`Store.read_is_view`: True when ``read`` returns the live buffers themselves (no copy); only then does the
  layer expose them as transformers' ``layer.keys``/``layer.values`` (otherwise those stay None, so no dequantized
  copy outlives a forward).
- :meth:`Store.round_trip` ``(k, v) -> (k, v)``: the new tokens as ``read`` would give them back once written
  (identity for a plain store; quantize + dequantize for a packed one). A layer built with
  ``attend_stored_form=True`` attends the chunk of a multi-token forward in that form, so a prefill attends exactly
  what training with fake-quantized K/V attends.
- :attr:`Store.requires_append_only`: the store's layout needs slots written in position order and never
  overwritten (KIVI's token groups); a layer refuses to join it to a policy that is not ``append_only``.
- :meth:`Store.read_prefix` ``(length) -> (k [batch, kv_heads, length, k_dim], v [...])``: the first ``length`` slots
  as :meth:`read` gives them (default: ``read`` sliced; a packed store dequantizes only those slots).
- :attr:`Store.write_read_exact`: a write followed by a read gives back exactly :meth:`round_trip` of what was
  written, whatever else the store holds (per-vector quantization: true for the plain and packed stores; not for
  KIVI, whose token groups and full-precision window depend on the neighbours). Then a keep-all layer that attends
  the stored form may write a chunk first and attend the store's filled prefix (``CompactLayer.writes_in_place``).

:class:`PlainStore` keeps the model dtype; :class:`kvlearn.cache.packed.PackedStore` keeps packed integer codes.
"""

from __future__ import annotations

import torch

from ..errors import check


def scatter_slots(buf: torch.Tensor, slots: torch.Tensor, src: torch.Tensor) -> None:
    """Write ``src [batch, P, q, *rest]`` into ``buf [batch, P, capacity, *rest]`` at ``slots [batch, P, q]``
    (int64, ``-1`` = skip), in place.

    No host sync and no data-dependent shape, for any ``q``: one ``scatter_`` of ``q`` rows. The slots written in one
    call must be distinct (every caller's are: a policy gives each survivor its own slot). ``q == 1`` is the decode
    path: a skipped row rewrites the slot's own value. With ``q > 1`` a skipped token writes the first kept token's
    value into that token's slot (a duplicate index with the same value, so whichever write lands the result is the
    same), or, in a (batch, P) row that keeps none, slot 0's own value into slot 0. Cost ``O(q)`` rows, not the
    capacity (a keep-all store of 131k slots takes chunks of 4096). Before session 34 the multi-token write indexed
    the survivors with ``nonzero``: four host syncs per layer and forward (keys, values, positions, scores), which
    serialised the host's launches with the GPU's work in a chunked prefill."""
    rest = buf.shape[3:]
    b, p, q = slots.shape
    view = (b, p, q) + (1,) * len(rest)
    full = (b, p, q) + tuple(rest)
    keep = slots >= 0
    if q == 1:
        idx = slots.clamp(min=0).view(view).expand(full)
        buf.scatter_(2, idx, torch.where(keep.view(view), src.to(buf.dtype), torch.gather(buf, 2, idx)))
        return
    first = keep.to(torch.int64).argmax(dim=2, keepdim=True)  # [b, p, 1]: the first kept token (0 when none)
    first_slot = torch.gather(slots, 2, first).clamp(min=0)  # its slot (0 when none)
    token = torch.where(keep, torch.arange(q, device=slots.device).expand(b, p, q), first)
    target = torch.where(keep, slots, first_slot).view(view).expand(full)
    values = torch.gather(src.to(buf.dtype).expand(full), 2, token.view(view).expand(full))
    none_kept = ~keep.any(dim=2, keepdim=True)  # [b, p, 1]
    values = torch.where(none_kept.view((b, p, 1) + (1,) * len(rest)), torch.gather(buf, 2, target), values)
    buf.scatter_(2, target, values)


class Store:
    """Interface of a store (see the module docstring)."""

    read_is_view = False
    requires_append_only = False
    write_read_exact = False

    def round_trip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``k, v [batch, kv_heads, q, dim]`` as :meth:`read` returns them after a write (default: unchanged)."""
        return k, v

    def allocate(self, batch: int, kv_heads: int, capacity: int, k_dim: int, v_dim: int, dtype, device) -> None:
        raise NotImplementedError  # pragma: no cover

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        raise NotImplementedError  # pragma: no cover

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError  # pragma: no cover

    def read_prefix(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` slots as :meth:`read` gives them (module docstring)."""
        k, v = self.read()
        return k[:, :, :length], v[:, :, :length]

    def allocated_bytes(self) -> int:
        raise NotImplementedError  # pragma: no cover

    def attends_decode(self) -> bool:
        """Whether a decode step attends inside the store (:meth:`decode_attention`) instead of over :meth:`read`'s
        tensors (default: no)."""
        return False

    def decode_attention(self, query: torch.Tensor, visible: torch.Tensor, scale: float | None) -> torch.Tensor:
        """One-token attention over the stored slots: ``query [batch, q_heads, head_dim]``, ``visible`` bool
        ``[batch, kv_heads or 1, capacity]``; ``[batch, q_heads, head_dim]`` float32. Only where
        :meth:`attends_decode`."""
        raise NotImplementedError  # pragma: no cover

    def bytes_per_token(self) -> int:
        """Bytes one token takes in one KV head (for :meth:`CompactCache.peak_bytes`)."""
        raise NotImplementedError  # pragma: no cover

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        """``(batch, kv_heads, capacity, k_dim, v_dim)``."""
        raise NotImplementedError  # pragma: no cover


class PlainStore(Store):
    """K/V in the model dtype: ``keys [batch, kv_heads, capacity, k_dim]``, ``values [..., v_dim]``."""

    read_is_view = True
    write_read_exact = True

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def allocate(self, batch, kv_heads, capacity, k_dim, v_dim, dtype, device) -> None:
        self.keys = torch.zeros(batch, kv_heads, capacity, k_dim, dtype=dtype, device=device)
        self.values = torch.zeros(batch, kv_heads, capacity, v_dim, dtype=dtype, device=device)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        check(self.keys is not None, "store.write() called before allocate()")
        scatter_slots(self.keys, slots, k)
        scatter_slots(self.values, slots, v)

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys, self.values

    def allocated_bytes(self) -> int:
        if self.keys is None:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.keys, self.values))

    def bytes_per_token(self) -> int:
        return (self.keys.shape[-1] + self.values.shape[-1]) * self.keys.element_size()

    @property
    def shape(self):
        b, h, c, dk = self.keys.shape
        return b, h, c, dk, self.values.shape[-1]
