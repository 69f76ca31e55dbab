"""A packed-integer store: keys and values quantized to ``bits`` in {2, 4, 8} with the symmetric per-vector quantizer
of :mod:`kvlearn.ops.quant` (KV-Kaizen's precision axis; equations in ``docs/DESIGN.md`` section 7).

Buffers per (batch row, KV head): ``key_codes [batch, kv_heads, capacity, k_dim * bits / 8]`` uint8 (the packed
codes, :func:`~kvlearn.ops.quant.pack`), ``key_scales [batch, kv_heads, capacity]`` in the model dtype (one scale per
stored vector), and the same for the values. ``allocated_bytes`` is exactly codes + scales, which equals
``batch * kv_heads * capacity * cost_bits_per_token(head_dim, bits, scale_bits).total / 8``.

``write`` quantizes the new tokens and scatters their packed rows and scales with
:func:`~kvlearn.cache.store.scatter_slots` (decoding: one fixed-shape scatter per buffer, no host sync). ``read``
unpacks and dequantizes every slot into a full-size temporary in the compute dtype. That temporary is acceptable on
this CPU reference path only: **the GPU path must dequantize inside the attention kernel**, reading the packed codes
and scales directly, never into a temporary, or the memory saved by the store is spent again at every step. That
kernel is :func:`kvlearn.ops.packed_decode.packed_decode_attention`: where it runs (:meth:`PackedStore.attends_decode`)
a decode step reads no keys back and the attention function calls :meth:`PackedStore.decode_attention`.

Within a multi-token forward the new tokens are attended in full precision (the layer returns the dequantized store
followed by the chunk) and quantized when written; a decoded token is written first and attended dequantized.
Re-writing a dequantized token (a deferring policy's ``replace_all``) reproduces its codes.
"""

from __future__ import annotations

import os

import torch

from ..errors import check
from ..ops.packed_decode import fused_decode_applies, packed_decode_attention
from ..ops.quant import QUANT_BITS, check_bits, dequantize, pack, quantize, unpack
from .store import PlainStore, Store, scatter_slots


class PackedStore(Store):
    """Keys and values as packed ``bits``-bit codes plus one model-dtype scale per stored vector (module docstring).
    ``k_dim`` and ``v_dim`` must be divisible by ``8 / bits``."""

    write_read_exact = True  # per-vector quantization: a token reads back as round_trip gives it

    def __init__(self, bits: int) -> None:
        self.bits = check_bits(bits, QUANT_BITS)
        self.key_codes: torch.Tensor | None = None
        self.key_scales: torch.Tensor | None = None
        self.value_codes: torch.Tensor | None = None
        self.value_scales: torch.Tensor | None = None
        self.dims: tuple[int, int] | None = None
        self.dtype = None

    def allocate(self, batch, kv_heads, capacity, k_dim, v_dim, dtype, device) -> None:
        per_byte = 8 // self.bits
        for name, dim in (("k_dim", k_dim), ("v_dim", v_dim)):
            check(dim % per_byte == 0, f"PackedStore({self.bits}): {name}={dim} must be divisible by {per_byte} "
                                       f"({per_byte} codes of {self.bits} bits per byte)")
        self.dims, self.dtype = (k_dim, v_dim), dtype
        lead = (batch, kv_heads, capacity)
        self.key_codes = torch.full(lead + (k_dim // per_byte,), 0, dtype=torch.uint8, device=device)
        self.value_codes = torch.full(lead + (v_dim // per_byte,), 0, dtype=torch.uint8, device=device)
        self.key_scales = torch.zeros(lead, dtype=dtype, device=device)
        self.value_scales = torch.zeros(lead, dtype=dtype, device=device)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        check(self.key_codes is not None, "store.write() called before allocate()")
        for x, codes_buf, scale_buf in ((k, self.key_codes, self.key_scales), (v, self.value_codes, self.value_scales)):
            codes, scale = quantize(x.to(self.dtype), self.bits)
            scatter_slots(codes_buf, slots, pack(codes, self.bits))
            scatter_slots(scale_buf, slots, scale)

    def round_trip(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``k, v [batch, kv_heads, q, dim]`` quantized and dequantized as a write then a read would (bit-exact)."""
        return tuple(dequantize(*quantize(x.to(self.dtype), self.bits), self.dtype) for x in (k, v))

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot dequantized into a full-size temporary in the compute dtype (CPU reference path; an empty slot
        reads as zeros)."""
        dk, dv = self.dims
        keys = dequantize(unpack(self.key_codes, self.bits, dk), self.key_scales, self.dtype)
        values = dequantize(unpack(self.value_codes, self.bits, dv), self.value_scales, self.dtype)
        return keys, values

    def read_prefix(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` slots dequantized (a temporary of ``length`` slots, not ``capacity``): what a keep-all
        layer's multi-token forward attends after writing its chunk (``CompactLayer.writes_in_place``)."""
        dk, dv = self.dims
        keys = dequantize(unpack(self.key_codes[:, :, :length], self.bits, dk), self.key_scales[:, :, :length], self.dtype)
        values = dequantize(unpack(self.value_codes[:, :, :length], self.bits, dv), self.value_scales[:, :, :length],
                            self.dtype)
        return keys, values

    def attends_decode(self) -> bool:
        """True where the packed decode kernel runs (CUDA with triton, or Triton's CPU interpreter) and the head dim
        suits it: a decode step then attends the codes directly, with no dequantized temporary. The environment
        variable ``KVLEARN_PACKED_DECODE=0`` turns the kernel off (the read-back path, e.g. to compare them)."""
        return (self.key_codes is not None and self.dims[0] == self.dims[1]
                and fused_decode_applies(self.key_codes.device, self.dims[0], self.bits)
                and os.environ.get("KVLEARN_PACKED_DECODE", "1") != "0")

    def decode_attention(self, query: torch.Tensor, visible: torch.Tensor, scale: float | None) -> torch.Tensor:
        """:func:`~kvlearn.ops.packed_decode.packed_decode_attention` on this store's buffers (Triton kernel)."""
        return packed_decode_attention(query, self.key_codes, self.key_scales, self.value_codes, self.value_scales,
                                       visible, self.bits, scale, backend="triton")

    def allocated_bytes(self) -> int:
        if self.key_codes is None:
            return 0
        bufs = (self.key_codes, self.value_codes, self.key_scales, self.value_scales)
        return sum(t.numel() * t.element_size() for t in bufs)

    def bytes_per_token(self) -> int:
        """Packed codes + the two scales of one token in one KV head."""
        return self.key_codes.shape[-1] + self.value_codes.shape[-1] + 2 * self.key_scales.element_size()

    @property
    def shape(self):
        b, h, c, _ = self.key_codes.shape
        return b, h, c, *self.dims


def store_for_bits(bits: int) -> Store:
    """A fresh store for a bit-width in {2, 4, 8, 16}: :class:`PackedStore` below 16, :class:`PlainStore` (the
    model dtype) at 16."""
    return PlainStore() if check_bits(bits) == 16 else PackedStore(bits)
