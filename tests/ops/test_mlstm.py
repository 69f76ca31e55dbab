"""mLSTM cell: chunkwise == recurrent == step loop, against an independent float64 loop over the *unstabilised*
recurrence (true-scale C, n with plain exp/sigmoid gates), and gradients against float64 autograd."""

import pytest
import torch

from kvlearn.errors import KVLearnError
from kvlearn.ops.mlstm import (
    MATMUL_DTYPES,
    MLSTMState,
    _TF32MatMul,
    mlstm_chunkwise,
    mlstm_readout,
    mlstm_recurrent,
    mlstm_step,
    mlstm_zero_state,
    tf32_matmuls,
)


def _inputs(seed, b=2, h=3, t=50, dk=8, dv=6, gate_scale=20.0, dtype=torch.float32, positive=False):
    """Random q, k, v and gate preactivations ~ N(0, gate_scale²).

    ``positive=True`` gives non-negative q, k (softmax features, as the KVpop scorer's Hedgehog map produces): then
    qᵀn is a sum of positive terms and float32 is well conditioned even with ±20 gates. With signed q, k the
    normaliser qᵀn can cancel, which amplifies float32 rounding of *any* evaluation order (the float64 test
    below checks the algebra exactly in that regime).
    """
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, dk, generator=g, dtype=torch.float64)
    k = torch.randn(b, h, t, dk, generator=g, dtype=torch.float64)
    if positive:
        q, k = q.softmax(-1), k.softmax(-1)
    v = torch.randn(b, h, t, dv, generator=g, dtype=torch.float64)
    i = torch.randn(b, h, t, generator=g, dtype=torch.float64) * gate_scale
    f = torch.randn(b, h, t, generator=g, dtype=torch.float64) * gate_scale
    return [x.to(dtype) for x in (q, k, v, i, f)]


def _naive(q, k, v, i, f, c0=None, n0=None, eps=0.0):
    """Unstabilised float64 recurrence in true scale: h = qᵀC / max(|qᵀn|, 1). Moderate gates only."""
    q, k, v, i, f = (x.double() for x in (q, k, v, i, f))
    b, h, t, dk = q.shape
    c = torch.zeros(b, h, dk, v.shape[-1], dtype=torch.float64) if c0 is None else c0.double()
    n = torch.zeros(b, h, dk, dtype=torch.float64) if n0 is None else n0.double()
    out = []
    for s in range(t):
        fg = torch.sigmoid(f[:, :, s])[..., None]
        ig = torch.exp(i[:, :, s])[..., None]
        c = fg[..., None] * c + ig[..., None] * k[:, :, s, :, None] * v[:, :, s, None, :]
        n = fg * n + ig * k[:, :, s]
        num = torch.einsum("bhk,bhkv->bhv", q[:, :, s], c)
        den = torch.einsum("bhk,bhk->bh", q[:, :, s], n).abs().clamp_min(1.0)
        out.append(num / den[..., None])
    return torch.stack(out, 2), c, n


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("seed", [0, 1])
def test_recurrent_matches_unstabilised_float64(seed):
    # moderate gates so that the unstabilised recurrence does not overflow; eps=0 makes them identical in theory
    q, k, v, i, f = _inputs(seed, t=40, gate_scale=3.0)
    ref, c, n = _naive(q, k, v, i, f)
    h, st = mlstm_recurrent(q, k, v, i, f, eps=0.0)
    assert h.dtype == torch.float32 and h.shape == (2, 3, 40, 6)
    assert _rel(h, ref) < 1e-5
    assert _rel(st.C * st.m.exp()[..., None, None], c) < 1e-5
    assert _rel(st.n * st.m.exp()[..., None], n) < 1e-5


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("t,chunk", [(5, 16), (16, 16), (37, 16), (100, 32), (130, 64), (1, 64)])
def test_chunkwise_equals_recurrent(seed, t, chunk):
    # float32, non-negative features, gates ~ ±20 (exercises the stabiliser)
    q, k, v, i, f = _inputs(seed, t=t, positive=True)
    h_r, s_r = mlstm_recurrent(q, k, v, i, f)
    h_c, s_c = mlstm_chunkwise(q, k, v, i, f, chunk_size=chunk)
    assert h_c.shape == h_r.shape and h_c.dtype == torch.float32
    assert _rel(h_c, h_r) < 1e-4
    for a, b in zip(s_c, s_r):
        assert _rel(a, b) < 1e-4
    h64, _ = mlstm_recurrent(*(x.double() for x in (q, k, v, i, f)))
    assert _rel(h_c, h64) < 1e-4
    # signed q, k with ±20 gates: the algebra is exact (float64 to rounding)
    x64 = [x.double() for x in _inputs(seed, t=t)]
    h_r64, s_r64 = mlstm_recurrent(*x64)
    h_c64, s_c64 = mlstm_chunkwise(*x64, chunk_size=chunk)
    assert h_c64.dtype == torch.float64
    assert _rel(h_c64, h_r64) < 1e-9
    for a, b in zip(s_c64, s_r64):
        assert _rel(a, b) < 1e-9
    # signed q, k with moderate gates in float32 against float64
    q, k, v, i, f = _inputs(seed, t=t, gate_scale=3.0)
    h_c, _ = mlstm_chunkwise(q, k, v, i, f, chunk_size=chunk)
    h64, _ = mlstm_recurrent(*(x.double() for x in (q, k, v, i, f)))
    assert _rel(h_c, h64) < 1e-4


