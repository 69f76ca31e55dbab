"""One-token attention over a KIVI store (``kvlearn.ops.kivi_decode``) against attention written out here in float64
over the store's read-back (itself checked against a brute-force KIVI in ``tests/cache/test_kivi_store.py``); the
Triton kernels in Triton's CPU interpreter (one subprocess) against the same reference: the split kernel's key paths
(key groups broadcast, per-slot rows), its 16-bit and float32 dequantization, and its window parts at the window's
boundaries (no quantized key block yet, a block just completed, one slot past it, a capacity that is no multiple of
the window, a window shorter than a tile); bad inputs, and tiles under 32 slots on CUDA, are one line."""

import math

import pytest
import torch

from kvlearn.cache.kivi import KIVIStore
from kvlearn.errors import KVLearnError
from kvlearn.ops.kivi_decode import check_cuda_block_c, kivi_decode_attention, resolve_key_path

from test_packed_decode import reference  # float64 attention written out per head (the packed store's reference)


def kivi_inputs(seed, B, Hq, Hkv, C, D, bits, group, residual, value_group, fills, shared_visibility=False,
                dtype=torch.float32):
    """A :class:`KIVIStore` filled to ``fills[b]`` tokens per row (a prefill of most, then single-token decode writes,
    the store's own write paths), a query, a random visibility over the filled slots (the last one always visible),
    and the store's read-back."""
    g = torch.Generator().manual_seed(seed)
    store = KIVIStore(bits, group_size=group, residual=residual, value_group_size=value_group)
    store.allocate(B, Hkv, C, D, D, dtype, "cpu")
    k = (torch.randn(B, Hkv, C, D, generator=g) * 2 + torch.randn(1, 1, 1, D, generator=g)).to(dtype)  # channel offsets
    v = torch.randn(B, Hkv, C, D, generator=g).to(dtype)
    first = [max(1, f - 5) for f in fills]  # prefill, then up to 5 decode writes per row
    slots = torch.full((B, max(first)), -1)
    for b, n in enumerate(first):
        slots[b, :n] = torch.arange(n)
    store.write(slots[:, None].expand(B, Hkv, -1), k[:, :, : max(first)], v[:, :, : max(first)])
    n = list(first)
    while n != list(fills):
        s = torch.tensor([[n[b] if n[b] < fills[b] else -1] for b in range(B)])
        idx = torch.tensor([min(x, C - 1) for x in n])
        store.write(s[:, None].expand(B, Hkv, 1), k[torch.arange(B), :, idx][:, :, None],
                    v[torch.arange(B), :, idx][:, :, None])
        n = [x + int(x < f) for x, f in zip(n, fills)]
    q = torch.randn(B, Hq, D, generator=g).to(dtype)
    visible = torch.rand(B, 1 if shared_visibility else Hkv, C, generator=g) < 0.7
    filled = torch.tensor(fills)
    visible &= (torch.arange(C)[None, None, :] < filled[:, None, None])
    visible[torch.arange(B), :, filled - 1] = True
    keys, values = store.read()
    return q, store, visible, keys, values


def call(q, store, visible, **kw):
    return kivi_decode_attention(q, *store._buffers(), visible, store.bits, store.group_size, **kw)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_torch_backend_matches_reference(bits):
    q, store, visible, keys, values = kivi_inputs(0, 2, 4, 2, 45, 16, bits, 4, 8, 8, fills=[45, 19])
    got = call(q, store, visible, backend="torch")
    torch.testing.assert_close(got.double(), reference(q, keys, values, visible, 0.25), atol=1e-5, rtol=1e-5)


def test_bad_inputs_raise_one_line_errors():
    q, store, visible, _, _ = kivi_inputs(0, 1, 4, 2, 20, 16, 4, 4, 8, 8, fills=[20])
    bufs = list(store._buffers())
    cases = [
        (dict(q=q[:, :3]), "q_heads=3 is invalid"),
        (dict(visible=visible[:, :, :5]), "visible shape"),
        (dict(bits=3), "bits=3 is invalid"),
        (dict(group=3), "group_size=3 is invalid: expected an int >= 1 dividing the window R=8"),
        (dict(scale=0.0), "scale=0.0 is invalid"),
        (dict(backend="cuda"), "backend='cuda' is unknown"),
        (dict(backend="triton"), "backend='triton'"),
        (dict(buf=(0, bufs[0][:, :, :8])), "key_codes shape"),
        (dict(buf=(8, bufs[8].float())), "filled shape"),
        (dict(buf=(4, bufs[4][..., :1].expand(1, 2, 20, 3))), "value_scale shape"),
    ]
    for override, needle in cases:
        args = dict(q=q, visible=visible, bits=4, group=4, scale=None, backend="auto")
        args.update(override)
        buffers = list(bufs)
        if "buf" in args:
            i, t = args.pop("buf")
            buffers[i] = t
        with pytest.raises(KVLearnError, match=needle.replace("(", r"\(")) as err:
            kivi_decode_attention(args["q"], *buffers, args["visible"], args["bits"], args["group"], args["scale"],
                                  backend=args["backend"])
        assert "\n" not in str(err.value)


