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
KV head, padded to 16 rows for ``tl.dot``, and stream slot tiles with an online softmax in base 2; a second small
kernel merges the splits). The codes are loaded as whole packed bytes (vector loads of contiguous rows) and split
in registers into ``8 / bits`` bit planes, plane ``J`` holding the elements ``t * 8 / bits + J``: one dot per plane
for the logits against the query's matching elements, and one per plane for the values into an accumulator kept
per plane, interleaved back when the split's partials are stored. The dot operands take the query's dtype (bf16
in a bf16 model: the codes are exact in it, and the probabilities go to bf16 for the value product as in flash
attention). A channel-order variant (codes unpacked with ``tl.join`` into one operand, one dot each) measured
slower at 64k-131k slots on the H200 (``results/packed_decode_h200.json``) and was removed; its channel-order
helpers (:func:`channel_codes`, :func:`program_query`, :func:`empty_channel_state`, :func:`store_channel_partials`)
stay here for :mod:`kvlearn.ops.kivi_decode`'s kernel, which shares :func:`merge_splits` and
:func:`default_split` too. ``"auto"`` takes Triton on CUDA when triton is installed. Runs on the CPU in Triton's
interpreter (``TRITON_INTERPRET=1`` set before triton is imported).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from kvlearn.errors import check, check_int
from kvlearn.ops.quant import QUANT_BITS, check_bits, dequantize, unpack
from kvlearn.ops.triton_support import HAS_TRITON, LOG2E, check_launch, interpreting, is_pow2, tl, triton

if HAS_TRITON:
    from kvlearn.ops.triton_support import dot_fp32, online_lse_step

__all__ = ["BACKENDS", "DEQUANTS", "MAGIC_BITS", "default_dequant", "fused_decode_applies", "packed_decode_attention"]

BACKENDS = ("auto", "torch", "triton")
DEQUANTS = ("auto", "convert", "magic")  # how the Triton kernel turns codes into dot operands (packed_decode_attention)


