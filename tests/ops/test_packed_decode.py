"""One-token attention over packed K/V (``kvlearn.ops.packed_decode``) against attention written out here over the
store's own dequantized read-back, float64; the Triton kernel in Triton's CPU interpreter (one subprocess) against
the same reference; bad inputs are one line."""

import math

import pytest
import torch

from kvlearn.cache import PackedStore
from kvlearn.errors import KVLearnError
from kvlearn.ops.packed_decode import default_dequant, packed_decode_attention


def packed_inputs(seed, B, Hq, Hkv, C, D, bits, shared_visibility=False, dtype=torch.float32):
    """Random K/V written into a :class:`PackedStore` (the cache's own quantize + pack), a query, and a random
    visibility with at least one visible slot per row; also the store's dequantized read-back."""
    g = torch.Generator().manual_seed(seed)
    store = PackedStore(bits)
    store.allocate(B, Hkv, C, D, D, dtype, "cpu")
    k = torch.randn(B, Hkv, C, D, generator=g).to(dtype) * 2
    v = torch.randn(B, Hkv, C, D, generator=g).to(dtype)
    slots = torch.arange(C).expand(B, Hkv, C)
    store.write(slots, k, v)
    q = torch.randn(B, Hq, D, generator=g).to(dtype)
    visible = torch.rand(B, 1 if shared_visibility else Hkv, C, generator=g) < 0.6
    visible[..., 0] = True
    keys, values = store.read()
    return q, store, visible, keys, values


def reference(q, keys, values, visible, scale):
    """float64 softmax attention of query head i over KV head i // G's visible slots, written out per head."""
    B, Hq, D = q.shape
    Hkv = keys.shape[1]
    G = Hq // Hkv
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    for b in range(B):
        for i in range(Hq):
            h = i // G
            vis = visible[b, h if visible.shape[1] > 1 else 0]
            logits = (keys[b, h].double() @ q[b, i].double()) * scale
            logits[~vis] = -math.inf
            out[b, i] = torch.softmax(logits, 0) @ values[b, h].double()
    return out


def call(q, store, visible, bits, **kw):
    return packed_decode_attention(q, store.key_codes, store.key_scales, store.value_codes, store.value_scales,
                                   visible, bits, **kw)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("shape", [(1, 4, 2, 37, 16), (2, 6, 2, 100, 32), (1, 5, 1, 9, 8)])
def test_torch_backend_matches_reference(bits, shape):
    B, Hq, Hkv, C, D = shape
    q, store, visible, keys, values = packed_inputs(0, B, Hq, Hkv, C, D, bits, shared_visibility=C == 100)
    got = call(q, store, visible, bits, backend="torch")
    want = reference(q, keys, values, visible, 1 / math.sqrt(D))
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_bad_inputs_raise_one_line_errors():
    q, store, visible, _, _ = packed_inputs(0, 1, 4, 2, 20, 16, 4)
    cases = [
        (dict(bits=16), "bits=16 is invalid"),
        (dict(q=q[:, :3]), "q_heads=3 is invalid"),
        (dict(q=q[0]), "query shape"),
        (dict(visible=visible.int()), "visible shape"),
        (dict(visible=visible[:, :, :5]), "visible shape"),
        (dict(scale=-1.0), "scale=-1.0 is invalid"),
        (dict(backend="cuda"), "backend='cuda' is unknown"),
        (dict(backend="triton"), "backend='triton'"),
    ]
    for override, needle in cases:
        args = dict(q=q, visible=visible, bits=4)
        args.update(override)
        kwargs = {k: args.pop(k) for k in ("scale", "backend") if k in args}
        with pytest.raises(KVLearnError, match=needle.replace("(", r"\(")) as err:
            packed_decode_attention(args["q"], store.key_codes, store.key_scales, store.value_codes,
                                    store.value_scales, args["visible"], args["bits"], **kwargs)
        assert "\n" not in str(err.value)
    with pytest.raises(KVLearnError, match="dequant='lop3' is unknown: expected one of auto, convert, magic") as err:
        call(q, store, visible, 4, dequant="lop3")
    assert "\n" not in str(err.value)
    with pytest.raises(KVLearnError, match="key_codes shape") as err:
        packed_decode_attention(q, store.key_codes.float(), store.key_scales, store.value_codes, store.value_scales,
                                visible, 4)


