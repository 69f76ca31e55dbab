"""One-token attention over a packed-integer KV store, dequantized inside the kernel (KV-Kaizen's precision axis).

A decode step attends one new query per query head to every stored slot of its KV head. The store
(:class:`kvlearn.cache.PackedStore`, layout in :mod:`kvlearn.ops.quant`) holds, per slot, ``bits``-bit codes packed
``8 / bits`` to a byte and one scale per stored vector. Because the quantizer is symmetric per vector,

    <q, k_c>          = s^K_c * <q, code^K_c>
    sum_c p_c v_c     = sum_c (p_c s^V_c) code^V_c

so the kernel never forms a dequantized key or value: it unpacks codes into registers, multiplies by ``q`` (or
by the probabilities times the value scales) and scales one number per slot. No full-size temporary exists, so the
memory the store saves is not spent again at every step (a read-then-attend path allocates
``2 * slots * head_dim`` model-dtype elements per layer and step).

Inputs (all on one device):

- ``query [batch, q_heads, head_dim]`` (the step's one query per head), any float dtype;
- ``key_codes``, ``value_codes``: uint8 ``[batch, kv_heads, slots, head_dim * bits / 8]``;
- ``key_scales``, ``value_scales``: ``[batch, kv_heads, slots]`` (the model dtype);
- ``visible``: bool ``[batch, kv_heads or 1, slots]``, the slots this query may attend (at least one per row);
- ``bits`` in {2, 4, 8}; ``scale``: the logit scale (default ``1 / sqrt(head_dim)``).

Returns ``[batch, q_heads, head_dim]`` float32. Query head ``i`` reads KV head ``i // (q_heads / kv_heads)``.

Backends: ``"torch"`` (dequantize, then a masked softmax in float32: the reference, any device) and ``"triton"``
(split-K flash decoding: programs over ``(batch * kv_heads, slot splits)`` each hold the ``G`` query heads of one
KV head, padded to 16 rows for ``tl.dot``, and stream slot tiles with an online softmax in base 2; a torch epilogue
merges the splits). ``"auto"`` takes Triton on CUDA when triton is installed. Runs on the CPU in Triton's
interpreter (``TRITON_INTERPRET=1`` set before triton is imported).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from kvlearn.errors import check, check_int
from kvlearn.ops.quant import QUANT_BITS, check_bits, dequantize, unpack
from kvlearn.ops.triton_support import HAS_TRITON, LOG2E, interpreting, is_pow2, tl, triton

__all__ = ["BACKENDS", "fused_decode_applies", "packed_decode_attention"]

BACKENDS = ("auto", "torch", "triton")


def fused_decode_applies(device: torch.device, head_dim: int) -> bool:
    """Whether the Triton kernel takes a decode step here: triton installed, a CUDA device (or Triton's CPU
    interpreter), ``head_dim`` a power of two in [16, 256]."""
    return (HAS_TRITON and (torch.device(device).type == "cuda" or interpreting())
            and is_pow2(head_dim) and 16 <= head_dim <= 256)


def _check_inputs(query, key_codes, key_scales, value_codes, value_scales, visible, bits) -> tuple[int, ...]:
    check_bits(bits, QUANT_BITS)
    check(isinstance(query, Tensor) and query.dim() == 3,
          f"query shape={tuple(getattr(query, 'shape', ()))} is invalid: expected [batch, q_heads, head_dim]")
    b, hq, d = query.shape
    per_byte = 8 // bits
    check(d % per_byte == 0, f"head_dim={d} is invalid for {bits}-bit codes: expected a multiple of {per_byte}")
    for name, codes in (("key_codes", key_codes), ("value_codes", value_codes)):
        check(isinstance(codes, Tensor) and codes.dtype == torch.uint8 and codes.dim() == 4
              and codes.shape[0] == b and codes.shape[3] == d // per_byte,
              f"{name} shape={tuple(getattr(codes, 'shape', ()))} dtype={getattr(codes, 'dtype', None)} is invalid: "
              f"expected uint8 [batch={b}, kv_heads, slots, head_dim * bits / 8 = {d // per_byte}]")
    hkv, slots = key_codes.shape[1], key_codes.shape[2]
    check(tuple(value_codes.shape[:3]) == (b, hkv, slots),
          f"value_codes shape={tuple(value_codes.shape)} is invalid: expected the key codes' [batch, kv_heads, slots]"
          f" = {(b, hkv, slots)}")
    check(hkv >= 1 and hq % hkv == 0, f"q_heads={hq} is invalid: expected a multiple of kv_heads={hkv}")
    for name, s in (("key_scales", key_scales), ("value_scales", value_scales)):
        check(isinstance(s, Tensor) and tuple(s.shape) == (b, hkv, slots),
              f"{name} shape={tuple(getattr(s, 'shape', ()))} is invalid: expected [batch, kv_heads, slots] = "
              f"{(b, hkv, slots)}")
    check(isinstance(visible, Tensor) and visible.dtype == torch.bool and visible.dim() == 3
          and visible.shape[0] == b and visible.shape[1] in (1, hkv) and visible.shape[2] == slots,
          f"visible shape={tuple(getattr(visible, 'shape', ()))} dtype={getattr(visible, 'dtype', None)} is invalid: "
          f"expected bool [batch={b}, kv_heads={hkv} or 1, slots={slots}]")
    return b, hq, hkv, slots, d


def _torch_decode(query, key_codes, key_scales, value_codes, value_scales, visible, bits, scale) -> Tensor:
    """The reference: dequantize every slot, then a masked softmax, all in float32."""
    b, hq, d = query.shape
    hkv = key_codes.shape[1]
    g = hq // hkv
    keys = dequantize(unpack(key_codes, bits, d), key_scales, torch.float32)  # [B, Hkv, C, D]
    values = dequantize(unpack(value_codes, bits, d), value_scales, torch.float32)
    q = query.float().reshape(b, hkv, g, d)
    logits = torch.einsum("bhgd,bhcd->bhgc", q, keys) * scale
    logits = logits.masked_fill(~visible[:, :, None, :].expand(b, hkv, g, -1), -math.inf)
    out = torch.einsum("bhgc,bhcd->bhgd", torch.softmax(logits, dim=-1), values)
    return out.reshape(b, hq, d)


if HAS_TRITON:

    @triton.jit
    def _unpacked(codes_ptr, rows, row_live, stride_row, offs_d, PER_BYTE: tl.constexpr, BITS: tl.constexpr):
        """Codes ``[len(rows), HEAD_DIM]`` as float32 from packed bytes (element ``e`` in byte ``e // PER_BYTE``,
        bits ``[(e % PER_BYTE) * BITS, ...)``, biased by ``2^(BITS - 1)``)."""
        byte = tl.load(codes_ptr + rows[:, None] * stride_row + (offs_d // PER_BYTE)[None, :],
                       mask=row_live[:, None], other=0).to(tl.int32)
        u = (byte >> ((offs_d % PER_BYTE) * BITS)[None, :]) & ((1 << BITS) - 1)
        return (u - (1 << (BITS - 1))).to(tl.float32)

    @triton.jit
    def _packed_decode_kernel(
        q_ptr,  # [B, Hq, D]
        kc_ptr, ks_ptr, vc_ptr, vs_ptr,  # codes [B, Hkv, C, D / PER_BYTE] uint8, scales [B, Hkv, C]
        vis_ptr,  # bool as uint8 [B, Hv, C] (Hv = Hkv or 1)
        m_ptr, l_ptr, acc_ptr,  # partials: [B * Hkv, SPLITS, G_PAD], [..., G_PAD], [..., G_PAD, D] float32
        stride_qb, stride_qh,
        stride_cb, stride_ch, stride_ct,  # codes (keys and values share the layout)
        stride_sb, stride_sh,  # scales
        stride_vb, stride_vh,  # visibility
        C, qk_scale,  # scale * log2(e)
        HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        PER_BYTE: tl.constexpr, BITS: tl.constexpr, BLOCK_C: tl.constexpr, SPLIT: tl.constexpr,
        SPLITS: tl.constexpr, INTERPRET: tl.constexpr,
    ):
        bh = tl.program_id(0)
        sp = tl.program_id(1)
        b = (bh // HKV).to(tl.int64)
        h = (bh % HKV).to(tl.int64)
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        offs_c = tl.arange(0, BLOCK_C)
        g_live = offs_g < G
        q = tl.load(q_ptr + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
                    mask=g_live[:, None], other=0.0).to(tl.float32)
        kc_base = kc_ptr + b * stride_cb + h * stride_ch
        vc_base = vc_ptr + b * stride_cb + h * stride_ch
        ks_base = ks_ptr + b * stride_sb + h * stride_sh
        vs_base = vs_ptr + b * stride_sb + h * stride_sh
        vis_base = vis_ptr + b * stride_vb + h * stride_vh
        m_i = tl.full([G_PAD], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([G_PAD], dtype=tl.float32)
        acc = tl.zeros([G_PAD, HEAD_DIM], dtype=tl.float32)
        lo = sp * SPLIT
        hi = tl.minimum(lo + SPLIT, C)
        c0 = lo
        while c0 < hi:
            rows = c0 + offs_c
            live = rows < hi
            visible = tl.load(vis_base + rows, mask=live, other=0) != 0
            k_codes = _unpacked(kc_base, rows, live, stride_ct, offs_d, PER_BYTE, BITS)  # [BLOCK_C, D]
            k_scale = tl.load(ks_base + rows, mask=live, other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k_codes), input_precision="ieee") * (k_scale * qk_scale)[None, :]
            s = tl.where(visible[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.math.exp2(m_i - m_new)
            p = tl.math.exp2(s - m_new[:, None])  # masked: exp2(-inf) = 0
            l_i = l_i * alpha + tl.sum(p, 1)
            v_codes = _unpacked(vc_base, rows, live, stride_ct, offs_d, PER_BYTE, BITS)
            v_scale = tl.load(vs_base + rows, mask=live, other=0.0).to(tl.float32)
            acc = acc * alpha[:, None] + tl.dot(p * v_scale[None, :], v_codes, input_precision="ieee")
            m_i = m_new
            c0 += BLOCK_C
        part = bh * SPLITS + sp
        tl.store(m_ptr + part * G_PAD + offs_g, m_i)
        tl.store(l_ptr + part * G_PAD + offs_g, l_i)
        tl.store(acc_ptr + (part * G_PAD + offs_g)[:, None] * HEAD_DIM + offs_d[None, :], acc)


def _triton_decode(query, key_codes, key_scales, value_codes, value_scales, visible, bits, scale,
                   block_c: int, split: int) -> Tensor:
    check(HAS_TRITON, "backend='triton' is unavailable: triton is not installed (use backend='torch')")
    b, hq, d = query.shape
    hkv, slots = key_codes.shape[1], key_codes.shape[2]
    check(query.is_cuda or interpreting(),
          f"device {query.device} is invalid for backend='triton': expected a CUDA tensor "
          "(or TRITON_INTERPRET=1 to run the kernel on the CPU)")
    check(fused_decode_applies(query.device, d),
          f"head_dim={d} is invalid for backend='triton': expected a power of two in [16, 256]")
    check(is_pow2(block_c) and block_c >= 16, f"block_c={block_c!r} is invalid: expected a power of two >= 16")
    check_int("split", split, block_c)
    g = hq // hkv
    g_pad = max(16, triton.next_power_of_2(g))
    splits = max(1, triton.cdiv(slots, split))
    per_byte = 8 // bits
    kc, vc = key_codes.contiguous(), value_codes.contiguous()
    ks, vs = key_scales.contiguous(), value_scales.contiguous()
    vis = visible.to(torch.uint8).contiguous()
    q = query.contiguous()
    dev = query.device
    m = torch.empty(b * hkv, splits, g_pad, dtype=torch.float32, device=dev)
    l_ = torch.empty_like(m)
    acc = torch.empty(b * hkv, splits, g_pad, d, dtype=torch.float32, device=dev)
    _packed_decode_kernel[(b * hkv, splits)](
        q, kc, ks, vc, vs, vis, m, l_, acc,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), ks.stride(0), ks.stride(1),
        vis.stride(0), vis.stride(1) if vis.shape[1] > 1 else 0,
        slots, float(scale) * LOG2E,
        HKV=hkv, G=g, G_PAD=g_pad, HEAD_DIM=d, PER_BYTE=per_byte, BITS=bits, BLOCK_C=block_c, SPLIT=split,
        SPLITS=splits, INTERPRET=interpreting(), num_warps=4, num_stages=2)
    # merge the splits (base 2): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s
    top = m.amax(dim=1, keepdim=True)
    w = torch.exp2(m - top)
    out = (acc * w[..., None]).sum(1) / (l_ * w).sum(1)[..., None]  # [B * Hkv, G_PAD, D]
    return out[:, :g].reshape(b, hkv * g, d)


def packed_decode_attention(query: Tensor, key_codes: Tensor, key_scales: Tensor, value_codes: Tensor,
                            value_scales: Tensor, visible: Tensor, bits: int, scale: float | None = None, *,
                            backend: str = "auto", block_c: int = 64, split: int = 1024) -> Tensor:
    """One-token attention over packed ``bits``-bit K/V (module docstring); ``[batch, q_heads, head_dim]`` float32.

    ``block_c`` (slots per tile) and ``split`` (slots per program, a multiple of ``block_c``) are the Triton
    launch's; the torch backend ignores them."""
    b, hq, hkv, slots, d = _check_inputs(query, key_codes, key_scales, value_codes, value_scales, visible, bits)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    check(isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0,
          f"scale={scale!r} is invalid: expected a float > 0")
    check(backend in BACKENDS, f"backend={backend!r} is unknown: expected one of {', '.join(BACKENDS)}")
    if backend == "auto":
        backend = "triton" if query.is_cuda and fused_decode_applies(query.device, d) else "torch"
    if visible.shape[1] != hkv:
        visible = visible.expand(b, hkv, slots)
    with torch.no_grad():
        if backend == "torch":
            return _torch_decode(query, key_codes, key_scales, value_codes, value_scales, visible, bits, scale)
        return _triton_decode(query, key_codes, key_scales, value_codes, value_scales, visible, bits, scale,
                              block_c, split)