@pytest.mark.parametrize("seed", [3, 4])
def test_chunkwise_against_naive_float64(seed):
    q, k, v, i, f = _inputs(seed, t=77, gate_scale=2.0)
    ref, _, _ = _naive(q, k, v, i, f)
    h, _ = mlstm_chunkwise(q, k, v, i, f, chunk_size=16, eps=0.0)
    assert _rel(h, ref) < 1e-5


@pytest.mark.parametrize("seed", [0, 5])
@pytest.mark.parametrize("split,chunk", [(23, 16), (32, 16), (50, 64), (1, 32)])
def test_state_continuation(seed, split, chunk):
    q, k, v, i, f = _inputs(seed, t=90, positive=True)
    h_all, s_all = mlstm_chunkwise(q, k, v, i, f, chunk_size=chunk)
    h1, s1 = mlstm_chunkwise(*(x[:, :, :split] for x in (q, k, v, i, f)), chunk_size=chunk)
    h2, s2 = mlstm_chunkwise(*(x[:, :, split:] for x in (q, k, v, i, f)), chunk_size=chunk, state=s1)
    assert _rel(torch.cat([h1, h2], 2), h_all) < 1e-4
    for a, b in zip(s2, s_all):
        assert _rel(a, b) < 1e-4
    # a non-empty initial state: chunkwise == recurrent from the same state
    h2r, s2r = mlstm_recurrent(*(x[:, :, split:] for x in (q, k, v, i, f)), state=s1)
    assert _rel(h2, h2r) < 1e-4
    # the naive true-scale float64 recurrence, started from the true-scale state exp(m)·(C, n), agrees
    xs = _inputs(seed, t=90, gate_scale=2.0)
    _, s_mid = mlstm_recurrent(*(x[:, :, :split] for x in xs))
    scale = s_mid.m.double().exp()
    ref, _, _ = _naive(*(x[:, :, split:] for x in xs), s_mid.C.double() * scale[..., None, None], s_mid.n.double() * scale[..., None])
    h_cont, _ = mlstm_chunkwise(*(x[:, :, split:] for x in xs), chunk_size=chunk, state=s_mid, eps=0.0)
    assert _rel(h_cont, ref) < 1e-5


@pytest.mark.parametrize("seed", [0, 1])
def test_step_sequence_equals_recurrent(seed):
    q, k, v, i, f = _inputs(seed, t=33, positive=seed == 0)
    h_r, s_r = mlstm_recurrent(q, k, v, i, f)
    state, hs = None, []
    for t in range(33):
        h_t, state = mlstm_step(q[:, :, t], k[:, :, t], v[:, :, t], i[:, :, t], f[:, :, t], state)
        hs.append(h_t)
    assert torch.equal(torch.stack(hs, 2), h_r)
    # readout of the final state with a query from a different time equals the step formula
    h_read = mlstm_readout(q[:, :, :5], state)
    manual = torch.stack([mlstm_readout(q[:, :, j], state) for j in range(5)], 2)
    assert torch.allclose(h_read, manual, rtol=1e-6, atol=1e-7)
    assert _rel(mlstm_readout(q[:, :, -1], state), h_r[:, :, -1]) < 1e-6