def fused_decode_applies(device: torch.device, head_dim: int, bits: int) -> bool:
    """Whether the Triton kernel takes a decode step here: triton installed, a CUDA device (or Triton's CPU
    interpreter), ``head_dim`` a power of two in [16, 256] whose packed bytes (``head_dim * bits / 8``) are at
    least 16 (the width of one ``tl.dot`` operand: 2-bit codes need ``head_dim >= 64``)."""
    return (HAS_TRITON and (torch.device(device).type == "cuda" or interpreting())
            and is_pow2(head_dim) and 16 <= head_dim <= 256 and head_dim * bits // 8 >= 16)


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
    def _code_plane(byte, J: tl.constexpr, BITS: tl.constexpr):
        """Plane ``J`` of packed bytes ``[rows, HEAD_DIM / PER_BYTE]`` (int32): the codes of elements
        ``t * PER_BYTE + J`` (bits ``[J * BITS, (J + 1) * BITS)`` of byte ``t``, biased by ``2^(BITS - 1)``),
        as float32."""
        return (((byte >> (J * BITS)) & ((1 << BITS) - 1)) - (1 << (BITS - 1))).to(tl.float32)

    @triton.jit
    def _magic_plane(byte, J: tl.constexpr, BITS: tl.constexpr, MAGIC: tl.constexpr, dt: tl.constexpr):
        """Plane ``J`` of packed bytes (int32) as ``OFF + u`` in the 16-bit float type ``dt``, ``u`` the unsigned
        (unbiased) code: ``u`` is OR-ed into the low mantissa bits of ``MAGIC``, the bit pattern of ``OFF`` (bf16
        ``0x4300`` = 128, fp16 ``0x6400`` = 1024, whose mantissa step is 1), and the 16 bits are reinterpreted. Exact
        for ``u < OFF``; no int-to-float conversion instruction (a quarter-rate one on the GPU) is issued."""
        return (((byte >> (J * BITS)) & ((1 << BITS) - 1)) | MAGIC).to(tl.int16).to(dt, bitcast=True)

    @triton.jit
    def program_coords(HKV: tl.constexpr):
        """A decode program's coordinates on its ``(batch * KV heads, splits)`` grid: ``(batch x KV head, split,
        batch, KV head)``, the last two int64 (pointer offsets)."""
        bh = tl.program_id(0)
        sp = tl.program_id(1)
        return bh, sp, (bh // HKV).to(tl.int64), (bh % HKV).to(tl.int64)

    @triton.jit
    def program_query(q_ptr, stride_qb, stride_qh, HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                      HEAD_DIM: tl.constexpr):
        """The program's coordinates and its KV head's query rows: ``(batch x KV head, split, batch, KV head,
        offs_g [G_PAD], offs_d [HEAD_DIM], q [G_PAD, HEAD_DIM])``, padded query rows zeros."""
        bh, sp, b, h = program_coords(HKV)
        offs_g = tl.arange(0, G_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh + offs_d[None, :],
                    mask=(offs_g < G)[:, None], other=0.0)
        return bh, sp, b, h, offs_g, offs_d, q

    @triton.jit
    def channel_codes(byte, PER_BYTE: tl.constexpr, BLOCK_C: tl.constexpr, HEAD_DIM: tl.constexpr):
        """Packed bytes ``[BLOCK_C, HEAD_DIM / PER_BYTE]`` (int32) -> the biased codes ``[BLOCK_C, HEAD_DIM]`` in
        channel order (code ``j`` of byte ``t``, bits ``[j b, (j + 1) b)``, is channel ``t * PER_BYTE + j``)."""
        if PER_BYTE == 1:
            u = byte
        elif PER_BYTE == 2:
            u = tl.reshape(tl.join(byte & 15, byte >> 4), (BLOCK_C, HEAD_DIM))
        else:  # join(join(j0, j2), join(j1, j3)) puts code 2 i + k at [..., i, k]
            u = tl.reshape(tl.join(tl.join(byte & 3, (byte >> 4) & 3), tl.join((byte >> 2) & 3, byte >> 6)),
                           (BLOCK_C, HEAD_DIM))
        return u

    @triton.jit
    def query_planes(q_rows, offs_t, g_live, PER_BYTE: tl.constexpr, HEAD_DIM: tl.constexpr):
        """The query rows ``q_rows [G_PAD, 1]`` (pointers) split like packed codes: plane ``J`` ``[G_PAD, DB]``
        holds the elements ``t * PER_BYTE + J`` (planes past ``PER_BYTE`` are never used); padded rows are zeros."""
        q0 = tl.load(q_rows + (offs_t * PER_BYTE)[None, :], mask=g_live[:, None], other=0.0)
        q1 = tl.load(q_rows + (offs_t * PER_BYTE + 1)[None, :],
                     mask=g_live[:, None] & ((offs_t * PER_BYTE + 1) < HEAD_DIM)[None, :], other=0.0)
        q2 = tl.load(q_rows + (offs_t * PER_BYTE + 2)[None, :],
                     mask=g_live[:, None] & ((offs_t * PER_BYTE + 2) < HEAD_DIM)[None, :], other=0.0)
        q3 = tl.load(q_rows + (offs_t * PER_BYTE + 3)[None, :],
                     mask=g_live[:, None] & ((offs_t * PER_BYTE + 3) < HEAD_DIM)[None, :], other=0.0)
        return q0, q1, q2, q3

    @triton.jit
    def empty_split_state(G_PAD: tl.constexpr, DB: tl.constexpr):
        """A split's state before its first tile: running max -1e30, sum 0, and one zero value accumulator
        ``[G_PAD, DB]`` per code plane."""
        zero = tl.zeros([G_PAD, DB], dtype=tl.float32)
        return tl.full([G_PAD], -1.0e30, dtype=tl.float32), tl.zeros([G_PAD], dtype=tl.float32), zero, zero, zero, zero

    @triton.jit
    def empty_channel_state(G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr):
        """A channel-order kernel's split state before its first tile: running max -1e30, sum 0, and one zero value
        accumulator ``[G_PAD, HEAD_DIM]``."""
        return (tl.full([G_PAD], -1.0e30, dtype=tl.float32), tl.zeros([G_PAD], dtype=tl.float32),
                tl.zeros([G_PAD, HEAD_DIM], dtype=tl.float32))

    @triton.jit
    def store_channel_partials(m_ptr, l_ptr, acc_ptr, part, offs_g, offs_d, m_i, l_i, acc, G_PAD: tl.constexpr,
                               HEAD_DIM: tl.constexpr):
        """One split's running max, sum and (channel-order) value accumulator into partial ``part``, which
        :func:`merge_splits` merges."""
        tl.store(m_ptr + part * G_PAD + offs_g, m_i)
        tl.store(l_ptr + part * G_PAD + offs_g, l_i)
        tl.store(acc_ptr + (part * G_PAD + offs_g)[:, None] * HEAD_DIM + offs_d[None, :], acc)

    @triton.jit
    def store_split_partials(m_ptr, l_ptr, acc_ptr, part, offs_g, offs_t, m_i, l_i, acc0, acc1, acc2, acc3,
                             G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, PER_BYTE: tl.constexpr):
        """One split's running max, sum and value accumulator (kept per code plane) into the partials that
        :func:`_merge_splits_kernel` merges; the planes are interleaved back into ``HEAD_DIM`` columns."""
        tl.store(m_ptr + part * G_PAD + offs_g, m_i)
        tl.store(l_ptr + part * G_PAD + offs_g, l_i)
        acc_rows = acc_ptr + (part * G_PAD + offs_g)[:, None] * HEAD_DIM
        tl.store(acc_rows + (offs_t * PER_BYTE)[None, :], acc0)
        if PER_BYTE > 1:
            tl.store(acc_rows + (offs_t * PER_BYTE + 1)[None, :], acc1)
        if PER_BYTE > 2:
            tl.store(acc_rows + (offs_t * PER_BYTE + 2)[None, :], acc2)
            tl.store(acc_rows + (offs_t * PER_BYTE + 3)[None, :], acc3)

    @triton.jit
    def _packed_decode_kernel(
        q_ptr,  # [B, Hq, D]
        kc_ptr, ks_ptr, vc_ptr, vs_ptr,  # codes [B, Hkv, C, D / PER_BYTE] uint8, scales [B, Hkv, C]
        vis_ptr,  # bool viewed as uint8 [B, Hv, C] (Hv = Hkv or 1; stride 0 when shared)
        m_ptr, l_ptr, acc_ptr,  # partials: [B * Hkv, SPLITS, G_PAD], [..., G_PAD], [..., G_PAD, D] float32
        stride_qb, stride_qh,
        stride_cb, stride_ch, stride_ct,  # codes (keys and values share the layout)
        stride_sb, stride_sh,  # scales
        stride_vb, stride_vh,  # visibility
        C, qk_scale,  # scale * log2(e)
        HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        PER_BYTE: tl.constexpr, DB: tl.constexpr, BITS: tl.constexpr, BLOCK_C: tl.constexpr,
        SPLIT: tl.constexpr, SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
        MAGIC: tl.constexpr, MAGIC_SHIFT: tl.constexpr,
    ):
        """The bit-plane kernel. One (batch x KV head, slot split): the split's slots in tiles of ``BLOCK_C``, online
        softmax in base 2.

        Codes are read as whole packed bytes ``[BLOCK_C, HEAD_DIM / PER_BYTE]`` (contiguous rows, vector loads)
        and split into ``PER_BYTE`` planes in registers; plane ``J`` holds the elements ``t * PER_BYTE + J``, so
        ``<q, k> = sum_J <q[J::PER_BYTE], plane_J>`` and the value accumulator is kept per plane, interleaved back
        on the store. The dot operands take the query's dtype (bf16 on the GPU: the codes are exact in it).

        ``MAGIC`` 0: each plane is converted to float (``_code_plane``). Otherwise (``dequant="magic"``) the planes
        are ``OFF + u`` (:func:`_magic_plane`) and the offset comes off once per row: the logits lose ``MAGIC_SHIFT =
        OFF + 2^(BITS - 1)`` times the query's element sum, and each tile's value product ``MAGIC_SHIFT`` times the
        sum of that tile's (rounded) probability-times-scale weights (per tile, so that the running accumulator never
        holds the offset times a whole split's weights)."""
        bh, sp, b, h = program_coords(HKV)
        offs_g = tl.arange(0, G_PAD)
        offs_t = tl.arange(0, DB)
        offs_c = tl.arange(0, BLOCK_C)
        g_live = offs_g < G
        q_rows = q_ptr + b * stride_qb + (h * G + offs_g)[:, None] * stride_qh
        q0, q1, q2, q3 = query_planes(q_rows, offs_t, g_live, PER_BYTE, HEAD_DIM)
        kc_base = kc_ptr + b * stride_cb + h * stride_ch
        vc_base = vc_ptr + b * stride_cb + h * stride_ch
        ks_base = ks_ptr + b * stride_sb + h * stride_sh
        vs_base = vs_ptr + b * stride_sb + h * stride_sh
        vis_base = vis_ptr + b * stride_vb + h * stride_vh
        m_i, l_i, acc0, acc1, acc2, acc3 = empty_split_state(G_PAD, DB)
        dt = q0.dtype
        if MAGIC != 0:  # the query's element sum over the planes the dots read (padded rows are zeros)
            q_sum = tl.sum(q0.to(tl.float32), 1)
            if PER_BYTE > 1:
                q_sum += tl.sum(q1.to(tl.float32), 1)
            if PER_BYTE > 2:
                q_sum += tl.sum(q2.to(tl.float32), 1) + tl.sum(q3.to(tl.float32), 1)
        lo = sp * SPLIT
        hi = tl.minimum(lo + SPLIT, C)
        for c0 in range(lo, hi, BLOCK_C):
            rows = c0 + offs_c
            live = rows < hi
            visible = tl.load(vis_base + rows, mask=live, other=0) != 0
            kb = tl.load(kc_base + rows[:, None] * stride_ct + offs_t[None, :], mask=live[:, None], other=0)
            kb = kb.to(tl.int32)  # [BLOCK_C, DB] packed bytes
            if MAGIC == 0:
                s = dot_fp32(q0, tl.trans(_code_plane(kb, 0, BITS).to(dt)), None, DOT_PRECISION, DOT_UPCAST)
                if PER_BYTE > 1:
                    s = dot_fp32(q1, tl.trans(_code_plane(kb, 1, BITS).to(dt)), s, DOT_PRECISION, DOT_UPCAST)
                if PER_BYTE > 2:
                    s = dot_fp32(q2, tl.trans(_code_plane(kb, 2, BITS).to(dt)), s, DOT_PRECISION, DOT_UPCAST)
                    s = dot_fp32(q3, tl.trans(_code_plane(kb, 3, BITS).to(dt)), s, DOT_PRECISION, DOT_UPCAST)
            else:
                s = dot_fp32(q0, tl.trans(_magic_plane(kb, 0, BITS, MAGIC, dt)), None, DOT_PRECISION, DOT_UPCAST)
                if PER_BYTE > 1:
                    s = dot_fp32(q1, tl.trans(_magic_plane(kb, 1, BITS, MAGIC, dt)), s, DOT_PRECISION, DOT_UPCAST)
                if PER_BYTE > 2:
                    s = dot_fp32(q2, tl.trans(_magic_plane(kb, 2, BITS, MAGIC, dt)), s, DOT_PRECISION, DOT_UPCAST)
                    s = dot_fp32(q3, tl.trans(_magic_plane(kb, 3, BITS, MAGIC, dt)), s, DOT_PRECISION, DOT_UPCAST)
                s = s - MAGIC_SHIFT * q_sum[:, None]
            k_scale = tl.load(ks_base + rows, mask=live, other=0.0).to(tl.float32)
            s = s * (k_scale * qk_scale)[None, :]
            s = tl.where(visible[None, :], s, float("-inf"))
            m_i, l_i, alpha, p = online_lse_step(m_i, l_i, s)
            v_scale = tl.load(vs_base + rows, mask=live, other=0.0).to(tl.float32)
            pv = (p * v_scale[None, :]).to(dt)  # [G_PAD, BLOCK_C]
            vb = tl.load(vc_base + rows[:, None] * stride_ct + offs_t[None, :], mask=live[:, None], other=0)
            vb = vb.to(tl.int32)
            if MAGIC == 0:
                acc0 = dot_fp32(pv, _code_plane(vb, 0, BITS).to(dt), acc0 * alpha[:, None], DOT_PRECISION, DOT_UPCAST)
                if PER_BYTE > 1:
                    acc1 = dot_fp32(pv, _code_plane(vb, 1, BITS).to(dt), acc1 * alpha[:, None], DOT_PRECISION,
                                    DOT_UPCAST)
                if PER_BYTE > 2:
                    acc2 = dot_fp32(pv, _code_plane(vb, 2, BITS).to(dt), acc2 * alpha[:, None], DOT_PRECISION,
                                    DOT_UPCAST)
                    acc3 = dot_fp32(pv, _code_plane(vb, 3, BITS).to(dt), acc3 * alpha[:, None], DOT_PRECISION,
                                    DOT_UPCAST)
            else:  # each plane's tile product carries MAGIC_SHIFT x the tile's (rounded) weights: taken off per tile,
                # so the offset never accumulates across tiles
                corr = (MAGIC_SHIFT * tl.sum(pv.to(tl.float32), 1))[:, None]
                acc0 = dot_fp32(pv, _magic_plane(vb, 0, BITS, MAGIC, dt), acc0 * alpha[:, None], DOT_PRECISION,
                                DOT_UPCAST) - corr
                if PER_BYTE > 1:
                    acc1 = dot_fp32(pv, _magic_plane(vb, 1, BITS, MAGIC, dt), acc1 * alpha[:, None], DOT_PRECISION,
                                    DOT_UPCAST) - corr
                if PER_BYTE > 2:
                    acc2 = dot_fp32(pv, _magic_plane(vb, 2, BITS, MAGIC, dt), acc2 * alpha[:, None], DOT_PRECISION,
                                    DOT_UPCAST) - corr
                    acc3 = dot_fp32(pv, _magic_plane(vb, 3, BITS, MAGIC, dt), acc3 * alpha[:, None], DOT_PRECISION,
                                    DOT_UPCAST) - corr
        store_split_partials(m_ptr, l_ptr, acc_ptr, bh * SPLITS + sp, offs_g, offs_t, m_i, l_i, acc0, acc1, acc2, acc3,
                             G_PAD, HEAD_DIM, PER_BYTE)

    @triton.jit
    def _merge_splits_kernel(
        m_ptr, l_ptr, acc_ptr,  # the partials above
        out_ptr,  # [B, Hq, D] float32
        HKV: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr,
        SPLITS_PAD: tl.constexpr, CHUNK: tl.constexpr,
    ):
        """One (batch x KV head, query head of the group): ``out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s``
        with ``M = max_s m_s`` (a split with nothing visible has ``m_s = -1e30, l_s = 0`` and weighs nothing)."""
        bh = tl.program_id(0)
        g = tl.program_id(1)
        offs_s = tl.arange(0, SPLITS_PAD)
        m_all = tl.load(m_ptr + (bh * SPLITS + offs_s) * G_PAD + g, mask=offs_s < SPLITS, other=-1.0e30)
        top = tl.max(m_all, 0)
        offs_k = tl.arange(0, CHUNK)
        offs_d = tl.arange(0, HEAD_DIM)
        num = tl.zeros([HEAD_DIM], dtype=tl.float32)
        den = tl.zeros([CHUNK], dtype=tl.float32)
        for s0 in range(0, SPLITS, CHUNK):
            sl = s0 + offs_k
            live = sl < SPLITS
            idx = (bh * SPLITS + sl) * G_PAD + g
            w = tl.where(live, tl.math.exp2(tl.load(m_ptr + idx, mask=live, other=-1.0e30) - top), 0.0)
            den += w * tl.load(l_ptr + idx, mask=live, other=0.0)
            a = tl.load(acc_ptr + idx[:, None] * HEAD_DIM + offs_d[None, :], mask=live[:, None], other=0.0)
            num += tl.sum(w[:, None] * a, 0)
        b = bh // HKV
        h = bh % HKV
        tl.store(out_ptr + ((b * HKV + h) * G + g) * HEAD_DIM + offs_d, num / tl.sum(den, 0))


@functools.lru_cache(maxsize=None)
def _programs_wanted(device: torch.device) -> int:
    """About four programs per streaming multiprocessor (the interpreter: a handful)."""
    if device.type == "cuda":
        return 4 * torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def default_split(slots: int, rows: int, block_c: int, device: torch.device) -> int:
    """Slots per program when ``split`` is not given: enough splits that ``rows`` (batch x KV heads) times the
    splits fill the GPU about four times over, at most 128 splits, a power of two and a multiple of ``block_c``."""
    want = max(1, _programs_wanted(torch.device(device)) // max(1, rows))
    split = triton.next_power_of_2(max(1, triton.cdiv(slots, want)))
    split = max(split, triton.next_power_of_2(triton.cdiv(slots, 128)))  # the merge loads every split's max at once
    return max(block_c, split)


# dequant="magic": per 16-bit query dtype, the bit pattern of OFF (whose mantissa step is 1) and OFF
MAGIC_OFFSETS = {torch.bfloat16: (0x4300, 128.0), torch.float16: (0x6400, 1024.0)}
MAGIC_BITS = (2, 4)  # codes below 128 (OFF in bf16): 8-bit codes reach 255


def _triton_decode(query, key_codes, key_scales, value_codes, value_scales, visible, bits, scale,
                   block_c: int, split: int | None, num_warps: int, num_stages: int, dequant: str) -> Tensor:
    check(HAS_TRITON, "backend='triton' is unavailable: triton is not installed (use backend='torch')")
    b, hq, d = query.shape
    hkv, slots = key_codes.shape[1], key_codes.shape[2]
    check(query.is_cuda or interpreting(),
          f"device {query.device} is invalid for backend='triton': expected a CUDA tensor "
          "(or TRITON_INTERPRET=1 to run the kernel on the CPU)")
    check(fused_decode_applies(query.device, d, bits),
          f"head_dim={d} is invalid for backend='triton' at {bits} bits: expected a power of two in [16, 256] "
          f"with head_dim * bits / 8 >= 16")
    check_launch(num_warps, num_stages, block_c=block_c)
    if split is None:
        split = default_split(slots, b * hkv, block_c, query.device)
    check_int("split", split, block_c)
    check(split % block_c == 0, f"split={split} is invalid: expected a multiple of block_c={block_c}")
    g = hq // hkv
    g_pad = max(16, triton.next_power_of_2(g))
    splits = max(1, triton.cdiv(slots, split))
    kc, vc = key_codes.contiguous(), value_codes.contiguous()
    ks, vs = key_scales.contiguous(), value_scales.contiguous()
    vis = (visible if visible.stride(-1) == 1 else visible.contiguous()).view(torch.uint8)
    q = query.contiguous()
    if q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        q = q.float()
    magic, offset = 0, 0.0
    if dequant == "magic":
        check(bits in MAGIC_BITS and q.dtype in MAGIC_OFFSETS,
              f"dequant='magic' is invalid for {bits}-bit codes with a {q.dtype} query: expected bits in "
              f"{MAGIC_BITS} and a bfloat16 or float16 query (dequant='convert' takes every case)")
        magic, offset = MAGIC_OFFSETS[q.dtype]
    dev = query.device
    m = torch.empty(b * hkv, splits, g_pad, dtype=torch.float32, device=dev)
    l_ = torch.empty_like(m)
    acc = torch.empty(b * hkv, splits, g_pad, d, dtype=torch.float32, device=dev)
    _packed_decode_kernel[(b * hkv, splits)](
        q, kc, ks, vc, vs, vis, m, l_, acc,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), ks.stride(0), ks.stride(1),
        vis.stride(0), vis.stride(1) if vis.shape[1] > 1 else 0,
        slots, float(scale) * LOG2E,
        HKV=hkv, G=g, G_PAD=g_pad, HEAD_DIM=d, PER_BYTE=8 // bits, DB=d * bits // 8, BITS=bits, BLOCK_C=block_c,
        SPLIT=split, SPLITS=splits, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_UPCAST=interpreting(), MAGIC=magic, MAGIC_SHIFT=offset + (1 << (bits - 1)) if magic else 0.0,
        num_warps=num_warps, num_stages=num_stages)
    return merge_splits(m, l_, acc, b, hq, hkv)


def merge_splits(m: Tensor, l_: Tensor, acc: Tensor, batch: int, q_heads: int, kv_heads: int) -> Tensor:
    """``[batch, q_heads, head_dim]`` float32 from split-K partials ``m, l_ [batch * kv_heads, splits, G_PAD]`` and
    ``acc [..., G_PAD, head_dim]`` (:func:`_merge_splits_kernel`)."""
    splits, g_pad, d = acc.shape[1:]
    g = q_heads // kv_heads
    out = torch.empty(batch, q_heads, d, dtype=torch.float32, device=acc.device)
    _merge_splits_kernel[(batch * kv_heads, g)](m, l_, acc, out, HKV=kv_heads, G=g, G_PAD=g_pad, HEAD_DIM=d,
                                                SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), CHUNK=16,
                                                num_warps=4)
    return out


def default_dequant(bits: int, dtype: torch.dtype) -> str:
    """``dequant="auto"``'s choice: ``"magic"`` for 2- and 4-bit codes with a bf16 or fp16 query (graph-replayed on
    the H200 it ran at 0.79-0.81x the bf16 cache's decode at 131k where ``"convert"`` ran at 1.12-1.15x,
    ``results/packed_decode_h200.json``), ``"convert"`` for every other case (8-bit codes, float32 queries)."""
    return "magic" if bits in MAGIC_BITS and dtype in MAGIC_OFFSETS else "convert"


def packed_decode_attention(query: Tensor, key_codes: Tensor, key_scales: Tensor, value_codes: Tensor,
                            value_scales: Tensor, visible: Tensor, bits: int, scale: float | None = None, *,
                            backend: str = "auto", block_c: int = 64, split: int | None = None,
                            num_warps: int = 4, num_stages: int = 2, dequant: str = "auto") -> Tensor:
    """One-token attention over packed ``bits``-bit K/V (module docstring); ``[batch, q_heads, head_dim]`` float32.

    ``block_c`` (slots per tile), ``split`` (slots per program, a multiple of ``block_c``; default
    :func:`default_split`: about four programs per multiprocessor), ``num_warps`` and ``num_stages`` are the
    Triton launch's; ``dequant`` (:data:`DEQUANTS`) is how the Triton kernel turns codes into dot operands:
    ``"convert"`` (an int-to-float conversion per element) or ``"magic"`` (the code OR-ed into a float's mantissa,
    the offset taken off once per row: 2- and 4-bit codes with a bf16 or fp16 query; the same values up to float32
    rounding of the offset's removal); ``"auto"`` (the default) is ``"magic"`` wherever it applies
    (:func:`default_dequant`), ``"convert"`` elsewhere. The torch backend ignores them."""
    b, hq, hkv, slots, d = _check_inputs(query, key_codes, key_scales, value_codes, value_scales, visible, bits)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    check(isinstance(scale, (int, float)) and not isinstance(scale, bool) and scale > 0,
          f"scale={scale!r} is invalid: expected a float > 0")
    check(backend in BACKENDS, f"backend={backend!r} is unknown: expected one of {', '.join(BACKENDS)}")
    check(dequant in DEQUANTS, f"dequant={dequant!r} is unknown: expected one of {', '.join(DEQUANTS)}")
    if dequant == "auto":
        dequant = default_dequant(bits, query.dtype)
    if backend == "auto":
        backend = "triton" if query.is_cuda and fused_decode_applies(query.device, d, bits) else "torch"
    if visible.shape[1] != hkv:
        visible = visible.expand(b, hkv, slots)
    with torch.no_grad():
        if backend == "torch":
            return _torch_decode(query, key_codes, key_scales, value_codes, value_scales, visible, bits, scale)
        return _triton_decode(query, key_codes, key_scales, value_codes, value_scales, visible, bits, scale,
                              block_c, split, num_warps, num_stages, dequant)
