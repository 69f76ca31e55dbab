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
values **in registers** (codes, their group's scale and minimum, or the window row) and attends it there: no
dequantized copy of the store is ever written to memory, which a read-then-attend path allocates at every step
(``2 * slots * head_dim`` model-dtype elements per layer).

Inputs (one device): ``query [batch, q_heads, head_dim]``; the store's buffers ``key_codes [batch, kv_heads, Q,
head_dim * b / 8]`` uint8 (``Q = floor(capacity / R) R``), ``key_scale``, ``key_min [batch, kv_heads, Q / G,
head_dim]``, ``value_codes [batch, kv_heads, capacity, head_dim * b / 8]``, ``value_scale``, ``value_min [batch,
kv_heads, capacity, head_dim / G_v]``, ``key_window``, ``value_window [batch, kv_heads, R, head_dim]``, ``filled
[batch]`` int64 (tokens written per row); ``visible`` bool ``[batch, kv_heads or 1, capacity]`` (at least one
visible slot per row); ``bits`` in {2, 4, 8}; ``group_size`` ``G``. Returns ``[batch, q_heads, head_dim]`` float32.

Backends: ``"torch"`` (:func:`kivi_read`, the whole store dequantized, then a masked softmax in float32: the
reference, any device) and ``"triton"`` (split-K flash decoding as in :mod:`kvlearn.ops.packed_decode`: programs over
``(batch * kv_heads, slot splits)``, each holding the ``G`` query heads of one KV head, the codes split into
``8 / b`` bit planes in registers, tiles rebuilt in float32 then cast to the query's dtype for ``tl.dot``; the same
merge kernel). ``"auto"`` takes Triton on CUDA where :func:`~kvlearn.ops.packed_decode.fused_decode_applies`. Runs
on the CPU in Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvlearn.errors import check
from kvlearn.ops.packed_decode import BACKENDS, default_split, fused_decode_applies, merge_splits
from kvlearn.ops.quant import QUANT_BITS, check_bits, kivi_dequantize_keys, kivi_dequantize_values, unpack
from kvlearn.ops.triton_support import HAS_TRITON, LOG2E, interpreting, is_pow2, tl, triton

if HAS_TRITON:
    from kvlearn.ops.packed_decode import empty_split_state, query_planes, store_split_partials
    from kvlearn.ops.triton_support import dot_fp32, online_lse_step

__all__ = ["kivi_decode_attention", "kivi_read"]


def _unsigned(packed: Tensor, bits: int, n: int) -> Tensor:
    """Packed bytes -> the unsigned KIVI codes ``[0, 2^b)`` (``pack`` stored them biased by ``-2^(b-1)``)."""
    return (unpack(packed, bits, n).to(torch.int16) + 2 ** (bits - 1)).to(torch.uint8)