def test_zero_state_and_bf16_inputs():
    q, k, v, i, f = _inputs(0, t=20, positive=True)
    st = mlstm_zero_state(2, 3, 8, 6)
    h0, _ = mlstm_chunkwise(q, k, v, i, f, state=st)
    h1, _ = mlstm_chunkwise(q, k, v, i, f)
    assert torch.equal(h0, h1)
    hb, sb = mlstm_chunkwise(*(x.bfloat16() for x in (q, k, v, i, f)), chunk_size=8)
    hr, _ = mlstm_recurrent(*(x.bfloat16().float() for x in (q, k, v, i, f)))
    assert hb.dtype == torch.float32 and sb.C.dtype == torch.float32
    assert _rel(hb, hr) < 1e-4


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("t,chunk", [(29, 8), (40, 16)])
@pytest.mark.parametrize("gate_scale,positive", [(20.0, True), (3.0, False)])
def test_chunkwise_gradients_match_float64_recurrent(seed, t, chunk, gate_scale, positive):
    x32 = [x.requires_grad_() for x in _inputs(seed, t=t, gate_scale=gate_scale, positive=positive)]
    x64 = [x.detach().double().requires_grad_() for x in x32]
    g = torch.Generator().manual_seed(100 + seed)
    w = torch.randn(2, 3, t, 6, generator=g)
    init = MLSTMState(
        torch.randn(2, 3, 8, 6, generator=g), torch.randn(2, 3, 8, generator=g).abs(), torch.randn(2, 3, generator=g)
    )
    h32, s32 = mlstm_chunkwise(*x32, chunk_size=chunk, state=init)
    h64, s64 = mlstm_recurrent(*x64, state=MLSTMState(*(s.double() for s in init)))
    loss32 = (h32 * w).sum() + s32.C.sum() * 0.1
    loss64 = (h64 * w.double()).sum() + s64.C.sum() * 0.1
    g32 = torch.autograd.grad(loss32, x32)
    g64 = torch.autograd.grad(loss64, x64)
    for name, a, b in zip("q k v igate fgate".split(), g32, g64):
        assert _rel(a, b) < 1e-4, name


def test_gradcheck_float64():
    # T=7 with chunk 3: two full chunks and a remainder of one, from a non-empty state
    x = [t.double().requires_grad_() for t in _inputs(7, b=1, h=1, t=7, dk=3, dv=2, gate_scale=2.0)]
    init = mlstm_zero_state(1, 1, 3, 2, dtype=torch.float64)
    init = MLSTMState(init.C + 0.3, init.n + 0.2, init.m - 0.5)

    def fn(q, k, v, i, f):
        h, st = mlstm_chunkwise(q, k, v, i, f, chunk_size=3, state=init)
        return h, st.C, st.n

    assert torch.autograd.gradcheck(fn, x, eps=1e-6, atol=1e-6, rtol=1e-4)


@pytest.fixture(scope="module")
def t300_case():
    """T = 300 inputs (float32 non-negative features; float64 signed) with their recurrent references."""
    x = _inputs(31, b=1, h=2, t=300, positive=True)
    init = MLSTMState(torch.rand(1, 2, 8, 6), torch.rand(1, 2, 8), torch.randn(1, 2))
    x64 = [y.double() for y in _inputs(32, b=1, h=2, t=300)]
    return x, init, mlstm_recurrent(*x), mlstm_recurrent(*x, state=init), x64, mlstm_recurrent(*x64)


@pytest.mark.parametrize("chunk", [1, 2, 3, 4, 8, 16, 32, 64, 128])
def test_every_chunk_size_equals_recurrent(chunk, t300_case):
    # T = 300: chunk counts 300, 150, 100, 75, 37 (+ remainders, 37 is prime), 18, 9, 4, 2: the chunk start
    # states run through every two-level grouping (groups of G chunks, G | NC), G = 1 included
    x, init, (h_r0, s_r0), (h_r, s_r), x64, (h_r64, s_r64) = t300_case
    h_c, s_c = mlstm_chunkwise(*x, chunk_size=chunk)
    assert _rel(h_c, h_r0) < 1e-4
    assert all(_rel(a, b) < 1e-4 for a, b in zip(s_c, s_r0))
    h_c, s_c = mlstm_chunkwise(*x, chunk_size=chunk, state=init)
    assert _rel(h_c, h_r) < 1e-4
    assert all(_rel(a, b) < 1e-4 for a, b in zip(s_c, s_r))
    # the algebra is exact: float64 with signed q, k and ±20 gates
    h_c64, s_c64 = mlstm_chunkwise(*x64, chunk_size=chunk)
    assert _rel(h_c64, h_r64) < 1e-9
    assert all(_rel(a, b) < 1e-9 for a, b in zip(s_c64, s_r64))


