"""A KIVI store (Liu et al., 2024): keys quantized per channel over groups of ``G`` tokens, values per token over
groups of ``G_v`` channels, and a full-precision residual window of recent tokens (``docs/DESIGN.md`` section 8).

Quantizer: :func:`kvlearn.ops.quant.kivi_quantize_keys` / :func:`~kvlearn.ops.quant.kivi_quantize_values`
(asymmetric min/max, ``2^b`` levels, scale and minimum in the model dtype). Residual rule, as KIVI's reference:

- **keys**: tokens are quantized in blocks of ``R`` (``R`` a multiple of ``G``: each block is ``R / G`` groups); a
  row that has written ``n`` tokens holds slots ``[0, ⌊n/R⌋ R)`` quantized and the last ``n mod R`` in full precision
  (the full-precision count cycles 0 .. R-1, and a block is quantized the moment it completes, in G-aligned groups:
  never a one-token group);
- **values**: the last ``min(n, R)`` tokens in full precision, every older one quantized (per token, so quantizing
  each value when written and reading the window over it is the same thing).

Buffers per (batch row, KV head), ``Q = ⌊capacity / R⌋ R`` (slots past ``Q`` never complete a block and stay in the
window): ``key_codes [batch, kv_heads, Q, k_dim·b/8]`` uint8 (codes packed along the channels,
:func:`~kvlearn.ops.quant.pack`), ``key_scale``, ``key_min [batch, kv_heads, Q/G, k_dim]``, ``value_codes [batch,
kv_heads, capacity, v_dim·b/8]``, ``value_scale``, ``value_min [batch, kv_heads, capacity, v_dim/G_v]``, the windows
``key_window``, ``value_window [batch, kv_heads, R, dim]`` (ring buffers: slot ``s`` at ``s mod R``) and ``filled
[batch]`` int64 (tokens written per row). ``allocated_bytes`` is exactly their sum.

**Append-only**: key groups are runs of consecutive slots, so the store needs slots written in position order and
never overwritten (:attr:`requires_append_only`): it serves :class:`~kvlearn.cache.KeepAllPolicy` (a full cache), and
a layer refuses to join it to an evicting policy. Eviction with KIVI would need per-group bookkeeping (a group whose
token is evicted keeps its scale; a later token cannot join it), which is not built. ``read`` dequantizes every slot
into a temporary in the compute dtype (the CPU path, and prefill); on CUDA a decode step attends the codes through
:func:`kvlearn.ops.kivi_decode.kivi_decode_attention` instead (:meth:`KIVIStore.attends_decode`), tiles rebuilt in
registers, as :class:`~kvlearn.cache.PackedStore` does with its kernel.

Decoding (one token) is fixed-shape: write the token's value codes and its window slot, quantize the window as a
block and write it under ``torch.where`` for the rows whose block just completed; no host sync. A multi-token write
(prefill) quantizes the completed blocks of the whole capacity at once.
"""

from __future__ import annotations

import os

import torch

from ..errors import check, check_int
from ..ops.kivi_decode import kivi_decode_attention, kivi_read
from ..ops.packed_decode import fused_decode_applies
from ..ops.quant import QUANT_BITS, check_bits, kivi_quantize_keys, kivi_quantize_values, pack
from .store import Store, scatter_slots


def _block_write(buf: torch.Tensor, start: torch.Tensor, src: torch.Tensor, where: torch.Tensor) -> None:
    """Write ``src [batch, H, n, *rest]`` into ``buf [batch, H, N, *rest]`` at indices ``start + 0..n-1`` (``start
    [batch]``) for the rows where ``where [batch]``; other rows keep their values. Fixed shapes, no host sync."""
    b, h, n = src.shape[:3]
    rest = buf.shape[3:]
    idx = (start[:, None] + torch.arange(n, device=buf.device)).clamp(0, buf.shape[2] - 1)
    idx = idx[:, None, :].view(b, 1, n, *([1] * len(rest))).expand(b, h, n, *rest)
    old = torch.gather(buf, 2, idx)
    keep = where.view(b, *([1] * (buf.dim() - 1)))
    buf.scatter_(2, idx, torch.where(keep, src.to(buf.dtype), old))


