"""One-token attention over a KIVI store, dequantized tile by tile inside the kernel (the KIVI baseline of KV-Kaizen).

The store (:class:`kvlearn.cache.kivi.KIVIStore`, layout in its module docstring) keeps, per batch row and KV head,
keys quantized **per channel** over groups of ``G`` consecutive tokens, values quantized **per token** over groups
of ``G_v`` channels (asymmetric: ``x = code * scale + minimum``, unsigned ``b``-bit codes packed along the channels
as :func:`kvlearn.ops.quant.pack` does), and a full-precision ring window of the ``R`` most recent tokens. After
``n`` tokens, slot ``c`` reads

- its key from the window if ``c >= floor(n / R) R`` (keys are quantized a whole block of ``R`` at a time), else
  ``code^K_c * s^K_{c // G} + m^K_{c // G}`` (scale and minimum per channel of its token group);
- its value from the window if ``c >= n - R``, else ``code^V_c * s^V_c + m^V_c`` (per channel group of the token).

The asymmetric quantizer's zero-point stops the trick of the symmetric store (:mod:`kvlearn.ops.packed_decode`,
one scale per vector factored out of the dot product), so this kernel rebuilds each tile of ``BLOCK_C`` keys and
values **in registers** and attends it there: no dequantized copy of the store is ever written to memory, which a
read-then-attend path allocates at every step (``2 * slots * head_dim`` model-dtype elements per layer).

How a tile is rebuilt (the split kernel). Slots below ``qend = max(n - R, 0)`` have key and value quantized, so
the programs of the slot splits stop there and their tiles need no window row and no per-element choice; the
window's slots ``[qend, n)`` (at most ``R``) go to ``ceil(min(R, capacity) / BLOCK_C)`` programs, one tile each, in
a second launch of the same kernel (values from the window, keys quantized or from it). A quantized tile's codes
are unpacked into channel order (``tl.join``), so a key group's per-channel scale and minimum are one contiguous
row, loaded once per group and broadcast over its slots (``key_path="broadcast"``: a tile in one group, or whole
groups of a power-of-two size; ``"gather"`` loads a row per slot, for any ``G``), and a token's ``D / G_v`` value
scales and minima one short row, broadcast over their channels; then one ``tl.dot`` for the logits and one for the
values. The codes become numbers from their bits, with no int-to-float conversion instruction: with bf16 scales
and ``b <= 4`` (fp16: any ``b``), ``0x4300 | u`` is bf16 ``128 + u`` (fp16: ``0x6400 | u`` is ``1024 + u``), minus
the offset, exact, and ``u * scale + minimum`` is one fused multiply-add on bf16 pairs, a single rounding of the
exact value where float32 then a cast rounds twice (they differ only where the float32 sum lands on a bf16 tie);
otherwise ``bits(2^23 + u) - 2^23`` in float32. The first kernel, which rebuilt every element with its own scale,
minimum and window choice, measured 2.8-3.3x the bf16 cache's decode step graph-replayed against 1.5-1.7x for this
one (``results/kivi_decode_h200.json``) and was removed. On CUDA a tile holds at least 32 slots
(:func:`check_cuda_block_c`): tiles of 16 gave wrong results on the H200 with Triton 3.6 (Triton's CPU interpreter
still takes them).

Inputs (one device): ``query [batch, q_heads, head_dim]``; the store's buffers ``key_codes [batch, kv_heads, Q,
head_dim * b / 8]`` uint8 (``Q = floor(capacity / R) R``), ``key_scale``, ``key_min [batch, kv_heads, Q / G,
head_dim]``, ``value_codes [batch, kv_heads, capacity, head_dim * b / 8]``, ``value_scale``, ``value_min [batch,
kv_heads, capacity, head_dim / G_v]``, ``key_window``, ``value_window [batch, kv_heads, R, head_dim]``, ``filled
[batch]`` int64 (tokens written per row); ``visible`` bool ``[batch, kv_heads or 1, capacity]`` (at least one
visible slot per row); ``bits`` in {2, 4, 8}; ``group_size`` ``G``. Returns ``[batch, q_heads, head_dim]`` float32.

Backends: ``"torch"`` (:func:`kivi_read`, the whole store dequantized, then a masked softmax in float32: the
reference, any device) and ``"triton"`` (split-K flash decoding as in :mod:`kvlearn.ops.packed_decode`: programs over
``(batch * kv_heads, parts)``, each holding the ``q_heads / kv_heads`` query heads of one KV head, so a tile is
loaded once for all of them; the same merge kernel). ``"auto"`` takes Triton on CUDA where
:func:`~kvlearn.ops.packed_decode.fused_decode_applies`. Runs on the CPU in Triton's interpreter
(``TRITON_INTERPRET=1`` set before triton is imported), which cannot do arithmetic on bf16: there the 16-bit path
goes through float32.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvlearn.errors import check
from kvlearn.ops.packed_decode import BACKENDS, default_split, fused_decode_applies, merge_splits
from kvlearn.ops.quant import QUANT_BITS, check_bits, kivi_dequantize_keys, kivi_dequantize_values, unpack
from kvlearn.ops.triton_support import HAS_TRITON, LOG2E, check_launch, interpreting, is_pow2, tl, triton

if HAS_TRITON:
    from kvlearn.ops.packed_decode import channel_codes, empty_channel_state, program_query, store_channel_partials
    from kvlearn.ops.triton_support import dot_fp32, online_lse_step

__all__ = ["CUDA_MIN_BLOCK_C", "KEY_PATHS", "check_cuda_block_c", "kivi_decode_attention", "kivi_read",
           "resolve_key_path"]


def _unsigned(packed: Tensor, bits: int, n: int) -> Tensor:
    """Packed bytes -> the unsigned KIVI codes ``[0, 2^b)`` (``pack`` stored them biased by ``-2^(b-1)``)."""
    return (unpack(packed, bits, n).to(torch.int16) + 2 ** (bits - 1)).to(torch.uint8)


def kivi_read(key_codes, key_scale, key_min, value_codes, value_scale, value_min, key_window, value_window, filled,
              bits: int, dtype, length: int | None = None) -> tuple[Tensor, Tensor]:
    """Every slot of a KIVI store in ``dtype``, ``[batch, kv_heads, capacity, dim]`` keys and values (module
    docstring: quantized slots dequantized, the window's tokens in full precision, slots past ``filled`` zeros).
    ``length``: only the first ``length`` slots (``[batch, kv_heads, length, dim]``, the same values), dequantizing
    only the key blocks of ``R`` slots and the values that hold them."""
    dk, dv = key_window.shape[-1], value_window.shape[-1]
    r = key_window.shape[2]
    check(length is None or (isinstance(length, int) and length >= 0),
          f"length={length!r} is invalid: expected None or an int >= 0")
    if length is not None and length < value_codes.shape[2]:
        qs = key_codes.shape[2]
        blocks = min(qs, -(-length // r) * r)  # whole key blocks (a multiple of R, so of the key group G)
        groups = blocks * key_scale.shape[2] // qs if qs else 0
        keys, values = kivi_read(key_codes[:, :, :blocks], key_scale[:, :, :groups], key_min[:, :, :groups],
                                 value_codes[:, :, :length], value_scale[:, :, :length], value_min[:, :, :length],
                                 key_window, value_window, filled, bits, dtype)
        return keys, values
    b, h, cap = value_codes.shape[:3]
    qs = key_codes.shape[2]
    arange = torch.arange(cap, device=filled.device)[None, :]
    n = filled[:, None]
    keys = (kivi_dequantize_keys(_unsigned(key_codes, bits, dk), key_scale, key_min, dtype) if qs > 0
            else key_window.new_zeros(b, h, 0, dk).to(dtype))  # capacity < R: every key lives in the window
    if qs < cap:
        keys = torch.cat([keys, keys.new_zeros(b, h, cap - qs, dk)], dim=2)
    keys = keys[:, :, :cap]  # (a prefix read: its last key block may run past the prefix)
    values = kivi_dequantize_values(_unsigned(value_codes, bits, dv), value_scale, value_min, dtype)
    out = []
    for x, window, first in ((keys, key_window, n // r * r), (values, value_window, n - r)):
        ring = (arange[0] % r)[None, None, :, None].expand(b, h, cap, x.shape[-1])
        recent = ((arange >= first) & (arange < n))[:, None, :, None]
        x = torch.where(recent, torch.gather(window, 2, ring), x)
        out.append(torch.where((arange < n)[:, None, :, None], x, torch.zeros_like(x)))
    return out[0], out[1]


def _check_inputs(query, key_codes, key_scale, key_min, value_codes, value_scale, value_min, key_window,
                  value_window, filled, visible, bits, group_size) -> tuple[int, ...]:
    check_bits(bits, QUANT_BITS)
    check(isinstance(query, Tensor) and query.dim() == 3,
          f"query shape={tuple(getattr(query, 'shape', ()))} is invalid: expected [batch, q_heads, head_dim]")
    b, hq, d = query.shape
    per_byte = 8 // bits
    check(d % per_byte == 0, f"head_dim={d} is invalid for {bits}-bit codes: expected a multiple of {per_byte}")
    check(isinstance(value_codes, Tensor) and value_codes.dtype == torch.uint8 and value_codes.dim() == 4
          and value_codes.shape[0] == b and value_codes.shape[3] == d // per_byte,
          f"value_codes shape={tuple(getattr(value_codes, 'shape', ()))} is invalid: expected uint8 [batch={b}, "
          f"kv_heads, capacity, head_dim * bits / 8 = {d // per_byte}]")
    hkv, cap = value_codes.shape[1], value_codes.shape[2]
    check(hkv >= 1 and hq % hkv == 0, f"q_heads={hq} is invalid: expected a multiple of kv_heads={hkv}")
    r = key_window.shape[2] if isinstance(key_window, Tensor) and key_window.dim() == 4 else 0
    for name, t in (("key_window", key_window), ("value_window", value_window)):
        check(isinstance(t, Tensor) and r >= 1 and tuple(t.shape) == (b, hkv, r, d),
              f"{name} shape={tuple(getattr(t, 'shape', ()))} is invalid: expected [batch, kv_heads, R, head_dim] = "
              f"{(b, hkv, r, d)}")
    check(isinstance(group_size, int) and group_size >= 1 and r % group_size == 0,
          f"group_size={group_size!r} is invalid: expected an int >= 1 dividing the window R={r}")
    qs = cap // r * r
    check(isinstance(key_codes, Tensor) and key_codes.dtype == torch.uint8
          and tuple(key_codes.shape) == (b, hkv, qs, d // per_byte),
          f"key_codes shape={tuple(getattr(key_codes, 'shape', ()))} is invalid: expected uint8 [batch, kv_heads, "
          f"floor(capacity / R) R, head_dim * bits / 8] = {(b, hkv, qs, d // per_byte)}")
    for name, t in (("key_scale", key_scale), ("key_min", key_min)):
        check(isinstance(t, Tensor) and tuple(t.shape) == (b, hkv, qs // group_size, d),
              f"{name} shape={tuple(getattr(t, 'shape', ()))} is invalid: expected [batch, kv_heads, Q / G, head_dim]"
              f" = {(b, hkv, qs // group_size, d)}")
    groups = value_scale.shape[-1] if isinstance(value_scale, Tensor) and value_scale.dim() == 4 else 0
    for name, t in (("value_scale", value_scale), ("value_min", value_min)):
        check(isinstance(t, Tensor) and groups >= 1 and d % groups == 0 and tuple(t.shape) == (b, hkv, cap, groups),
              f"{name} shape={tuple(getattr(t, 'shape', ()))} is invalid: expected [batch, kv_heads, capacity, "
              f"head_dim / G_v] with G_v dividing head_dim={d}")
    check(isinstance(filled, Tensor) and tuple(filled.shape) == (b,) and not filled.is_floating_point(),
          f"filled shape={tuple(getattr(filled, 'shape', ()))} is invalid: expected integer [batch={b}]")
    check(isinstance(visible, Tensor) and visible.dtype == torch.bool and visible.dim() == 3
          and visible.shape[0] == b and visible.shape[1] in (1, hkv) and visible.shape[2] == cap,
          f"visible shape={tuple(getattr(visible, 'shape', ()))} dtype={getattr(visible, 'dtype', None)} is invalid: "
          f"expected bool [batch={b}, kv_heads={hkv} or 1, capacity={cap}]")
    return b, hq, hkv, cap, d, r, d // groups


def _torch_decode(query, keys, values, visible, scale) -> Tensor:
    """Masked softmax attention in float32 over the read-back ``keys, values [batch, kv_heads, capacity, dim]``."""
    b, hq, d = query.shape
    hkv = keys.shape[1]
    g = hq // hkv
    q = query.float().reshape(b, hkv, g, d)
    logits = torch.einsum("bhgd,bhcd->bhgc", q, keys.float()) * scale
    logits = logits.masked_fill(~visible[:, :, None, :].expand(b, hkv, g, -1), -math.inf)
    return torch.einsum("bhgc,bhcd->bhgd", torch.softmax(logits, dim=-1), values.float()).reshape(b, hq, d)


if HAS_TRITON:

    @triton.jit
    def _exact_f32(u):
        """Integer codes ``0 <= u < 2^23`` (int32) as float32, exactly, with no int-to-float conversion instruction:
        the bit pattern of ``2^23 + u``, minus ``2^23``."""
        return (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0

    @triton.jit
    def _dequantize(u, scale, minimum, OFFSET: tl.constexpr, EMULATE: tl.constexpr):
        """``u * scale + minimum`` elementwise. ``OFFSET`` 128 (bf16 scales, codes below 128) or 1024 (fp16): in
        that dtype, the codes exact from their bits (``0x4300 | u`` is bf16 ``128 + u``, ``0x6400 | u`` fp16
        ``1024 + u``; minus the offset, exact) and one fused multiply-add (on pairs, on the GPU): one rounding of
        the exact ``u s + m``, where float32 then a cast rounds twice (``u s`` is exact in float32; they differ
        only where the float32 sum lands on a bf16 tie). ``0``: in float32. ``EMULATE``: Triton's interpreter,
        which keeps bf16 as raw bits (no arithmetic on it) and would round fp16 products: through float32."""
        if OFFSET == 0:
            x = _exact_f32(u) * scale.to(tl.float32) + minimum.to(tl.float32)
        else:
            if OFFSET == 128:
                c = (u | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
            else:
                c = (u | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
            if EMULATE:
                x = ((c.to(tl.float32) - OFFSET) * scale.to(tl.float32) + minimum.to(tl.float32)).to(c.dtype)
            else:
                x = tl.fma(c - float(OFFSET), scale, minimum)
        return x

    @triton.jit
    def _key_groups(base, c0, rows, live, hi, offs_d, stride_sg, GROUP: tl.constexpr, BLOCK_C: tl.constexpr,
                    HEAD_DIM: tl.constexpr, KEY_PATH: tl.constexpr):
        """The per-channel key scales (or minima) of a tile's slots, ``[BLOCK_C, HEAD_DIM]``: ``KEY_PATH == 1``
        loads each of the tile's key groups once (one row when the tile lies in one group, else ``BLOCK_C /
        GROUP`` rows) and broadcasts it over the group's slots; ``0`` loads one row per slot (any ``GROUP``)."""
        if KEY_PATH == 1:
            if GROUP % BLOCK_C == 0:
                row = tl.load(base + (c0 // GROUP) * stride_sg + offs_d)
                t = tl.broadcast_to(row[None, :], (BLOCK_C, HEAD_DIM))
            else:
                K: tl.constexpr = BLOCK_C // GROUP
                grp = c0 // GROUP + tl.arange(0, K)
                g_rows = tl.load(base + grp[:, None] * stride_sg + offs_d[None, :], mask=(grp * GROUP < hi)[:, None],
                                 other=0.0)
                t = tl.reshape(tl.broadcast_to(g_rows[:, None, :], (K, GROUP, HEAD_DIM)), (BLOCK_C, HEAD_DIM))
        else:
            t = tl.load(base + (rows // GROUP)[:, None] * stride_sg + offs_d[None, :], mask=live[:, None], other=0.0)
        return t

    @triton.jit
    def _value_groups(base, rows, live, stride_vst, BLOCK_C: tl.constexpr, HEAD_DIM: tl.constexpr,
                      VGROUP: tl.constexpr):
        """The value scales (or minima) of a tile's tokens, ``[BLOCK_C, HEAD_DIM / VGROUP]`` loaded once (one
        short contiguous row per token) and broadcast over each group's channels: ``[BLOCK_C, HEAD_DIM]``."""
        NG: tl.constexpr = HEAD_DIM // VGROUP
        t = tl.load(base + rows[:, None] * stride_vst + tl.arange(0, NG)[None, :], mask=live[:, None], other=0.0)
        return tl.reshape(tl.broadcast_to(t[:, :, None], (BLOCK_C, NG, VGROUP)), (BLOCK_C, HEAD_DIM))

    @triton.jit
    def _kivi_decode_kernel(
        q_ptr,  # [B, Hq, D]
        kc_ptr, ks_ptr, km_ptr,  # key codes [B, Hkv, Q, DB] uint8; key scale / min [B, Hkv, Q / GROUP, D]
        vc_ptr, vs_ptr, vm_ptr,  # value codes [B, Hkv, C, DB] uint8; value scale / min [B, Hkv, C, D / VGROUP]
        kw_ptr, vw_ptr,  # windows [B, Hkv, RES, D]
        n_ptr,  # filled [B] int64
        vis_ptr,  # bool viewed as uint8 [B, Hv, C] (Hv = Hkv or 1; stride 0 when shared)
        m_ptr, l_ptr, acc_ptr,  # partials: [B * Hkv, PARTS, G_PAD], [..., G_PAD], [..., G_PAD, D] float32
        stride_qb, stride_qh,
        stride_kcb, stride_kch, stride_kct,
        stride_ksb, stride_ksh, stride_ksg,
        stride_vcb, stride_vch, stride_vct,
        stride_vsb, stride_vsh, stride_vst,
        stride_wb, stride_wh, stride_wt,
        stride_vib, stride_vih,
        split, splits, parts,  # slots per split, the splits, splits + the window's tiles
        qk_scale,  # scale * log2(e)
        HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        PER_BYTE: tl.constexpr, DB: tl.constexpr, BLOCK_C: tl.constexpr,
        GROUP: tl.constexpr, VGROUP: tl.constexpr, RES: tl.constexpr,
        KEY_PATH: tl.constexpr, OFFSET: tl.constexpr, WINDOW: tl.constexpr,
        DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    ):
        """One (batch x KV head, split ``sp``). Without ``WINDOW``: the split's slots below ``qend = max(n - RES,
        0)``, where key and value are both quantized, so a tile needs no window row and no per-element choice: the
        codes unpacked into channel order, the key scales and minima per group (``KEY_PATH`` 1) or per slot (0),
        the value ones per token, broadcast over their channels; one ``tl.dot`` for the logits and one for the
        values. With ``WINDOW`` (a launch of its own, so that the main loop keeps the registers it needs): the
        ``sp``-th tile of ``[qend, n)``, partial ``splits + sp``: the values all from the window there, the keys
        quantized below ``floor(n / RES) RES`` and from the window above."""
        bh, sp, b, h, offs_g, offs_d, q = program_query(q_ptr, stride_qb, stride_qh, HKV, G, G_PAD, HEAD_DIM)
        offs_t = tl.arange(0, DB)
        offs_c = tl.arange(0, BLOCK_C)
        n = tl.load(n_ptr + b).to(tl.int32)
        qend = tl.maximum(n - RES, 0)  # slots below: key and value quantized
        kc_base = kc_ptr + b * stride_kcb + h * stride_kch
        ks_base = ks_ptr + b * stride_ksb + h * stride_ksh
        km_base = km_ptr + b * stride_ksb + h * stride_ksh
        vis_base = vis_ptr + b * stride_vib + h * stride_vih
        m_i, l_i, acc = empty_channel_state(G_PAD, HEAD_DIM)
        if not WINDOW:
            lo = sp * split
            hi = tl.minimum(lo + split, qend)
            vc_base = vc_ptr + b * stride_vcb + h * stride_vch
            vs_base = vs_ptr + b * stride_vsb + h * stride_vsh
            vm_base = vm_ptr + b * stride_vsb + h * stride_vsh
            for c0 in range(lo, hi, BLOCK_C):
                rows = c0 + offs_c
                live = rows < hi
                visible = tl.load(vis_base + rows, mask=live, other=0) != 0
                kb = tl.load(kc_base + rows[:, None] * stride_kct + offs_t[None, :], mask=live[:, None], other=0)
                ks = _key_groups(ks_base, c0, rows, live, hi, offs_d, stride_ksg, GROUP, BLOCK_C, HEAD_DIM,
                                 KEY_PATH)
                km = _key_groups(km_base, c0, rows, live, hi, offs_d, stride_ksg, GROUP, BLOCK_C, HEAD_DIM,
                                 KEY_PATH)
                u = channel_codes(kb.to(tl.int32), PER_BYTE, BLOCK_C, HEAD_DIM)
                k = _dequantize(u, ks, km, OFFSET, DOT_UPCAST)
                s = dot_fp32(q, tl.trans(k.to(q.dtype)), None, DOT_PRECISION, DOT_UPCAST)  # [G_PAD, BLOCK_C]
                s = tl.where(visible[None, :], s * qk_scale, float("-inf"))
                m_i, l_i, alpha, p = online_lse_step(m_i, l_i, s)
                vb = tl.load(vc_base + rows[:, None] * stride_vct + offs_t[None, :], mask=live[:, None], other=0)
                vs = _value_groups(vs_base, rows, live, stride_vst, BLOCK_C, HEAD_DIM, VGROUP)
                vm = _value_groups(vm_base, rows, live, stride_vst, BLOCK_C, HEAD_DIM, VGROUP)
                u = channel_codes(vb.to(tl.int32), PER_BYTE, BLOCK_C, HEAD_DIM)
                v = _dequantize(u, vs, vm, OFFSET, DOT_UPCAST)
                acc = dot_fp32(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], DOT_PRECISION, DOT_UPCAST)
        else:  # tile sp of [qend, n): the values from the window, the keys quantized or from it
            key_end = n // RES * RES
            rows = qend + sp * BLOCK_C + offs_c
            live = rows < n
            visible = tl.load(vis_base + rows, mask=live, other=0) != 0
            k_quant = live & (rows < key_end)
            k_window = live & (rows >= key_end)
            kb = tl.load(kc_base + rows[:, None] * stride_kct + offs_t[None, :], mask=k_quant[:, None], other=0)
            ks = _key_groups(ks_base, 0, rows, k_quant, 0, offs_d, stride_ksg, GROUP, BLOCK_C, HEAD_DIM, 0)
            km = _key_groups(km_base, 0, rows, k_quant, 0, offs_d, stride_ksg, GROUP, BLOCK_C, HEAD_DIM, 0)
            u = channel_codes(kb.to(tl.int32), PER_BYTE, BLOCK_C, HEAD_DIM)
            k = _dequantize(u, ks, km, OFFSET, DOT_UPCAST)
            ring = (kw_ptr + b * stride_wb + h * stride_wh) + (rows % RES)[:, None] * stride_wt + offs_d[None, :]
            kw = tl.load(ring, mask=k_window[:, None], other=0.0)
            k = tl.where(k_window[:, None], kw.to(q.dtype), k.to(q.dtype))
            s = dot_fp32(q, tl.trans(k), None, DOT_PRECISION, DOT_UPCAST)
            s = tl.where(visible[None, :], s * qk_scale, float("-inf"))
            m_i, l_i, alpha, p = online_lse_step(m_i, l_i, s)
            ring = (vw_ptr + b * stride_wb + h * stride_wh) + (rows % RES)[:, None] * stride_wt + offs_d[None, :]
            v = tl.load(ring, mask=live[:, None], other=0.0)
            acc = dot_fp32(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], DOT_PRECISION, DOT_UPCAST)
        part = bh * parts + sp
        if WINDOW:
            part += splits
        store_channel_partials(m_ptr, l_ptr, acc_ptr, part, offs_g, offs_d, m_i, l_i, acc, G_PAD, HEAD_DIM)


KEY_PATHS = ("auto", "broadcast", "gather")
CUDA_MIN_BLOCK_C = 32  # tiles of 16 slots gave wrong results on the H200 with Triton 3.6 (module docstring)


def resolve_key_path(key_path: str, group_size: int, block_c: int) -> str:
    """The kernel's key path for this launch (module docstring): ``"auto"`` is ``"broadcast"`` where a tile lies in
    one key group (``group_size % block_c == 0``) or holds whole groups of a power-of-two size, else ``"gather"``."""
    check(key_path in KEY_PATHS, f"key_path={key_path!r} is unknown: expected one of {', '.join(KEY_PATHS)}")
    broadcast_ok = group_size % block_c == 0 or (is_pow2(group_size) and block_c % group_size == 0)
    if key_path == "auto":
        key_path = "broadcast" if broadcast_ok else "gather"
    check(key_path != "broadcast" or broadcast_ok,
          f"key_path='broadcast' is invalid for group_size={group_size}, block_c={block_c}: expected group_size a "
          f"multiple of block_c, or a power of two dividing it")
    return key_path


def check_cuda_block_c(block_c: int, on_cuda: bool) -> None:
    """A one-line error for a tile of fewer than :data:`CUDA_MIN_BLOCK_C` slots when the kernel runs on CUDA
    (``on_cuda``; not in Triton's CPU interpreter, which computes such tiles right): ``block_c=16`` gave wrong
    results (most elements off, by up to 0.19) on the H200 with Triton 3.6, where the default 32 agreed with
    torch."""
    check(not on_cuda or block_c >= CUDA_MIN_BLOCK_C,
          f"block_c={block_c} is invalid for the KIVI decode kernel on CUDA: expected a power of two >= "
          f"{CUDA_MIN_BLOCK_C} (16 gave wrong results on the H200 with Triton 3.6)")


def _triton_decode(query, key_codes, key_scale, key_min, value_codes, value_scale, value_min, key_window,
                   value_window, filled, visible, bits, group_size, value_group, scale, block_c, split, num_warps,
                   num_stages, key_path) -> Tensor:
    check(HAS_TRITON, "backend='triton' is unavailable: triton is not installed (use backend='torch')")
    b, hq, d = query.shape
    hkv, cap = value_codes.shape[1], value_codes.shape[2]
    r = key_window.shape[2]
    check(query.is_cuda or interpreting(),
          f"device {query.device} is invalid for backend='triton': expected a CUDA tensor "
          "(or TRITON_INTERPRET=1 to run the kernel on the CPU)")
    check(fused_decode_applies(query.device, d, bits),
          f"head_dim={d} is invalid for backend='triton' at {bits} bits: expected a power of two in [16, 256] "
          f"with head_dim * bits / 8 >= 16")
    check_launch(num_warps, num_stages, block_c=block_c)
    check_cuda_block_c(block_c, query.is_cuda and not interpreting())
    key_path = resolve_key_path(key_path, group_size, block_c)
    if split is None:
        split = default_split(cap, b * hkv, block_c, query.device)
    check(isinstance(split, int) and split >= block_c and split % block_c == 0,
          f"split={split!r} is invalid: expected a multiple of block_c={block_c}")
    g = hq // hkv
    g_pad = max(16, triton.next_power_of_2(g))
    splits = max(1, triton.cdiv(cap, split))
    kc, ks, km = key_codes.contiguous(), key_scale.contiguous(), key_min.contiguous()
    vc, vs, vm = value_codes.contiguous(), value_scale.contiguous(), value_min.contiguous()
    kw, vw = key_window.contiguous(), value_window.contiguous()
    n = filled.to(torch.int64).contiguous()
    vis = (visible if visible.stride(-1) == 1 else visible.contiguous()).view(torch.uint8)
    q = query.contiguous()
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        q = q.float()
    # the window's parts, a launch of their own: [max(n - R, 0), n) holds at most min(R, capacity) slots
    parts = splits + triton.cdiv(min(r, cap), block_c)
    dev = query.device
    m = torch.empty(b * hkv, parts, g_pad, dtype=torch.float32, device=dev)
    l_ = torch.empty_like(m)
    acc = torch.empty(b * hkv, parts, g_pad, d, dtype=torch.float32, device=dev)
    args = (q, kc, ks, km, vc, vs, vm, kw, vw, n, vis, m, l_, acc,
            q.stride(0), q.stride(1),
            kc.stride(0), kc.stride(1), kc.stride(2),
            ks.stride(0), ks.stride(1), ks.stride(2),
            vc.stride(0), vc.stride(1), vc.stride(2),
            vs.stride(0), vs.stride(1), vs.stride(2),
            kw.stride(0), kw.stride(1), kw.stride(2),
            vis.stride(0), vis.stride(1) if vis.shape[1] > 1 else 0)
    shape = dict(HKV=hkv, G=g, G_PAD=g_pad, HEAD_DIM=d, PER_BYTE=8 // bits, DB=d * bits // 8, BLOCK_C=block_c,
                 GROUP=group_size, VGROUP=value_group, RES=r,
                 DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", DOT_UPCAST=interpreting(),
                 num_warps=num_warps, num_stages=num_stages)
    # dequantize in the query's 16-bit dtype where the codes are exact in it from their bits (module docstring)
    half = q.dtype in (torch.bfloat16, torch.float16) and all(t.dtype == q.dtype for t in (ks, km, vs, vm))
    offset = 0 if not half else 128 if (q.dtype == torch.bfloat16 and bits <= 4) else \
        1024 if q.dtype == torch.float16 else 0
    for grid, window in (((b * hkv, splits), False), ((b * hkv, parts - splits), True)):
        _kivi_decode_kernel[grid](*args, split, splits, parts, float(scale) * LOG2E,
                                  KEY_PATH={"gather": 0, "broadcast": 1}[key_path], OFFSET=offset, WINDOW=window,
                                  **shape)
    return merge_splits(m, l_, acc, b, hq, hkv)


def kivi_decode_attention(query: Tensor, key_codes: Tensor, key_scale: Tensor, key_min: Tensor, value_codes: Tensor,
                          value_scale: Tensor, value_min: Tensor, key_window: Tensor, value_window: Tensor,
                          filled: Tensor, visible: Tensor, bits: int, group_size: int, scale: float | None = None, *,
                          backend: str = "auto", block_c: int = 32, split: int | None = None, num_warps: int = 4,
                          num_stages: int = 2, key_path: str = "auto") -> Tensor:
    """One-token attention over a KIVI store's buffers (module docstring); ``[batch, q_heads, head_dim]`` float32.

    The Triton launch: ``block_c`` (slots per tile, at least 32 on CUDA: :func:`check_cuda_block_c`), ``split``
    (slots per program, a multiple of ``block_c``; default :func:`~kvlearn.ops.packed_decode.default_split`),
    ``num_warps``, ``num_stages``, and the kernel's ``key_path`` (:func:`resolve_key_path`). The torch backend
    ignores them."""
    b, hq, hkv, cap, d, r, value_group = _check_inputs(query, key_codes, key_scale, key_min, value_codes, value_scale,
                                                       value_min, key_window, value_window, filled, visible, bits,
                                                       group_size)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    check(isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0,
          f"scale={scale!r} is invalid: expected a float > 0")
    check(backend in BACKENDS, f"backend={backend!r} is unknown: expected one of {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = "triton" if query.is_cuda and fused_decode_applies(query.device, d, bits) else "torch"
    if visible.shape[1] != hkv:
        visible = visible.expand(b, hkv, cap)
    with torch.no_grad():
        if backend == "torch":
            keys, values = kivi_read(key_codes, key_scale, key_min, value_codes, value_scale, value_min, key_window,
                                     value_window, filled, bits, key_window.dtype)
            return _torch_decode(query, keys, values, visible, scale)
        return _triton_decode(query, key_codes, key_scale, key_min, value_codes, value_scale, value_min, key_window,
                              value_window, filled, visible, bits, group_size, value_group, scale, block_c, split,
                              num_warps, num_stages, key_path)