@pytest.mark.parametrize("t,chunk", [(96, 4), (120, 5)])
def test_grouped_chunk_states_gradients_match_float64(t, chunk):
    # 24 chunks (groups of 4) and 24 chunks of 5: gradients through the two-level chunk start states
    x32 = [x.requires_grad_() for x in _inputs(41, b=1, h=2, t=t, positive=True)]
    x64 = [x.detach().double().requires_grad_() for x in x32]
    init = MLSTMState(torch.rand(1, 2, 8, 6), torch.rand(1, 2, 8), torch.randn(1, 2))
    w = torch.randn(1, 2, t, 6, generator=torch.Generator().manual_seed(5))
    h32, s32 = mlstm_chunkwise(*x32, chunk_size=chunk, state=init)
    h64, s64 = mlstm_recurrent(*x64, state=MLSTMState(*(s.double() for s in init)))
    g32 = torch.autograd.grad((h32 * w).sum() + s32.C.sum() * 0.1, x32)
    g64 = torch.autograd.grad((h64 * w.double()).sum() + s64.C.sum() * 0.1, x64)
    for name, a, b in zip("q k v igate fgate".split(), g32, g64):
        assert _rel(a, b) < 1e-4, name


def test_grouped_chunk_states_as_accurate_as_float64_at_many_chunks():
    # 512 chunks of 2 (groups of 16) with ±20 gates: the two-level start states keep float32 error at ~1e-6
    x = _inputs(7, b=1, h=2, t=1024, positive=True)
    ref, s_ref = mlstm_recurrent(*(y.double() for y in x))
    h, st = mlstm_chunkwise(*x, chunk_size=2)
    assert _rel(h, ref) < 1e-5
    assert all(_rel(a, b) < 1e-5 for a, b in zip(st, s_ref))


def test_group_size_is_a_divisor_near_sqrt():
    from kvlearn.ops.mlstm import chunk_group_size

    assert [chunk_group_size(n) for n in (1, 2, 3, 4, 7, 64, 256, 512)] == [1, 1, 1, 2, 1, 8, 16, 16]
    for n in range(1, 200):
        assert n % chunk_group_size(n) == 0


def test_large_preactivations_stay_finite():
    q, k, v, i, f = _inputs(11, t=70, gate_scale=60.0, positive=True)
    h, st = mlstm_chunkwise(q, k, v, i, f, chunk_size=16)
    h_r, _ = mlstm_recurrent(q, k, v, i, f)
    assert torch.isfinite(h).all() and all(torch.isfinite(s).all() for s in st)
    assert _rel(h, h_r) < 1e-4


def test_bad_inputs_raise():
    q, k, v, i, f = _inputs(0, t=10)
    with pytest.raises(KVLearnError, match="chunk_size=0"):
        mlstm_chunkwise(q, k, v, i, f, chunk_size=0)
    with pytest.raises(KVLearnError, match="k.shape"):
        mlstm_chunkwise(q, k[..., :5], v, i, f)
    with pytest.raises(KVLearnError, match="igate.shape"):
        mlstm_recurrent(q, k, v, i[:, :, :5], f)
    with pytest.raises(KVLearnError, match="state.C.shape"):
        mlstm_chunkwise(q, k, v, i, f, state=mlstm_zero_state(2, 3, 8, 7))
    with pytest.raises(KVLearnError, match="q.dtype"):
        mlstm_step(q[:, :, 0].long(), k[:, :, 0], v[:, :, 0], i[:, :, 0], f[:, :, 0])
    with pytest.raises(KVLearnError, match="q.shape"):
        mlstm_chunkwise(q[0], k, v, i, f)