class KIVIStore(Store):
    """KIVI's grouped quantization with a full-precision residual window (module docstring).

    Args:
        bits: 2, 4 or 8.
        group_size: ``G``, tokens per key group (per channel).
        residual: ``R``, the window; a multiple of ``G`` (KIVI's requirement).
        value_group_size: ``G_v``, channels per value group (None: ``G``); must divide ``v_dim``.
    """

    requires_append_only = True

    def __init__(self, bits: int = 2, group_size: int = 32, residual: int = 128, value_group_size: int | None = None):
        self.bits = check_bits(bits, QUANT_BITS)
        self.group_size = check_int("group_size", group_size, 1)
        self.residual = check_int("residual", residual, group_size,
                                  hint=f" (KIVI's window is a whole number of key groups of group_size={group_size})")
        check(residual % group_size == 0,
              f"residual={residual} is invalid: expected a multiple of group_size={group_size} (KIVI: R % G == 0)")
        self.value_group_size = check_int("value_group_size", value_group_size or group_size, 1)
        self.dims = None

    # ----- allocation -----
    def allocate(self, batch, kv_heads, capacity, k_dim, v_dim, dtype, device) -> None:
        per_byte = 8 // self.bits
        for name, dim in (("k_dim", k_dim), ("v_dim", v_dim)):
            check(dim % per_byte == 0, f"KIVIStore({self.bits}): {name}={dim} must be divisible by {per_byte}")
        gv = self.value_group_size
        check(v_dim % gv == 0, f"value_group_size={gv} is invalid: it must divide v_dim={v_dim}")
        r, g = self.residual, self.group_size
        q = capacity // r * r
        self.dims, self.dtype, self.capacity, self.quantized_slots = (k_dim, v_dim), dtype, capacity, q
        lead = (batch, kv_heads)
        z = dict(dtype=dtype, device=device)
        self.key_codes = torch.zeros(lead + (q, k_dim // per_byte), dtype=torch.uint8, device=device)
        self.key_scale = torch.zeros(lead + (q // g, k_dim), **z)
        self.key_min = torch.zeros(lead + (q // g, k_dim), **z)
        self.value_codes = torch.zeros(lead + (capacity, v_dim // per_byte), dtype=torch.uint8, device=device)
        self.value_scale = torch.zeros(lead + (capacity, v_dim // gv), **z)
        self.value_min = torch.zeros(lead + (capacity, v_dim // gv), **z)
        self.key_window = torch.zeros(lead + (r, k_dim), **z)
        self.value_window = torch.zeros(lead + (r, v_dim), **z)
        self.filled = torch.zeros(batch, dtype=torch.int64, device=device)

    def _buffers(self) -> tuple[torch.Tensor, ...]:
        return (self.key_codes, self.key_scale, self.key_min, self.value_codes, self.value_scale, self.value_min,
                self.key_window, self.value_window, self.filled)

    def allocated_bytes(self) -> int:
        if self.dims is None:
            return 0
        return sum(t.numel() * t.element_size() for t in self._buffers())

    def bytes_per_token(self) -> int:
        """Allocated bytes per slot and KV head, rounded up (the windows and counters spread over the slots)."""
        b, h = self.value_codes.shape[:2]
        return -(-self.allocated_bytes() // (b * h * self.capacity))

    @property
    def shape(self):
        b, h = self.value_codes.shape[:2]
        return b, h, self.capacity, *self.dims

    # ----- packing -----
    def _pack(self, codes: torch.Tensor) -> torch.Tensor:
        """Unsigned KIVI codes ``[0, 2^b)`` -> packed bytes (``pack`` takes codes biased by ``-2^(b-1)``)."""
        return pack(codes.to(torch.int16) - 2 ** (self.bits - 1), self.bits)

    # ----- write -----
    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """``slots [batch, kv_heads, q]`` (the same in every head; ``-1`` = skip), in position order after the slots
        already written; ``k``, ``v [batch, kv_heads, q, dim]``."""
        check(self.dims is not None, "store.write() called before allocate()")
        k, v = k.to(self.dtype), v.to(self.dtype)
        b, h, q = slots.shape
        r = self.residual
        s = slots[:, 0, :]  # [batch, q]
        n_old = self.filled
        n_new = torch.maximum(n_old, (s + 1).amax(dim=1))
        if q > 1:  # every slot's position order is checked here (prefill: one sync); decoding trusts the policy
            ok = bool(((s < 0) | (s >= n_old[:, None])).all()) and bool((s[:, 1:] > s[:, :-1]).where(
                (s[:, 1:] >= 0) & (s[:, :-1] >= 0), torch.ones_like(s[:, 1:], dtype=torch.bool)).all())
            check(ok, "KIVIStore is append-only: slots must follow the slots already written, in increasing order "
                      "(use it with KeepAllPolicy)")
        # values: quantized per token when written; the window holds the last R in full precision
        codes, scale, minimum = kivi_quantize_values(v, self.bits, self.value_group_size)
        scatter_slots(self.value_codes, slots, self._pack(codes))
        scatter_slots(self.value_scale, slots, scale)
        scatter_slots(self.value_min, slots, minimum)
        if q > 1 and self.quantized_slots > 0:
            self._quantize_key_blocks_multi(slots, k, n_old, n_new)  # before the window moves on
        in_window = (s >= 0) & (s >= n_new[:, None] - r)  # only tokens still in the window (no ring collisions)
        ring = torch.where(in_window, s.remainder(r), torch.full_like(s, -1))[:, None, :].expand(b, h, q)
        scatter_slots(self.key_window, ring, k)
        scatter_slots(self.value_window, ring, v)
        if q == 1 and self.quantized_slots > 0:  # the window is a whole block when n_new is a multiple of R
            done = (n_new > n_old) & (n_new.remainder(r) == 0)
            kc, ks, km = kivi_quantize_keys(self.key_window, self.bits, self.group_size)
            start = (n_new - r).clamp(min=0)
            _block_write(self.key_codes, start, self._pack(kc), done)
            _block_write(self.key_scale, start // self.group_size, ks, done)
            _block_write(self.key_min, start // self.group_size, km, done)
        self.filled = n_new

    def _quantize_key_blocks_multi(self, slots, k, n_old, n_new) -> None:
        """Multi-token write: the full-precision keys of the blocks of ``R`` slots that complete in this write
        (``n_old < (j+1) R <= n_new``: old window + new tokens), quantized and written; only the slots from the
        earliest row's current block to the last completed block are built (one host sync: prefill only), so a
        chunk costs its own blocks, not the capacity."""
        b, h = slots.shape[:2]
        r, g, qs = self.residual, self.group_size, self.quantized_slots
        lo = int(n_old.min()) // r * r
        hi = min(qs, int(n_new.max()) // r * r)
        if hi <= lo:
            return  # no block completes
        arange = torch.arange(lo, hi, device=k.device)
        ring = (arange % r)[None, None, :, None].expand(b, h, hi - lo, k.shape[-1])
        old = (arange[None, :] >= (n_old // r * r)[:, None]) & (arange[None, :] < n_old[:, None])  # [batch, span]
        full = torch.where(old[:, None, :, None], torch.gather(self.key_window, 2, ring),
                           torch.zeros((), dtype=k.dtype, device=k.device))
        scatter_slots(full, torch.where((slots >= lo) & (slots < hi), slots - lo, torch.full_like(slots, -1)), k)
        kc, ks, km = kivi_quantize_keys(full, self.bits, g)
        block_end = lo + (torch.arange((hi - lo) // r, device=k.device) + 1) * r  # [blocks]
        new = (n_old[:, None] < block_end) & (block_end <= n_new[:, None])  # [batch, blocks]
        slot_new = new.repeat_interleave(r, dim=1)[:, None, :, None]
        group_new = new.repeat_interleave(r // g, dim=1)[:, None, :, None]
        codes, scale, minimum = (self.key_codes[:, :, lo:hi], self.key_scale[:, :, lo // g:hi // g],
                                 self.key_min[:, :, lo // g:hi // g])
        codes.copy_(torch.where(slot_new, self._pack(kc), codes))
        scale.copy_(torch.where(group_new, ks, scale))
        minimum.copy_(torch.where(group_new, km, minimum))

    # ----- read -----
    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot in the compute dtype ``[batch, kv_heads, capacity, dim]``: dequantized, except the window's
        tokens (full precision); empty slots read as zeros (:func:`kvlearn.ops.kivi_decode.kivi_read`)."""
        return kivi_read(*self._buffers(), self.bits, self.dtype)

    def read_prefix(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` slots as :meth:`read` gives them, dequantizing only those (and the rest of their last
        key block): a keep-all prefill attends the ``seen`` slots it filled, not the whole capacity."""
        return kivi_read(*self._buffers(), self.bits, self.dtype, length=length)

    def attends_decode(self) -> bool:
        """True where the KIVI decode kernel runs (CUDA with triton, or Triton's CPU interpreter) and the head dim
        suits it (:func:`~kvlearn.ops.packed_decode.fused_decode_applies`, equal key and value dims): a decode step
        then attends the codes, rebuilding each tile in registers, with no dequantized copy of the store.
        ``KVLEARN_PACKED_DECODE=0`` in the environment turns it off (the read-back path), as for the packed store."""
        return (self.dims is not None and self.dims[0] == self.dims[1]
                and fused_decode_applies(self.key_codes.device, self.dims[0], self.bits)
                and os.environ.get("KVLEARN_PACKED_DECODE", "1") != "0")

    def decode_attention(self, query: torch.Tensor, visible: torch.Tensor, scale: float | None) -> torch.Tensor:
        """:func:`~kvlearn.ops.kivi_decode.kivi_decode_attention` on this store's buffers (Triton kernel)."""
        return kivi_decode_attention(query, *self._buffers(), visible, self.bits, self.group_size, scale,
                                     backend="triton")
