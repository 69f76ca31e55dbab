"""Fused Triton build of the gathered layout against the torch path of ``gathered_layout``: every field equal.

The kernel runs in Triton's CPU interpreter (``TRITON_INTERPRET=1`` must be set before triton is imported, so the
cases run in one subprocess); the ``gpu`` tests run it compiled on CUDA.
"""

import os
import sys

import pytest
import torch

from kvlearn.errors import KVLearnError
from kvlearn.ops.fenwick import running_topk_cutoff
from kvlearn.ops.gathered_layout_triton import gathered_layout_triton
from kvlearn.ops.gathered import gathered_layout
from kvlearn.ops.gathered_layout import gathered_capacity
from kvlearn.ops.masks import eviction_positions

sys.path.insert(0, os.path.dirname(__file__))
from test_gathered import fresh_draw  # noqa: E402  (the generators of the torch layout tests)
from test_masks import random_inputs  # noqa: E402

FIELDS = ("index", "key_pos", "key_end", "num_full", "num_used", "block_size", "seq_len", "capacity")

# name: (seed, B, H, T, sinks, window, topk, block_size, ties, how)
#   how: "kernel" (gathered_layout_triton on eviction_positions, 16-key chunks: several chunks per scan),
#        "dispatch" (gathered_layout(..., backend="triton"), default chunk), "none" (topk=None through the
#        dispatch: counts-only launch sizes the capacity), "claim2" (cutoffs from `topk`, layout sized for
#        topk=2: blocks truncated to the capacity), "padded_end" (end with never-evicted keys already set to
#        the padded length: same layout)
INTERP_CASES = {
    "ragged_evicting": (0, 1, 2, 75, 2, 4, 6, 16, False, "kernel"),
    "batch2_ties_block12": (1, 2, 1, 50, 3, 5, 8, 12, True, "kernel"),
    "shorter_than_block": (2, 1, 2, 10, 1, 2, 3, 16, True, "kernel"),
    "sinks0_window1": (3, 1, 2, 40, 0, 1, 7, 8, False, "kernel"),
    "topk0": (4, 2, 1, 37, 3, 5, 0, 8, True, "kernel"),
    "topk_gt_T": (5, 1, 2, 30, 2, 3, 35, 8, False, "kernel"),
    "window_ge_T": (6, 1, 2, 33, 2, 36, 4, 8, True, "kernel"),
    "one_kv_head": (7, 1, 1, 64, 4, 6, 9, 16, False, "kernel"),
    "block1": (8, 1, 1, 12, 1, 2, 3, 1, True, "kernel"),
    "T1": (9, 1, 2, 1, 0, 1, 1, 4, False, "kernel"),
    "dispatch": (10, 2, 2, 45, 2, 4, 5, 16, True, "dispatch"),
    "topk_none": (11, 1, 2, 58, 3, 4, 6, 8, False, "none"),
    "truncated": (12, 1, 2, 60, 2, 4, 12, 8, False, "claim2"),
    "padded_end": (13, 1, 2, 45, 2, 4, 5, 16, False, "padded_end"),
}
# fresh draws of the torch layout tests (B = H = 2, random T <= 70, sinks, window, topk incl. 0, > T, >= T;
# random block size): seeds whose block size keeps the interpreter run short
for _seed in (0, 1, 4, 8, 9, 11):
    _B, _H, _T, _s, _w, _k, _bs, _ties = fresh_draw(_seed)
    INTERP_CASES[f"fresh{_seed}"] = (_seed, _B, _H, _T, _s, _w, _k, _bs, _ties, "kernel")


