"""KV-cache quantization primitives: pure tensor functions, no model knowledge (``docs/DESIGN.md`` section 7).

1. **Symmetric per-vector quantizer** (KV-Kaizen, appendix C.3): for ``b`` in {2, 4, 8}, ``q = 2^(b-1) - 1``, one
   scale per stored vector ``s = max_i |x_i| / q`` and codes ``c_i = clip(round(x_i / s), -q, q)`` (int8);
   dequantization is ``c_i * s``. ``b = 16`` means no quantization (:func:`fake_quantize` returns its input; a
   store keeps the model dtype). A zero vector has ``s = 0`` and codes 0 (no NaN).
   :func:`quantize`, :func:`dequantize`, :func:`fake_quantize` (straight-through gradient, for training).
2. **Bit packing**: :func:`pack` stores ``8 / b`` codes per byte (uint8), biased to ``u = c + 2^(b-1)``, value ``j``
   of each group of ``8 / b`` in bits ``[j b, (j + 1) b)`` (the first value in the low bits); :func:`unpack` is its
   exact inverse. 8-bit codes take one byte each (biased by 128).
3. **KIVI's grouped asymmetric quantizer** (Liu et al., 2024): ``scale = (max - min) / (2^b - 1)``,
   ``code = clip(round((x - min) / scale), 0, 2^b - 1)`` (uint8), ``x ~ code * scale + min`` over each group:
   keys per channel over groups of ``group_size`` consecutive tokens (:func:`kivi_quantize_keys`), values per token
   over groups of ``group_size`` channels (:func:`kivi_quantize_values`). These quantize one block; KIVI's
   full-precision residual window of recent tokens is a store's policy, not built here.
4. :func:`cost_bits_per_token`: storage of one token in one KV head under (1).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import check

BITS = (2, 4, 8, 16)
"""The bit-widths of the quantizers (16 = no quantization)."""

QUANT_BITS = (2, 4, 8)
"""The bit-widths that store integer codes."""


def check_bits(bits, allowed: tuple[int, ...] = BITS) -> int:
    """Raise a one-line :class:`~kvlearn.errors.KVLearnError` unless ``bits`` is one of ``allowed``; return it."""
    ok = isinstance(bits, int) and not isinstance(bits, bool) and bits in allowed
    hint = "" if 16 in allowed else " (16 = no quantization, which stores no codes: keep the model dtype)"
    check(ok, f"bits={bits!r} is invalid: expected one of {', '.join(map(str, allowed))}{hint}")
    return bits


def code_max(bits: int) -> int:
    """``q = 2^(b-1) - 1``, the largest code magnitude of the symmetric quantizer (1, 7, 127)."""
    return 2 ** (check_bits(bits, QUANT_BITS) - 1) - 1


# ----- symmetric per-vector quantizer -----

def quantize(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric quantization of each vector along the last dim: ``(codes int8 [..., d], scale [...])``.

    ``scale = absmax / q`` in ``x.dtype`` (the stored scale); the codes are rounded against that stored scale in
    float32, so :func:`dequantize` reproduces ``x`` to within ``scale / 2`` per element. ``scale == 0`` (a zero
    vector) gives codes 0."""
    q = code_max(bits)
    xf = x.float()
    scale = (xf.abs().amax(dim=-1) / q).to(x.dtype)
    sf = scale.float()[..., None]
    safe = torch.where(sf > 0, sf, torch.ones_like(sf))
    codes = torch.where(sf > 0, (xf / safe).round().clamp(-q, q), torch.zeros_like(xf))
    return codes.to(torch.int8), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    """``codes [..., d] * scale [...]`` in ``dtype`` (computed in float32, then cast)."""
    return (codes.float() * scale.float()[..., None]).to(dtype)