@pytest.mark.gpu
def test_chunkwise_on_cuda_matches_float64_cpu():
    q, k, v, i, f = _inputs(21, b=2, h=4, t=300, dk=16, dv=8, positive=True)
    ref, ref_state = mlstm_recurrent(*(x.double() for x in (q, k, v, i, f)))
    h, st = mlstm_chunkwise(*(x.cuda() for x in (q, k, v, i, f)), chunk_size=64)
    assert h.is_cuda and h.dtype == torch.float32
    assert _rel(h.cpu(), ref) < 1e-4
    for a, b in zip(st, ref_state):
        assert _rel(a.cpu(), b) < 1e-4
    x = [t.cuda().requires_grad_() for t in (q, k, v, i, f)]
    h, _ = mlstm_chunkwise(*x, chunk_size=32)
    h.square().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in x)


# ----------------------------------------------------------------------------------------------------------------
# matmul_dtype: "float32" (default), "tf32" (CUDA only; a no-op on the CPU), "bfloat16" (bf16 operands of the chunk
# matmuls, float32 results). Bounds for bf16 vs float32, measured on the CPU (torch 2.13, non-negative features as
# the scorer's Hedgehog map gives, the shapes below and more, 4 seeds each): h max-relative <= 6.0e-3, state C
# <= 6.7e-3, n <= 3.2e-3, m bit-equal; gradients (relative Frobenius norm) v, igate, fgate <= 4.7e-3, q, k <= 2.6e-2.
# Gates of moderate size (|ĩ| ~ 3-5) can put |qᵀn| next to exp(-m) in the normaliser's max; a bf16 rounding then
# flips the branch and the q, k and gate gradients of those tokens jump (up to 0.2 norm-relative seen): the
# gradient bounds hold where the branch is decided with margin (gate scales 1 and 20 here).
BF16_BOUNDS = {"h": 1.5e-2, "C": 1.5e-2, "n": 1.5e-2, "grad_vif": 1e-2, "grad_qk": 6e-2}
BF16_FLOOR = 1e-4  # bf16 operands must change the result by more than this: the option really took effect


def _norm_rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _run_with_grads(xs, chunk, matmul_dtype, state=None):
    xs = [x.detach().clone().requires_grad_() for x in xs]
    h, st = mlstm_chunkwise(*xs, chunk_size=chunk, state=state, matmul_dtype=matmul_dtype)
    w = torch.randn(h.shape, generator=torch.Generator().manual_seed(99))
    ((h * w).sum() + st.C.sum()).backward()
    return h.detach(), MLSTMState(*(x.detach() for x in st)), [x.grad for x in xs]


def _bf16_errors(got, ref):
    """Errors of a (h, state, grads) triple against the float32 one, in the units of BF16_BOUNDS."""
    (h, st, g), (h0, st0, g0) = got, ref
    return {
        "h": _rel(h, h0), "C": _rel(st.C, st0.C), "n": _rel(st.n, st0.n),
        "grad_vif": max(_norm_rel(g[i], g0[i]) for i in (2, 3, 4)),
        "grad_qk": max(_norm_rel(g[i], g0[i]) for i in (0, 1)),
    }


def _within_bf16_bounds(err) -> bool:
    return all(BF16_FLOOR < err[name] < bound for name, bound in BF16_BOUNDS.items())


@pytest.mark.parametrize("b,h,t,dk,dv,chunk,gate_scale", [
    (2, 3, 200, 16, 8, 32, 20.0),  # 7 chunks (6 full + a remainder), grouped chunk states
    (1, 2, 300, 32, 16, 64, 20.0),  # 5 chunks
    (1, 2, 160, 16, 8, 16, 1.0),  # 10 chunks, small gates (the normaliser's floor is active)
])
def test_bf16_matmuls_within_measured_tolerance_of_float32(b, h, t, dk, dv, chunk, gate_scale):
    for seed in (0, 1):
        xs = _inputs(seed, b=b, h=h, t=t, dk=dk, dv=dv, gate_scale=gate_scale, positive=True)
        ref = _run_with_grads(xs, chunk, "float32")
        got = _run_with_grads(xs, chunk, "bfloat16")
        assert torch.equal(got[1].m, ref[1].m)  # the stabiliser is float32 arithmetic of the gates only
        err = _bf16_errors(got, ref)
        assert _within_bf16_bounds(err), err
        # the check can fail: a result 2% off, or float32 itself (no bf16 effect), is rejected
        off = (ref[0] * 1.02, ref[1], ref[2])
        assert not _within_bf16_bounds(_bf16_errors(off, ref))
        assert not _within_bf16_bounds(_bf16_errors(ref, ref))