# name: (seed, B, Hq, Hkv, C, D, bits, shared visibility, block_c, split)
INTERP_CASES = {
    "g2_4bit_ragged": (0, 1, 4, 2, 150, 32, 4, False, 16, 64),  # three splits, the last one ragged
    "g5_2bit_pad": (1, 2, 10, 2, 70, 64, 2, True, 16, 32),  # G = 5 padded to 16 rows, shared visibility
    "g1_8bit": (2, 1, 2, 2, 40, 16, 8, False, 16, 16),  # MHA, one tile per split
    "g2_4bit_default_split": (4, 1, 4, 2, 300, 32, 4, False, 16, None),  # the default split (several, ragged)
    "bf16_query_4bit": (5, 1, 4, 2, 90, 32, 4, False, 16, 32),  # bf16 operands (the GPU's dtype)
    "one_split_tail_masked": (3, 1, 4, 1, 50, 32, 4, False, 32, 1024),  # one split, tile past the end
}
# every bit-width at each query dtype (the dot operands take it): (..., query dtype) appended to the tuple above
for _bits, _d in ((2, 64), (4, 32), (8, 16)):
    for _dtype in ("float32", "bfloat16", "float16"):
        INTERP_CASES[f"{_bits}bit_{_dtype}"] = (6 + _bits, 1, 6, 2, 70, _d, _bits, _bits == 4, 16, 32, _dtype)
# dequant="magic" (codes OR-ed into a 16-bit float's mantissa, the offset removed per row): (..., dtype, "magic")
for _bits, _d in ((2, 64), (4, 32)):
    for _dtype in ("bfloat16", "float16"):
        INTERP_CASES[f"magic_{_bits}bit_{_dtype}"] = (20 + _bits, 2, 10, 2, 150, _d, _bits, _bits == 2, 16, 64,
                                                      _dtype, "magic")  # G = 5 padded, three splits, ragged
INTERP_CASES["magic_4bit_bf16_default_split_d128"] = (30, 1, 8, 2, 300, 128, 4, False, 32, None, "bfloat16", "magic")
# refused in one line: 8-bit codes (up to 255: not exact above bf16's offset 128) and a float32 query
INTERP_CASES["magic_8bit_refused"] = (31, 1, 4, 2, 40, 16, 8, False, 16, 16, "bfloat16", "magic")
INTERP_CASES["magic_float32_refused"] = (32, 1, 4, 2, 40, 32, 4, False, 16, 16, "float32", "magic")
# dequant="auto" (the default): magic for 2/4-bit codes with a 16-bit query, convert for 8 bits and float32 queries
INTERP_CASES["auto_4bit_bf16_is_magic"] = (33, 1, 4, 2, 90, 32, 4, False, 16, 32, "bfloat16", "auto")
INTERP_CASES["auto_8bit_bf16_is_convert"] = (34, 1, 4, 2, 40, 16, 8, False, 16, 16, "bfloat16", "auto")
INTERP_CASES["auto_4bit_float32_is_convert"] = (35, 1, 4, 2, 40, 32, 4, False, 16, 16, "float32", "auto")