def run_case(name, device="cpu"):
    """Torch layout vs Triton layout of one case: which fields are equal, and what the case exercised."""
    seed, B, H, T, sinks, window, topk, bs, ties, how = INTERP_CASES[name]
    ranks, cutoffs = random_inputs(seed, B, H, T, sinks, window, topk, ties=ties)
    ranks, cutoffs = ranks.to(device), cutoffs.to(device)
    claim = {"none": None, "claim2": 2}.get(how, topk)
    ref = gathered_layout(ranks, cutoffs, sinks, window, topk=claim, block_size=bs, backend="torch")
    end = eviction_positions(ranks, cutoffs, sinks, window)
    if how in ("dispatch", "none", "claim2"):
        got = gathered_layout(ranks, cutoffs, sinks, window, topk=claim, block_size=bs, backend="triton")
    else:
        if how == "padded_end":
            end = torch.where(end >= T, torch.full_like(end, ref.num_blocks * bs), end)
        got = gathered_layout_triton(end, bs, ref.capacity, chunk=16)
    equal = {}
    for f in FIELDS:
        a, b = getattr(ref, f), getattr(got, f)
        equal[f] = (a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)) if torch.is_tensor(a) else a == b
    q0 = torch.arange(ref.num_blocks, device=device) * bs
    n_own = (T - 1 - q0).clamp(max=bs - 1)
    return {
        "equal": equal,
        "evicted_slots": int((ref.num_used - ref.num_full - n_own).sum()),
        "ragged": T % bs != 0 and T > bs,
        "truncated": bool((ref.num_used > ref.capacity).any()),
        "chunks": -(-int(q0[-1] + n_own[-1] + 1) // 16),
        "max_block_padding": int((ref.capacity - ref.num_used).clamp(min=0).max()),
    }


@pytest.mark.parametrize("name", list(INTERP_CASES))
def test_interpreter_layout_equals_torch(interpreter_results, name):
    res = interpreter_results[name]
    assert all(res["equal"].values()), res


def test_interpreter_cases_cover_the_slot_kinds(interpreter_results):
    """The comparison could not pass with a wrong evicted-in-block, ragged-block, truncation or chunk path."""
    res = interpreter_results
    assert any(r["evicted_slots"] > 0 and r["ragged"] for r in res.values())
    assert res["ragged_evicting"]["evicted_slots"] > 0 and res["ragged_evicting"]["ragged"]
    assert res["truncated"]["truncated"] and not res["ragged_evicting"]["truncated"]
    assert max(r["chunks"] for r in res.values()) >= 4  # the scan crosses several 16-key chunks
    assert res["topk0"]["evicted_slots"] > 0  # k = 0: every eligible key leaves at the window's end
    assert res["topk_gt_T"]["evicted_slots"] == 0 and res["window_ge_T"]["evicted_slots"] == 0
    assert sum(r["max_block_padding"] > 16 for r in res.values()) >= 2  # one block's padding spans two chunks


def test_bad_inputs_raise_one_line_errors(monkeypatch):
    ranks, cutoffs = random_inputs(0, 1, 2, 20, 1, 2, 3)
    end = eviction_positions(ranks, cutoffs, 1, 2)
    bad_layout = [
        ({"backend": "cuda"}, r"backend='cuda' is invalid: expected one of \('auto', 'torch', 'triton'\)"),
        ({"backend": None}, "backend=None is invalid"),
    ]
    for kwargs, needle in bad_layout:
        with pytest.raises(KVLearnError, match=needle) as info:
            gathered_layout(ranks, cutoffs, 1, 2, topk=3, **kwargs)
        assert "\n" not in str(info.value)
    bad_kernel = [
        ((end.long(), 4, 12), {}, "end with dtype torch.int64"),
        ((end[0], 4, 12), {}, "3 dims"),
        (("end", 4, 12), {}, "end of type str"),
        ((end, 0, 12), {}, "block_size=0"),
        ((end, 4, 10), {}, "capacity=10 is invalid: expected None or a positive multiple of block_size=4"),
        ((end, 4, 0), {}, "capacity=0"),
        ((end, 4, 12), {"chunk": 24}, "chunk=24"),
        ((end, 4, 12), {"chunk": 8}, "chunk=8"),
        ((end, 4, 12), {"num_warps": 3}, "num_warps=3"),
        ((end[..., :0], 4, 12), {}, "seq length 0"),
    ]
    for args, kwargs, needle in bad_kernel:
        with pytest.raises(KVLearnError, match=needle) as info:
            gathered_layout_triton(*args, **kwargs)
        assert "\n" not in str(info.value)
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1":
        with pytest.raises(KVLearnError, match="device cpu is invalid: expected a CUDA tensor") as info:
            gathered_layout(ranks, cutoffs, 1, 2, topk=3, backend="triton")
        assert "\n" not in str(info.value)
        with pytest.raises(KVLearnError, match="device cpu is invalid: expected a CUDA tensor") as info:
            gathered_layout_triton(end, 4, 12)
        assert "\n" not in str(info.value)
    # auto on the CPU is the torch path (no interpreter needed)
    auto = gathered_layout(ranks, cutoffs, 1, 2, topk=3, block_size=4)
    torch_ = gathered_layout(ranks, cutoffs, 1, 2, topk=3, block_size=4, backend="torch")
    assert all(torch.equal(a, b) for a, b in zip(auto[:5], torch_[:5]))
    # triton missing: a one-line error, not an AttributeError from deep inside
    import kvlearn.ops.gathered_layout_triton as glt

    monkeypatch.setattr(glt, "_HAS_TRITON", False)
    for call in (lambda: gathered_layout(ranks, cutoffs, 1, 2, topk=3, backend="triton"),
                 lambda: gathered_layout_triton(end, 4, 12)):
        with pytest.raises(KVLearnError, match="gathered_layout_triton is unavailable: triton is not installed") as info:
            call()
        assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------------------------
# CUDA (the device machine: pytest -m gpu)
# ------------------------------------------------------------------------------------------------------------


def _cuda_inputs(seed, B, H, T, sinks, window, topk, ties):
    """random_inputs' priorities, ranked and cut on the GPU (the cutoff backends agree bit for bit)."""
    g = torch.Generator().manual_seed(seed)
    p = torch.randint(0, 3, (B, H, T), generator=g).float() if ties else torch.randn(B, H, T, generator=g)
    return running_topk_cutoff(p.cuda(), sinks, window, topk)


def _assert_same(ref, got):
    for f in FIELDS:
        a, b = getattr(ref, f), getattr(got, f)
        if torch.is_tensor(a):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), f
        else:
            assert a == b, f