def test_bf16_matmuls_with_a_start_state_and_against_float64_reference():
    # an independent reference: the unstabilised float64 recurrence (moderate gates), from a non-empty state
    q, k, v, i, f = _inputs(7, t=150, dk=16, dv=8, gate_scale=3.0, positive=True)
    _, c0, n0 = _naive(q[:, :, :40], k[:, :, :40], v[:, :, :40], i[:, :, :40], f[:, :, :40])
    state = MLSTMState(c0.float(), n0.float(), torch.zeros(c0.shape[:2]))
    ref, _, _ = _naive(q[:, :, 40:], k[:, :, 40:], v[:, :, 40:], i[:, :, 40:], f[:, :, 40:], c0, n0)
    rest = [x[:, :, 40:] for x in (q, k, v, i, f)]
    for dtype, bound in (("float32", 1e-5), ("tf32", 1e-5), ("bfloat16", BF16_BOUNDS["h"])):
        h, _ = mlstm_chunkwise(*rest, chunk_size=16, state=state, eps=0.0, matmul_dtype=dtype)
        assert _rel(h, ref) < bound, dtype


@pytest.mark.parametrize("t,chunk", [(100, 32), (37, 16)])
def test_tf32_is_a_no_op_on_the_cpu(t, chunk):
    xs = _inputs(2, t=t, positive=True)
    ref = _run_with_grads(xs, chunk, "float32")
    got = _run_with_grads(xs, chunk, "tf32")
    assert torch.equal(got[0], ref[0]) and all(torch.equal(a, b) for a, b in zip(got[2], ref[2]))


def test_tf32_matmuls_restores_the_setting():
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    with tf32_matmuls():
        assert matmul.fp32_precision == "tf32"
    assert matmul.fp32_precision == before
    with pytest.raises(RuntimeError, match="boom"):
        with tf32_matmuls():
            raise RuntimeError("boom")
    assert matmul.fp32_precision == before
    assert matmul.allow_tf32 in (True, False)  # reading the legacy flag after a restore must not raise "mix of ... APIs"


def test_tf32_matmul_function_gradients_equal_plain_matmul():
    # the eager TF32 matmul (used on CUDA) is an autograd.Function: its backward must be the matmul's, broadcasting
    # included; on the CPU the TF32 setting changes nothing, so the results are equal
    for sa, sb in (((2, 3, 5, 4), (2, 3, 4, 6)), ((2, 3, 5, 4), (1, 3, 4, 6)), ((5, 4), (2, 4, 6))):
        a = torch.randn(sa, dtype=torch.float64, requires_grad=True)
        b = torch.randn(sb, dtype=torch.float64, requires_grad=True)
        assert torch.autograd.gradcheck(_TF32MatMul.apply, (a, b))
        out = _TF32MatMul.apply(a, b)
        ga, gb = torch.autograd.grad(out.square().sum(), (a, b))
        ra, rb = torch.autograd.grad((a @ b).square().sum(), (a, b))
        assert torch.allclose(ga, ra) and torch.allclose(gb, rb)


def test_bad_matmul_dtype_is_a_one_line_error():
    q, k, v, i, f = _inputs(0, t=10)
    with pytest.raises(KVLearnError, match=r"^matmul_dtype='fp16' is unknown: expected one of float32, tf32, bfloat16$"):
        mlstm_chunkwise(q, k, v, i, f, matmul_dtype="fp16")
    with pytest.raises(KVLearnError, match=r"^matmul_dtype=torch.bfloat16 is unknown"):
        mlstm_chunkwise(q, k, v, i, f, matmul_dtype=torch.bfloat16)
    assert MATMUL_DTYPES == ("float32", "tf32", "bfloat16")


@pytest.mark.gpu
@pytest.mark.parametrize("matmul_dtype", ["tf32", "bfloat16"])
def test_reduced_precision_matmuls_on_cuda_within_bounds(matmul_dtype):
    xs = _inputs(21, b=2, h=4, t=300, dk=16, dv=8, positive=True)
    ref = _run_with_grads([x.cuda() for x in xs], 64, "float32")
    before = torch.backends.cuda.matmul.fp32_precision
    got = _run_with_grads([x.cuda() for x in xs], 64, matmul_dtype)
    assert torch.backends.cuda.matmul.fp32_precision == before  # forward and backward restored it
    err = _bf16_errors(got, ref)
    assert all(err[name] < bound for name, bound in BF16_BOUNDS.items()), err