def run_case(name):
    seed, B, Hq, Hkv, C, D, bits, shared, block_c, split, *rest = INTERP_CASES[name]
    dtype = getattr(torch, rest[0]) if rest else torch.bfloat16 if name.startswith("bf16") else torch.float32
    dequant = rest[1] if len(rest) > 1 else "convert"
    q, store, visible, keys, values = packed_inputs(seed, B, Hq, Hkv, C, D, bits, shared, dtype=dtype)
    if name == "one_split_tail_masked":
        visible[..., 1:] = False  # one visible slot: the softmax is exactly its value
    if name.endswith("_refused"):
        try:
            call(q, store, visible, bits, backend="triton", block_c=block_c, split=split, dequant=dequant)
        except KVLearnError as e:
            want = (f"dequant='magic' is invalid for {bits}-bit codes with a {dtype} query: expected bits in (2, 4) "
                    "and a bfloat16 or float16 query")
            return {"ok": str(e).startswith(want) and "\n" not in str(e), "err": str(e)}
        return {"ok": False, "err": "not refused"}
    got = call(q, store, visible, bits, backend="triton", block_c=block_c, split=split, dequant=dequant).double()
    want = reference(q, keys, values, visible, 1 / math.sqrt(D))
    err = (got - want).abs().max().item()
    # 16-bit: the probabilities meet the value codes in the query's dtype, as in flash attention
    tol = {torch.bfloat16: 1e-2, torch.float16: 2e-3}.get(dtype, 2e-5)
    out = {"ok": bool(torch.allclose(got, want, atol=tol, rtol=tol)), "err": err}
    if dequant == "auto":  # the default: the very kernel of the path it names, bit for bit
        chosen = "magic" if name.startswith("auto_4bit_bf16") else "convert"
        explicit = call(q, store, visible, bits, backend="triton", block_c=block_c, split=split, dequant=chosen)
        default = call(q, store, visible, bits, backend="triton", block_c=block_c, split=split)
        out["ok"] = out["ok"] and bool(torch.equal(got, explicit.double())) and bool(torch.equal(default, explicit))
        out["ok"] = out["ok"] and default_dequant(bits, dtype) == chosen
    if dequant == "magic":  # against the converting kernel on the same inputs: only the offset's float32 rounding,
        # which grows with the offset: bf16's 128 stays under 1e-4, fp16's 1024 within fp16's own tolerance
        plain = call(q, store, visible, bits, backend="triton", block_c=block_c, split=split,
                     dequant="convert").double()
        out["vs_convert"] = (got - plain).abs().max().item()
        out["ok"] = out["ok"] and out["vs_convert"] <= (1e-4 if dtype == torch.bfloat16 else tol)
    return out


@pytest.mark.parametrize("name", list(INTERP_CASES))
def test_interpreter_matches_reference(interpreter_results, name):
    assert interpreter_results[name]["ok"], interpreter_results[name]


@pytest.mark.gpu
@pytest.mark.parametrize("bits,dequant", [(2, "convert"), (4, "convert"), (8, "convert"), (2, "magic"), (4, "magic")])
def test_cuda_kernel_matches_torch_at_a_real_shape(bits, dequant):
    """bf16 store, 40 query heads over 8 KV heads of 128, 5000 slots (several splits), on CUDA: the kernel equals
    the torch backend (float32 throughout) up to the bf16 rounding of the probabilities in the value product."""
    torch.manual_seed(0)
    store = PackedStore(bits)
    store.allocate(1, 8, 5000, 128, 128, torch.bfloat16, "cuda")
    k = torch.randn(1, 8, 5000, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 8, 5000, 128, device="cuda", dtype=torch.bfloat16)
    store.write(torch.arange(5000, device="cuda").expand(1, 8, 5000), k, v)
    q = torch.randn(1, 40, 128, device="cuda", dtype=torch.bfloat16)
    visible = torch.ones(1, 1, 5000, dtype=torch.bool, device="cuda")
    visible[..., 4000:] = False
    got = call(q, store, visible, bits, backend="triton", dequant=dequant)
    want = call(q, store, visible, bits, backend="torch")
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    assert (got - want).abs().mean() < 1e-3
    if dequant == "magic":  # the offset's removal: float32 rounding only, against the converting kernel (a CPU
        # model of it with worst-order fp32 sums at 4096 slots: up to 1.2e-4 for bf16,
        # results/raw/packed_decode_offset_error_cpu_3893ea3.json)
        plain = call(q, store, visible, bits, backend="triton")
        assert (got - plain).abs().max() < 1e-3