@pytest.mark.gpu
@pytest.mark.parametrize(
    "seed,B,H,T,sinks,window,topk,bs,ties",
    [
        (0, 1, 8, 4096, 4, 256, 1000, 128, False),
        (1, 2, 8, 4000, 4, 256, 1000, 128, True),  # ragged last block, batch 2, ties
        (2, 1, 8, 4096, 0, 1, 300, 64, False),
        (3, 1, 8, 4096, 4, 64, 0, 128, False),
        (4, 1, 1, 3000, 4, 5000, 100, 128, False),  # window >= T
        (5, 1, 8, 4096, 4, 256, 5000, 128, False),  # topk > T
        (6, 1, 2, 100, 2, 8, 20, 128, False),  # T < block
    ],
)
@pytest.mark.parametrize("config", [{}, {"chunk": 256, "num_warps": 4}, {"chunk": 2048, "num_warps": 8}],
                         ids=["default", "c256w4", "c2048w8"])
def test_cuda_layout_equals_torch(seed, B, H, T, sinks, window, topk, bs, ties, config):
    pytest.importorskip("triton")
    ranks, cutoffs = _cuda_inputs(seed, B, H, T, sinks, window, topk, ties)
    ref = gathered_layout(ranks, cutoffs, sinks, window, topk=topk, block_size=bs, backend="torch")
    got = gathered_layout_triton(eviction_positions(ranks, cutoffs, sinks, window), bs, ref.capacity, **config)
    _assert_same(ref, got)


@pytest.mark.gpu
def test_cuda_gathered_layout_backends_agree():
    pytest.importorskip("triton")
    sinks, window, topk, T = 4, 256, 1000, 4096
    ranks, cutoffs = _cuda_inputs(7, 1, 8, T, sinks, window, topk, False)
    ref = gathered_layout(ranks, cutoffs, sinks, window, topk=topk, backend="torch")
    for backend in ("triton", "auto"):
        _assert_same(ref, gathered_layout(ranks, cutoffs, sinks, window, topk=topk, backend=backend))
    # topk=None: the triton backend sizes the capacity with a counts-only launch, as torch does with its counts
    ref = gathered_layout(ranks, cutoffs, sinks, window, topk=None, backend="torch")
    _assert_same(ref, gathered_layout(ranks, cutoffs, sinks, window, topk=None, backend="triton"))
    # truncation (cutoffs from a larger topk than claimed): the same first `capacity` slots
    ref = gathered_layout(ranks, cutoffs, sinks, window, topk=10, backend="torch")
    assert bool((ref.num_used > ref.capacity).any())
    _assert_same(ref, gathered_layout(ranks, cutoffs, sinks, window, topk=10, backend="triton"))


@pytest.mark.gpu
def test_cuda_layout_speed_report():
    """Prints the Triton build against the torch build at T = 16384, 8 KV heads (no assertion on speed)."""
    triton = pytest.importorskip("triton")
    sinks, window, topk, T = 4, 256, 1792, 16384
    ranks, cutoffs = _cuda_inputs(0, 1, 8, T, sinks, window, topk, False)
    end = eviction_positions(ranks, cutoffs, sinks, window)
    cap = gathered_capacity(T, sinks, window, topk, 128)
    kernel = triton.testing.do_bench(lambda: gathered_layout_triton(end, 128, cap))
    full = triton.testing.do_bench(lambda: gathered_layout(ranks, cutoffs, sinks, window, topk=topk, backend="triton"))
    ref = triton.testing.do_bench(lambda: gathered_layout(ranks, cutoffs, sinks, window, topk=topk, backend="torch"))
    print(f"gathered layout: triton kernel {kernel:.3f} ms, triton incl. eviction_positions {full:.3f} ms, "
          f"torch {ref:.3f} ms")
    _assert_same(gathered_layout(ranks, cutoffs, sinks, window, topk=topk, backend="torch"),
                 gathered_layout_triton(end, 128, cap))