# name: (seed, B, Hq, Hkv, C, D, bits, group, residual, value group, fills, shared, dtype, block_c, split[, launch])
INTERP_CASES = {
    # three rows: no quantized key block yet (n < R), a block just completed (n = 2R), mid-block; ragged splits
    "g2_2bit_fill_levels": (0, 3, 4, 2, 150, 64, 2, 8, 32, 16, [20, 64, 150], False, "float32", 16, 64),
    "g5_4bit_shared_vis": (1, 2, 10, 2, 90, 32, 4, 16, 32, 32, [90, 41], True, "float32", 16, 32),
    "g1_8bit": (2, 1, 2, 2, 40, 16, 8, 4, 8, 8, [37], False, "float32", 16, 16),
    "default_split": (3, 1, 4, 2, 300, 32, 4, 32, 128, 32, [300], False, "float32", 32, None),
    "bf16_2bit": (4, 1, 4, 2, 120, 64, 2, 32, 64, 32, [117], False, "bfloat16", 32, 64),  # the GPU's dtype
    "capacity_below_window": (5, 1, 4, 2, 24, 32, 4, 8, 32, 16, [24], False, "float32", 16, 1024),  # Q = 0
    # the window's parts at its boundaries (R = 24, a tile of 16, two window parts): n = 1, R - 1, R (keys all
    # quantized, values all in the window), R + 1, 2R - 1, 3R (no window key), and the full capacity 80 (slots past
    # Q = 72 never quantize their keys)
    "window_boundaries": (6, 7, 4, 2, 80, 32, 4, 8, 24, 16, [1, 23, 24, 25, 47, 72, 80], False, "float32", 16, 32),
    "window_shorter_than_tile": (7, 2, 4, 2, 60, 32, 4, 4, 8, 8, [57, 8], False, "float32", 32, 64),  # 8 groups/tile
    # key groups of 6 (no power of two): one key row per slot
    "gather_g6_4bit": (8, 2, 8, 2, 200, 32, 4, 6, 24, 8, [200, 77], False, "float32", 16, 32),
    "gather_g6_2bit_bf16": (9, 2, 8, 2, 200, 64, 2, 6, 24, 32, [199, 26], False, "bfloat16", 16, 32),
    "gather_forced_g8": (10, 2, 4, 2, 150, 64, 2, 8, 32, 16, [150, 64], False, "float32", 16, 64,
                         dict(key_path="gather")),
    "group_spans_tiles_bf16_4bit": (11, 1, 8, 2, 200, 64, 4, 32, 64, 32, [190], False, "bfloat16", 16, 64),
    "bf16_8bit": (12, 1, 4, 2, 120, 64, 8, 32, 64, 32, [117], False, "bfloat16", 32, 64),  # float32 dequantization
    "fp16_8bit": (13, 1, 4, 2, 120, 64, 8, 16, 32, 32, [101], False, "float16", 32, 64),  # 1024 + code from bits
    "fp16_2bit_block64": (14, 1, 4, 2, 200, 64, 2, 16, 64, 16, [200], False, "float16", 64, 128),
}
TOLERANCE = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1e-2}  # 16 bits: the probabilities meet the values in 16


def run_case(name):
    seed, B, Hq, Hkv, C, D, bits, group, res, vg, fills, shared, dtype, block_c, split, *launch = INTERP_CASES[name]
    q, store, visible, keys, values = kivi_inputs(seed, B, Hq, Hkv, C, D, bits, group, res, vg, fills, shared,
                                                  dtype=getattr(torch, dtype))
    got = call(q, store, visible, backend="triton", block_c=block_c, split=split, **(launch[0] if launch else {}))
    want = reference(q, keys, values, visible, 1 / math.sqrt(D))
    err = (got.double() - want).abs().max().item()
    tol = TOLERANCE[dtype]
    return {"ok": bool(torch.allclose(got.double(), want, atol=tol, rtol=tol)), "err": err}


@pytest.mark.parametrize("name", list(INTERP_CASES))
def test_interpreter_matches_reference(interpreter_results, name):
    assert interpreter_results[name]["ok"], interpreter_results[name]