def fake_quantize(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Forward: ``dequantize(quantize(x, bits))``; backward: the identity (straight-through). ``bits == 16``
    returns ``x``."""
    if check_bits(bits) == 16:
        return x
    xq = dequantize(*quantize(x.detach(), bits), x.dtype)
    return x + (xq - x).detach()


# ----- bit packing -----

def _per_byte(bits: int) -> int:
    return 8 // check_bits(bits, QUANT_BITS)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack signed codes ``[..., n]`` (``|c| <= 2^(b-1)``, any integer dtype) into ``uint8 [..., n * b / 8]``;
    ``n`` must be divisible by ``8 / b``. Fixed-shape tensor ops only (no host sync)."""
    k = _per_byte(bits)
    n = codes.shape[-1]
    check(n % k == 0, f"pack: the last dim ({n}) must be divisible by {k} to pack {bits}-bit codes")
    u = (codes.to(torch.int16) + 2 ** (bits - 1)).to(torch.uint8)
    if k == 1:
        return u
    u = u.reshape(*codes.shape[:-1], n // k, k)
    out = u[..., 0]
    for j in range(1, k):
        out = out | (u[..., j] << (j * bits))
    return out


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack`: ``uint8 [..., n * b / 8]`` -> int8 codes ``[..., n]``."""
    k = _per_byte(bits)
    check(packed.dtype == torch.uint8, f"unpack: expected uint8 packed codes, got {packed.dtype}")
    check(packed.shape[-1] * k == n,
          f"unpack: {packed.shape[-1]} bytes hold {packed.shape[-1] * k} {bits}-bit codes, not n={n}")
    if k == 1:
        u = packed
    else:
        mask = 2 ** bits - 1
        u = torch.stack([(packed >> (j * bits)) & mask for j in range(k)], dim=-1).reshape(*packed.shape[:-1], n)
    return (u.to(torch.int16) - 2 ** (bits - 1)).to(torch.int8)


# ----- KIVI grouped asymmetric quantizer -----

def quantize_asymmetric(x: torch.Tensor, bits: int, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization over ``dim``: ``(codes uint8 (shape of x), scale, minimum)``, the last two
    with ``dim`` kept (size 1) and in ``x.dtype``. ``scale = (max - min) / (2^b - 1)``; a constant group
    (``scale == 0``) gets codes 0 and dequantizes to its minimum exactly."""
    levels = 2 ** check_bits(bits, QUANT_BITS) - 1
    xf = x.float()
    lo = xf.amin(dim=dim, keepdim=True)
    scale = ((xf.amax(dim=dim, keepdim=True) - lo) / levels).to(x.dtype)
    minimum = lo.to(x.dtype)
    sf = scale.float()
    safe = torch.where(sf > 0, sf, torch.ones_like(sf))
    codes = torch.where(sf > 0, ((xf - minimum.float()) / safe).round().clamp(0, levels), torch.zeros_like(xf))
    return codes.to(torch.uint8), scale, minimum


def dequantize_asymmetric(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, dtype) -> torch.Tensor:
    """``codes * scale + minimum`` (broadcast over the quantized dim) in ``dtype``."""
    return (codes.float() * scale.float() + minimum.float()).to(dtype)


def _groups(size: int, group_size: int, what: str) -> int:
    check(isinstance(group_size, int) and group_size >= 1 and size % group_size == 0,
          f"group_size={group_size!r} is invalid: it must divide the {what} ({size})")
    return size // group_size


def kivi_quantize_keys(k: torch.Tensor, bits: int, group_size: int):
    """KIVI's key quantizer on a block ``k [..., T, D]``: per channel, over groups of ``group_size`` consecutive
    tokens (``T`` divisible by ``group_size``). Returns ``(codes uint8 [..., T, D], scale [..., T/G, D],
    minimum [..., T/G, D])``."""
    *lead, t, d = k.shape
    g = _groups(t, group_size, "number of tokens of the block")
    codes, scale, minimum = quantize_asymmetric(k.reshape(*lead, g, group_size, d), bits, dim=-2)
    return codes.reshape(k.shape), scale.squeeze(-2), minimum.squeeze(-2)


def kivi_dequantize_keys(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, dtype) -> torch.Tensor:
    """Inverse of :func:`kivi_quantize_keys` (up to the quantization error)."""
    *lead, t, d = codes.shape
    g = scale.shape[-2]
    out = dequantize_asymmetric(codes.reshape(*lead, g, t // g, d), scale[..., None, :], minimum[..., None, :], dtype)
    return out.reshape(codes.shape)


def kivi_quantize_values(v: torch.Tensor, bits: int, group_size: int):
    """KIVI's value quantizer on ``v [..., T, D]``: per token, over groups of ``group_size`` channels (``D``
    divisible by ``group_size``). Returns ``(codes uint8 [..., T, D], scale [..., T, D/G], minimum [..., T, D/G])``."""
    *lead, d = v.shape
    g = _groups(d, group_size, "head dim")
    codes, scale, minimum = quantize_asymmetric(v.reshape(*lead, g, group_size), bits, dim=-1)
    return codes.reshape(v.shape), scale.squeeze(-1), minimum.squeeze(-1)


def kivi_dequantize_values(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, dtype) -> torch.Tensor:
    """Inverse of :func:`kivi_quantize_values` (up to the quantization error)."""
    *lead, d = codes.shape
    g = scale.shape[-1]
    out = dequantize_asymmetric(codes.reshape(*lead, g, d // g), scale[..., None], minimum[..., None], dtype)
    return out.reshape(codes.shape)


# ----- cost model -----

class BitsPerToken(NamedTuple):
    """Bits of one token in one KV head (key + value): ``total`` with the scales, ``codes`` without."""

    total: int
    codes: int


def cost_bits_per_token(head_dim: int, bits: int, scale_bits: int) -> BitsPerToken:
    """Storage of one token in one KV head under the symmetric per-vector quantizer: a key and a value of
    ``head_dim`` codes of ``bits`` bits each, plus one ``scale_bits`` scale per vector.
    ``total = 2 (head_dim * bits + scale_bits)``, ``codes = 2 head_dim bits``. ``bits == 16`` (no quantization)
    stores no scale: both are ``32 head_dim``."""
    check_bits(bits)
    check(isinstance(head_dim, int) and head_dim >= 1, f"head_dim={head_dim!r} is invalid: expected an integer >= 1")
    codes = 2 * head_dim * bits
    return BitsPerToken(total=codes if bits == 16 else codes + 2 * scale_bits, codes=codes)


def kivi_bits_per_element(bits: int, group_size: int, meta_bits: int = 16, residual: int = 0,
                          tokens: int | None = None) -> float:
    """Average bits per stored K/V element under KIVI: ``bits`` per code plus a scale and a zero-point of
    ``meta_bits`` each per group of ``group_size`` elements, i.e. ``bits + 2 meta_bits / group_size``; with a
    full-precision residual window of ``residual`` of ``tokens`` tokens (at ``meta_bits`` per element), the
    token-weighted mean ``((tokens - residual) (bits + 2 meta_bits / G) + residual meta_bits) / tokens``."""
    check_bits(bits, QUANT_BITS)
    check(isinstance(group_size, int) and group_size >= 1, f"group_size={group_size!r} is invalid: expected >= 1")
    quantized = bits + 2 * meta_bits / group_size
    if not residual:
        return quantized
    check(tokens is not None and 0 <= residual <= tokens,
          f"residual={residual!r} needs tokens >= residual (tokens={tokens!r})")
    return ((tokens - residual) * quantized + residual * meta_bits) / tokens