def kivi_read(key_codes, key_scale, key_min, value_codes, value_scale, value_min, key_window, value_window, filled,
              bits: int, dtype) -> tuple[Tensor, Tensor]:
    """Every slot of a KIVI store in ``dtype``, ``[batch, kv_heads, capacity, dim]`` keys and values (module
    docstring: quantized slots dequantized, the window's tokens in full precision, slots past ``filled`` zeros)."""
    dk, dv = key_window.shape[-1], value_window.shape[-1]
    b, h, cap = value_codes.shape[:3]
    r, qs = key_window.shape[2], key_codes.shape[2]
    arange = torch.arange(cap, device=filled.device)[None, :]
    n = filled[:, None]
    keys = (kivi_dequantize_keys(_unsigned(key_codes, bits, dk), key_scale, key_min, dtype) if qs > 0
            else key_window.new_zeros(b, h, 0, dk).to(dtype))  # capacity < R: every key lives in the window
    if qs < cap:
        keys = torch.cat([keys, keys.new_zeros(b, h, cap - qs, dk)], dim=2)
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
    def _unsigned_plane(byte, J: tl.constexpr, BITS: tl.constexpr):
        """Plane ``J`` of packed bytes (int32): the unsigned codes of elements ``t * PER_BYTE + J``, as float32."""
        return ((byte >> (J * BITS)) & ((1 << BITS) - 1)).to(tl.float32)

    @triton.jit
    def _key_tile(kb, J: tl.constexpr, BITS: tl.constexpr, PER_BYTE: tl.constexpr, rows, quant, window, offs_t,
                  ks_base, km_base, kw_base, stride_sg, stride_wt, GROUP: tl.constexpr, RES: tl.constexpr):
        """Plane ``J`` of a tile of keys ``[BLOCK_C, DB]`` float32: ``code * scale + min`` of the slot's token group
        where ``quant``, the window row where ``window``, zeros elsewhere."""
        cols = offs_t * PER_BYTE + J
        grp = rows // GROUP
        ks = tl.load(ks_base + grp[:, None] * stride_sg + cols[None, :], mask=quant[:, None], other=0.0)
        km = tl.load(km_base + grp[:, None] * stride_sg + cols[None, :], mask=quant[:, None], other=0.0)
        kw = tl.load(kw_base + (rows % RES)[:, None] * stride_wt + cols[None, :], mask=window[:, None], other=0.0)
        kq = _unsigned_plane(kb, J, BITS) * ks.to(tl.float32) + km.to(tl.float32)
        return tl.where(window[:, None], kw.to(tl.float32), kq)

    @triton.jit
    def _value_tile(vb, J: tl.constexpr, BITS: tl.constexpr, PER_BYTE: tl.constexpr, rows, quant, window, offs_t,
                    vs_base, vm_base, vw_base, stride_vst, stride_wt, VGROUP: tl.constexpr, RES: tl.constexpr):
        """Plane ``J`` of a tile of values ``[BLOCK_C, DB]`` float32: ``code * scale + min`` of the token's channel
        group where ``quant``, the window row where ``window``, zeros elsewhere."""
        cols = offs_t * PER_BYTE + J
        grp = cols // VGROUP
        vs = tl.load(vs_base + rows[:, None] * stride_vst + grp[None, :], mask=quant[:, None], other=0.0)
        vm = tl.load(vm_base + rows[:, None] * stride_vst + grp[None, :], mask=quant[:, None], other=0.0)
        vw = tl.load(vw_base + (rows % RES)[:, None] * stride_wt + cols[None, :], mask=window[:, None], other=0.0)
        vq = _unsigned_plane(vb, J, BITS) * vs.to(tl.float32) + vm.to(tl.float32)
        return tl.where(window[:, None], vw.to(tl.float32), vq)

    @triton.jit
    def _kivi_decode_kernel(
        q_ptr,  # [B, Hq, D]
        kc_ptr, ks_ptr, km_ptr,  # key codes [B, Hkv, Q, DB] uint8; key scale / min [B, Hkv, Q / GROUP, D]
        vc_ptr, vs_ptr, vm_ptr,  # value codes [B, Hkv, C, DB] uint8; value scale / min [B, Hkv, C, D / VGROUP]
        kw_ptr, vw_ptr,  # windows [B, Hkv, RES, D]
        n_ptr,  # filled [B] int64
        vis_ptr,  # bool viewed as uint8 [B, Hv, C] (Hv = Hkv or 1; stride 0 when shared)
        m_ptr, l_ptr, acc_ptr,  # partials: [B * Hkv, SPLITS, G_PAD], [..., G_PAD], [..., G_PAD, D] float32
        stride_qb, stride_qh,
        stride_kcb, stride_kch, stride_kct,
        stride_ksb, stride_ksh, stride_ksg,
        stride_vcb, stride_vch, stride_vct,
        stride_vsb, stride_vsh, stride_vst,
        stride_wb, stride_wh, stride_wt,
        stride_vib, stride_vih,
        C, qk_scale,  # scale * log2(e)
        HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        PER_BYTE: tl.constexpr, DB: tl.constexpr, BITS: tl.constexpr, BLOCK_C: tl.constexpr,
        SPLIT: tl.constexpr, SPLITS: tl.constexpr, GROUP: tl.constexpr, VGROUP: tl.constexpr, RES: tl.constexpr,
        DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    ):
        """One (batch x KV head, slot split): tiles of ``BLOCK_C`` slots rebuilt in registers plane by plane, an
        online softmax in base 2 (the packed kernel's loop with KIVI's tiles)."""
        bh = tl.program_id(0)
        sp = tl.program_id(1)
        b = (bh // HKV).to(tl.int64)
        h = (bh % HKV).to(tl.int64)
        offs_g = tl.arange(0, G_PAD)
        offs_t = tl.arange(0, DB)
        offs_c = tl.arange(0, BLOCK_C)
        q_rows = q_ptr + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh
        q0, q1, q2, q3 = query_planes(q_rows, offs_t, offs_g < G, PER_BYTE, HEAD_DIM)
        n = tl.load(n_ptr + b)
        key_end = n // RES * RES  # keys below are quantized, the rest up to n in the window
        value_end = n - RES  # values below are quantized
        kc_base = kc_ptr + b * stride_kcb + h * stride_kch
        ks_base = ks_ptr + b * stride_ksb + h * stride_ksh
        km_base = km_ptr + b * stride_ksb + h * stride_ksh
        vc_base = vc_ptr + b * stride_vcb + h * stride_vch
        vs_base = vs_ptr + b * stride_vsb + h * stride_vsh
        vm_base = vm_ptr + b * stride_vsb + h * stride_vsh
        kw_base = kw_ptr + b * stride_wb + h * stride_wh
        vw_base = vw_ptr + b * stride_wb + h * stride_wh
        vis_base = vis_ptr + b * stride_vib + h * stride_vih
        m_i, l_i, acc0, acc1, acc2, acc3 = empty_split_state(G_PAD, DB)
        lo = sp * SPLIT
        hi = tl.minimum(lo + SPLIT, C)
        for c0 in range(lo, hi, BLOCK_C):
            rows = c0 + offs_c
            live = (rows < hi) & (rows < n)
            visible = tl.load(vis_base + rows, mask=live, other=0) != 0
            k_quant = live & (rows < key_end)
            k_window = live & (rows >= key_end)
            kb = tl.load(kc_base + rows[:, None] * stride_kct + offs_t[None, :], mask=k_quant[:, None], other=0)
            kb = kb.to(tl.int32)
            k0 = _key_tile(kb, 0, BITS, PER_BYTE, rows, k_quant, k_window, offs_t, ks_base, km_base, kw_base,
                           stride_ksg, stride_wt, GROUP, RES)
            s = dot_fp32(q0, tl.trans(k0.to(q0.dtype)), None, DOT_PRECISION, DOT_UPCAST)
            if PER_BYTE > 1:
                k1 = _key_tile(kb, 1, BITS, PER_BYTE, rows, k_quant, k_window, offs_t, ks_base, km_base, kw_base,
                               stride_ksg, stride_wt, GROUP, RES)
                s = dot_fp32(q1, tl.trans(k1.to(q0.dtype)), s, DOT_PRECISION, DOT_UPCAST)
            if PER_BYTE > 2:
                k2 = _key_tile(kb, 2, BITS, PER_BYTE, rows, k_quant, k_window, offs_t, ks_base, km_base, kw_base,
                               stride_ksg, stride_wt, GROUP, RES)
                s = dot_fp32(q2, tl.trans(k2.to(q0.dtype)), s, DOT_PRECISION, DOT_UPCAST)
                k3 = _key_tile(kb, 3, BITS, PER_BYTE, rows, k_quant, k_window, offs_t, ks_base, km_base, kw_base,
                               stride_ksg, stride_wt, GROUP, RES)
                s = dot_fp32(q3, tl.trans(k3.to(q0.dtype)), s, DOT_PRECISION, DOT_UPCAST)
            s = tl.where(visible[None, :], s * qk_scale, float("-inf"))
            m_i, l_i, alpha, p = online_lse_step(m_i, l_i, s)
            p = p.to(q0.dtype)  # [G_PAD, BLOCK_C]
            v_quant = live & (rows < value_end)
            v_window = live & (rows >= value_end)
            vb = tl.load(vc_base + rows[:, None] * stride_vct + offs_t[None, :], mask=v_quant[:, None], other=0)
            vb = vb.to(tl.int32)
            v0 = _value_tile(vb, 0, BITS, PER_BYTE, rows, v_quant, v_window, offs_t, vs_base, vm_base, vw_base,
                             stride_vst, stride_wt, VGROUP, RES)
            acc0 = dot_fp32(p, v0.to(q0.dtype), acc0 * alpha[:, None], DOT_PRECISION, DOT_UPCAST)
            if PER_BYTE > 1:
                v1 = _value_tile(vb, 1, BITS, PER_BYTE, rows, v_quant, v_window, offs_t, vs_base, vm_base, vw_base,
                                 stride_vst, stride_wt, VGROUP, RES)
                acc1 = dot_fp32(p, v1.to(q0.dtype), acc1 * alpha[:, None], DOT_PRECISION, DOT_UPCAST)
            if PER_BYTE > 2:
                v2 = _value_tile(vb, 2, BITS, PER_BYTE, rows, v_quant, v_window, offs_t, vs_base, vm_base, vw_base,
                                 stride_vst, stride_wt, VGROUP, RES)
                acc2 = dot_fp32(p, v2.to(q0.dtype), acc2 * alpha[:, None], DOT_PRECISION, DOT_UPCAST)
                v3 = _value_tile(vb, 3, BITS, PER_BYTE, rows, v_quant, v_window, offs_t, vs_base, vm_base, vw_base,
                                 stride_vst, stride_wt, VGROUP, RES)
                acc3 = dot_fp32(p, v3.to(q0.dtype), acc3 * alpha[:, None], DOT_PRECISION, DOT_UPCAST)
        store_split_partials(m_ptr, l_ptr, acc_ptr, bh * SPLITS + sp, offs_g, offs_t, m_i, l_i, acc0, acc1, acc2, acc3,
                             G_PAD, HEAD_DIM, PER_BYTE)


def _triton_decode(query, key_codes, key_scale, key_min, value_codes, value_scale, value_min, key_window,
                   value_window, filled, visible, bits, group_size, value_group, scale, block_c, split) -> Tensor:
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
    check(is_pow2(block_c) and block_c >= 16, f"block_c={block_c!r} is invalid: expected a power of two >= 16")
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
    dev = query.device
    m = torch.empty(b * hkv, splits, g_pad, dtype=torch.float32, device=dev)
    l_ = torch.empty_like(m)
    acc = torch.empty(b * hkv, splits, g_pad, d, dtype=torch.float32, device=dev)
    _kivi_decode_kernel[(b * hkv, splits)](
        q, kc, ks, km, vc, vs, vm, kw, vw, n, vis, m, l_, acc,
        q.stride(0), q.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2),
        vc.stride(0), vc.stride(1), vc.stride(2),
        vs.stride(0), vs.stride(1), vs.stride(2),
        kw.stride(0), kw.stride(1), kw.stride(2),
        vis.stride(0), vis.stride(1) if vis.shape[1] > 1 else 0,
        cap, float(scale) * LOG2E,
        HKV=hkv, G=g, G_PAD=g_pad, HEAD_DIM=d, PER_BYTE=8 // bits, DB=d * bits // 8, BITS=bits, BLOCK_C=block_c,
        SPLIT=split, SPLITS=splits, GROUP=group_size, VGROUP=value_group, RES=r,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", DOT_UPCAST=interpreting(),
        num_warps=4, num_stages=2)
    return merge_splits(m, l_, acc, b, hq, hkv)


def kivi_decode_attention(query: Tensor, key_codes: Tensor, key_scale: Tensor, key_min: Tensor, value_codes: Tensor,
                          value_scale: Tensor, value_min: Tensor, key_window: Tensor, value_window: Tensor,
                          filled: Tensor, visible: Tensor, bits: int, group_size: int, scale: float | None = None, *,
                          backend: str = "auto", block_c: int = 32, split: int | None = None) -> Tensor:
    """One-token attention over a KIVI store's buffers (module docstring); ``[batch, q_heads, head_dim]`` float32.

    ``block_c`` (slots per tile) and ``split`` (slots per program, a multiple of ``block_c``; default
    :func:`~kvlearn.ops.packed_decode.default_split`) are the Triton launch's; the torch backend ignores them."""
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
                              value_window, filled, visible, bits, group_size, value_group, scale, block_c, split)