def test_key_path_resolution_and_launch_errors():
    """``"auto"`` broadcasts key groups where a tile lies in one group or holds whole power-of-two groups, else
    loads a row per slot; a path that cannot serve the launch, or an unknown one, is a one-line error."""
    assert resolve_key_path("auto", 32, 32) == "broadcast"  # one group per tile
    assert resolve_key_path("auto", 64, 16) == "broadcast"  # a group spans four tiles
    assert resolve_key_path("auto", 8, 64) == "broadcast"  # eight groups per tile
    assert resolve_key_path("auto", 6, 16) == "gather"
    assert resolve_key_path("auto", 48, 32) == "gather"
    assert resolve_key_path("gather", 32, 32) == "gather"
    for args, needle in ((("broadcast", 6, 16), "key_path='broadcast' is invalid for group_size=6, block_c=16"),
                         (("fold", 32, 32), "key_path='fold' is unknown"),
                         (("rebuild", 32, 32), "key_path='rebuild' is unknown: expected one of auto, broadcast, "
                                               "gather")):
        with pytest.raises(KVLearnError, match=needle) as err:
            resolve_key_path(*args)
        assert "\n" not in str(err.value)


def test_cuda_refuses_tiles_under_32_slots():
    """On CUDA a tile of 16 slots is a one-line error naming the value and the valid range (it gave wrong results on
    the H200 with Triton 3.6); Triton's CPU interpreter still takes it, and 32 and up pass everywhere."""
    with pytest.raises(KVLearnError) as err:
        check_cuda_block_c(16, on_cuda=True)
    assert str(err.value) == ("block_c=16 is invalid for the KIVI decode kernel on CUDA: expected a power of two >= 32 "
                              "(16 gave wrong results on the H200 with Triton 3.6)")
    check_cuda_block_c(16, on_cuda=False)
    for block_c in (32, 64, 128):
        check_cuda_block_c(block_c, on_cuda=True)


def test_interpreter_cases_reach_every_path():
    """The interpreter cases resolve to both key paths of the kernel, and take each dequantization (bf16 and fp16
    from the codes' bits, float32) at least once."""
    paths = {resolve_key_path((c[15] if len(c) > 15 else {}).get("key_path", "auto"), c[7], c[13])
             for c in INTERP_CASES.values()}
    assert paths == {"broadcast", "gather"}
    kinds = {(c[12], c[6] <= 4) for c in INTERP_CASES.values()}
    assert {("bfloat16", True), ("float16", False), ("float32", True), ("bfloat16", False)} <= kinds


# the GPU test's launches beyond the default: (key_path, block_c, num_warps, num_stages), the benchmark's sweep
CUDA_LAUNCHES = (("broadcast", 32, 4, 3), ("broadcast", 32, 8, 2), ("broadcast", 64, 4, 2), ("broadcast", 64, 8, 2),
                 ("broadcast", 128, 4, 2), ("broadcast", 128, 8, 2), ("gather", 32, 4, 2), ("gather", 64, 8, 2))


@pytest.mark.gpu
@pytest.mark.parametrize("bits", [2, 4])
def test_cuda_kernel_matches_torch_at_a_real_shape(bits):
    """bf16 KIVI store, 40 query heads over 8 KV heads of 128, 5000 slots (several splits), G = 32, R = 128, on
    CUDA: every launch of the benchmark's sweep (both key paths, tiles of 32-128, 4 or 8 warps, 2 or 3 stages) equals
    the torch backend up to the bf16 rounding of the probabilities in the value product. Every launch runs; the
    failure lists all that disagree, with their largest difference."""
    torch.manual_seed(0)
    store = KIVIStore(bits, group_size=32, residual=128)
    store.allocate(1, 8, 5000, 128, 128, torch.bfloat16, "cuda")
    k = torch.randn(1, 8, 4990, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 8, 4990, 128, device="cuda", dtype=torch.bfloat16)
    store.write(torch.arange(4990, device="cuda").expand(1, 8, 4990), k, v)
    q = torch.randn(1, 40, 128, device="cuda", dtype=torch.bfloat16)
    visible = torch.zeros(1, 1, 5000, dtype=torch.bool, device="cuda")
    visible[..., :4990] = True
    want = call(q, store, visible, backend="torch")
    launches = [{}] + [dict(key_path=p, block_c=bc, num_warps=w, num_stages=st) for p, bc, w, st in CUDA_LAUNCHES]
    failed = []
    for launch in launches:
        try:
            got = call(q, store, visible, backend="triton", **launch)
        except Exception as e:  # a launch that fails to compile or run is listed with the rest
            first = str(e).splitlines()[0][:200] if str(e) else ""
            failed.append(f"{launch or 'default'}: {type(e).__name__}: {first}")
            continue
        diff = (got - want).abs()
        close = torch.allclose(got, want, atol=1e-2, rtol=1e-2) and diff.mean().item() < 1e-3
        if not close:
            failed.append(f"{launch or 'default'}: max abs diff {diff.max().item():.4g}, mean {diff.mean().item():.3g}")
    assert not failed, f"{len(failed)} of {len(launches)} launches disagree with torch at {bits} bits: " + \
        "; ".join(failed)
