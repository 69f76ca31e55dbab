"""KVpop scorers: shapes, detaching, hand-written references, and the mLSTM delayed-readout semantics checked
against a brute-force float64 computation of the true-scale (unstabilised) memory."""

import pytest
import torch
import torch.nn.functional as F

from kvlearn.errors import KVLearnError
from kvlearn.kvpop import scorers as scorers_mod
from kvlearn.kvpop.scorers import LinearScorer, MLPScorer, MLSTMScorer


def _kv(seed, b=2, h=2, t=40, d=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, h, t, d, generator=g)
    v = torch.randn(b, h, t, d, generator=g)
    return k.to(dtype), v.to(dtype)


def _randomize(module, seed, scale=0.3):
    """Perturb every parameter (so that tests do not depend on the structured init)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return module


def _mlstm(h=2, d=8, window=5, seed=0, **kw):
    return _randomize(MLSTMScorer(h, d, window=window, **kw), seed)


def _ref_mlstm_scores(s: MLSTMScorer, key, value):
    """Brute force, float64, true scale: C_p = Σ_{j<=p} (Π_{j<r<=p} σ(f̃_r)) exp(ĩ_j) k̃_j ṽ_jᵀ, n_p likewise;
    h_{u|p} = q̃_uᵀC_p / max(|q̃_uᵀ n_p|, 1); p = min(u + w, T-1) (delayed) or u (immediate)."""
    x = torch.cat([key, value], -1).double()
    bsz, heads, t, _ = x.shape
    out = torch.empty(bsz, heads, t, dtype=torch.float64)
    cap = (lambda z: s.gate_softcap * torch.tanh(z / s.gate_softcap)) if s.gate_softcap else (lambda z: z)
    for hh in range(heads):
        p64 = {n: (p[hh].double() if p is not None else None) for n, p in s.named_parameters()}
        xh = x[:, hh]  # [B,T,2D]

        def phi(y):
            e1, e2 = torch.exp(y - y.max(-1, keepdim=True).values), torch.exp(-y - (-y).max(-1, keepdim=True).values)
            return torch.cat([e1 / e1.sum(-1, keepdim=True), e2 / e2.sum(-1, keepdim=True)], -1)

        q, k, v = phi(xh @ p64["w_q"]), phi(xh @ p64["w_k"]), xh @ p64["w_v"]
        ig = cap(xh @ p64["w_i"] + p64["b_i"])
        logf = F.logsigmoid(cap(xh @ p64["w_f"] + p64["b_f"]))
        for bb in range(bsz):
            for u in range(t):
                p = min(u + s.window, t - 1) if s.delayed_readout else u
                c = torch.zeros(k.shape[-1], v.shape[-1], dtype=torch.float64)
                n = torch.zeros(k.shape[-1], dtype=torch.float64)
                for j in range(p + 1):
                    wgt = torch.exp(logf[bb, j + 1 : p + 1].sum() + ig[bb, j])
                    c = c + wgt * torch.outer(k[bb, j], v[bb, j])
                    n = n + wgt * k[bb, j]
                hvec = (q[bb, u] @ c) / torch.clamp((q[bb, u] @ n).abs(), min=1.0)
                if s.use_norm:
                    hvec = hvec / torch.sqrt((hvec**2).mean() + s.norm_eps) * p64["norm_weight"]
                out[bb, hh, u] = (F.silu(hvec) * p64["a"]).sum() + p64["b"]
    return out


# ---------------------------------------------------------------------------------------------------------------
# all scorers


def _all_scorers(h=2, d=8):
    return [
        _randomize(LinearScorer(h, d), 1),
        _randomize(MLPScorer(h, d), 2),
        _mlstm(h, d, window=5, seed=3, chunk_size=16),
        _mlstm(h, d, window=5, seed=4, delayed_readout=False, use_norm=True, chunk_size=16),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shapes_dtypes_and_low_precision_inputs(dtype):
    k, v = _kv(0, t=37, dtype=dtype)
    for s in _all_scorers():
        r = s(k, v)
        assert r.shape == (2, 2, 37) and r.dtype == torch.float32 and torch.isfinite(r).all()
        # computed in float32: equal to feeding the same values already in float32
        assert torch.allclose(r, s(k.float(), v.float()), rtol=0, atol=0)


def test_detached_inputs_and_gradient_to_all_parameters():
    for s in _all_scorers():
        k, v = _kv(1, t=30)
        k.requires_grad_()
        v.requires_grad_()
        loss = (s(k, v) * torch.randn(2, 2, 30)).sum()
        loss.backward()
        assert k.grad is None and v.grad is None
        for name, p in s.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, (type(s).__name__, name)


def test_bf16_module_parameters_still_compute_in_float32():
    s = _mlstm(seed=5)
    k, v = _kv(2)
    ref = s(k, v)
    s16 = s.to(torch.bfloat16)
    r = s16(k, v)
    assert r.dtype == torch.float32
    assert (r - ref).abs().max() < 0.1 * ref.abs().max()  # only the parameter rounding differs


def test_linear_matches_einsum():
    for seed in range(3):
        s = _randomize(LinearScorer(3, 8, zero_init=False), seed)
        k, v = _kv(seed, b=2, h=3, t=11)
        x = torch.cat([k, v], -1).double()
        ref = torch.einsum("bhtc,hc->bht", x, s.weight.double()) + s.bias.double()[None, :, None]
        assert torch.allclose(s(k, v).double(), ref, rtol=1e-5, atol=1e-5)


def test_mlp_matches_per_head_loop():
    s = _randomize(MLPScorer(3, 8, hidden=12, zero_init=False), 7)
    k, v = _kv(3, b=2, h=3, t=9)
    x = torch.cat([k, v], -1).double()
    ref = torch.empty(2, 3, 9, dtype=torch.float64)
    for h in range(3):
        hid = F.silu(x[:, h] @ s.w1[h].double() + s.b1[h].double())
        ref[:, h] = hid @ s.w2[h].double() + s.b2[h].double()
    assert torch.allclose(s(k, v).double(), ref, rtol=1e-5, atol=1e-5)
    assert MLPScorer(3, 8).hidden == 16


def test_zero_init_gives_constant_scores():
    k, v = _kv(4, t=33)
    for s in (LinearScorer(2, 8), MLPScorer(2, 8), MLSTMScorer(2, 8, window=4), MLSTMScorer(2, 8, window=4, use_norm=True)):
        r = s(k, v)
        assert torch.equal(r, torch.zeros_like(r)), type(s).__name__
    s = MLSTMScorer(2, 8, window=4)
    with torch.no_grad():
        s.b.copy_(torch.tensor([0.5, -1.5]))
    r = s(k, v)
    assert torch.equal(r, s.b.detach()[None, :, None].expand_as(r))


# ---------------------------------------------------------------------------------------------------------------
# mLSTM scorer semantics


@pytest.mark.parametrize(
    "t,window,chunk,delayed,use_norm",
    [(23, 5, 8, True, False), (23, 5, 8, False, True), (9, 12, 4, True, True), (17, 1, 16, True, False), (20, 6, 64, True, True)],
)
def test_mlstm_scores_match_bruteforce_float64(t, window, chunk, delayed, use_norm):
    s = _mlstm(window=window, seed=t + window, chunk_size=chunk, delayed_readout=delayed, use_norm=use_norm)
    with torch.no_grad():  # make the gates vary a lot across tokens
        s.w_i.mul_(10.0)
        s.w_f.mul_(10.0)
    s.eps = 0.0
    k, v = _kv(t, b=1, t=t)
    assert torch.allclose(s(k, v).double(), _ref_mlstm_scores(s, k, v), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_delayed_readout_uses_no_later_token(seed):
    w, t = 6, 40
    s = _mlstm(window=w, seed=seed, chunk_size=8)
    k, v = _kv(seed, t=t)
    base = s(k, v)
    for p in (10, 17, 31):  # perturb every token after p: scores of u <= p - w must not move
        k2, v2 = k.clone(), v.clone()
        k2[:, :, p + 1 :] += torch.randn_like(k2[:, :, p + 1 :])
        v2[:, :, p + 1 :] += torch.randn_like(v2[:, :, p + 1 :])
        r = s(k2, v2)
        assert torch.allclose(r[:, :, : p - w + 1], base[:, :, : p - w + 1], rtol=0, atol=1e-6)
        assert not torch.allclose(r[:, :, p - w + 1 :], base[:, :, p - w + 1 :])
        # perturbing exactly token p = u + w changes the score of u (a != 0), and leaves u' < u alone
        k3 = k.clone()
        k3[:, :, p] += 1.0
        r3 = s(k3, v)
        assert (r3[:, :, p - w] - base[:, :, p - w]).abs().min() > 1e-6
        assert torch.allclose(r3[:, :, : p - w], base[:, :, : p - w], rtol=0, atol=1e-6)


def test_immediate_readout_differs_and_is_causal_at_u():
    k, v = _kv(5, t=30)
    delayed = _mlstm(window=4, seed=9, chunk_size=8)
    immediate = _mlstm(window=4, seed=9, chunk_size=8, delayed_readout=False)
    assert immediate.readout_delay == 0 and delayed.readout_delay == 4
    rd, ri = delayed(k, v), immediate(k, v)
    assert (rd - ri).abs().max() > 1e-3
    # the last token reads the same state (T-1) with the same query in both modes
    assert torch.allclose(rd[:, :, -1], ri[:, :, -1], rtol=1e-6, atol=1e-6)
    k2 = k.clone()
    k2[:, :, 11:] += 1.0
    assert torch.allclose(immediate(k2, v)[:, :, :11], ri[:, :, :11], rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    "t0,t,window,delayed,use_norm,skip",
    [(20, 45, 6, True, False, False), (3, 30, 6, True, True, False), (1, 41, 30, True, False, False),
     (17, 40, 1, True, True, False), (10, 33, 5, False, False, False),
     (20, 45, 6, True, False, True), (3, 30, 6, True, False, True), (10, 33, 5, False, False, True)],
)
def test_prefill_then_steps_reproduce_forward(t0, t, window, delayed, use_norm, skip):
    """Decoding token by token (``step``, with u's cached key/value for the delayed readout and the skip path)
    equals the full forward, with or without the skip connection."""
    s = _mlstm(window=window, seed=t0, chunk_size=8, delayed_readout=delayed, use_norm=use_norm, skip=skip)
    k, v = _kv(t0 + t, t=t)
    full = s(k, v)
    scores, state = s.prefill(k[:, :, :t0], v[:, :, :t0])
    assert torch.equal(scores, s(k[:, :, :t0], v[:, :, :t0]))
    d = s.readout_delay
    final = torch.full_like(full, float("nan"))
    final[:, :, : max(t0 - d, 0)] = scores[:, :, : max(t0 - d, 0)]
    for step in range(t0, t):
        u = step - d
        if d == 0:
            r, state = s.step(k[:, :, step], v[:, :, step], state=state)
        elif u < 0:
            r, state = s.step(k[:, :, step], v[:, :, step], None, None, state)
            assert r is None
            continue
        else:
            r, state = s.step(k[:, :, step], v[:, :, step], k[:, :, u], v[:, :, u], state)
        assert r.shape == (2, 2) and r.dtype == torch.float32
        final[:, :, u] = r
    n_final = t - d
    assert torch.allclose(final[:, :, :n_final], full[:, :, :n_final], rtol=1e-5, atol=1e-5)
    # the decode state equals the prefill state of the whole sequence
    _, state_full = s.prefill(k, v)
    for a, b in zip(state, state_full):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_step_from_empty_state_and_init_state():
    s = _mlstm(window=3, seed=1)
    k, v = _kv(6, t=10)
    st0 = s.init_state(2)
    assert st0.C.shape == (2, 2, 8, 4) and st0.n.shape == (2, 2, 8) and st0.m.shape == (2, 2)
    r1, a = s.step(k[:, :, 0], v[:, :, 0], state=None)
    r2, b = s.step(k[:, :, 0], v[:, :, 0], state=st0)
    assert r1 is None and r2 is None
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_stateless_step_equals_forward():
    for s in (_randomize(LinearScorer(2, 8), 1), _randomize(MLPScorer(2, 8), 2)):
        k, v = _kv(7, t=5)
        assert s.init_state(2) is None and s.readout_delay == 0 and not s.stateful
        full, st = s.prefill(k, v)
        assert st is None
        for t in range(5):
            r, st = s.step(k[:, :, t], v[:, :, t], state=st)
            assert torch.allclose(r, full[:, :, t], rtol=1e-6, atol=1e-6)


def test_parameter_counts_and_state_bytes_d128():
    assert LinearScorer(8, 128).num_parameters_per_head() == 2 * 128 + 1
    assert MLPScorer(8, 128).num_parameters_per_head() == 256 * 256 + 256 + 256 + 1
    s = MLSTMScorer(8, 128, window=256)
    # W_q, W_k, W_v [256, 64]; w_i, w_f [256]; b_i, b_f; a [64]; b
    assert s.num_parameters_per_head() == 3 * 256 * 64 + 2 * 256 + 2 + 64 + 1 == 49731
    assert MLSTMScorer(8, 128, window=256, use_norm=True).num_parameters_per_head() == 49731 + 64
    assert s.state_bytes_per_head() == 4 * (128 * 64 + 128 + 1) == 33284
    assert LinearScorer(8, 128).state_bytes_per_head() == 0


def test_initialisation_follows_appendix_e5():
    s = MLSTMScorer(4, 8, window=3)
    # q/k from the key half only, v from the value half only, orthonormal folded identity
    assert torch.equal(s.w_q, s.w_k)
    assert s.w_q[:, 8:].abs().sum() == 0 and s.w_v[:, :8].abs().sum() == 0
    wq = s.w_q[0, :8]
    assert torch.allclose(wq.T @ wq, torch.eye(4), atol=1e-6)
    assert torch.allclose(s.b_f, torch.tensor([3.0, 4.0, 5.0, 6.0]))
    assert s.a.abs().sum() == 0 and s.w_i.abs().sum() == 0 and s.b_i.abs().sum() == 0


def test_bad_inputs_raise():
    s = MLSTMScorer(2, 8, window=3)
    k, v = _kv(0, t=5)
    with pytest.raises(KVLearnError, match="head_dim=7"):
        MLSTMScorer(2, 7, window=3)
    with pytest.raises(KVLearnError, match="window=0"):
        MLSTMScorer(2, 8, window=0)
    with pytest.raises(KVLearnError, match="key.shape"):
        s(k[:, :1], v[:, :1])
    with pytest.raises(KVLearnError, match="value.shape"):
        s(k, v[:, :, :4])
    with pytest.raises(KVLearnError, match="key.dtype"):
        s(k.long(), v)
    with pytest.raises(KVLearnError, match="key_t.shape"):
        s.step(k, v)
    with pytest.raises(KVLearnError, match="delayed_readout=False"):
        MLSTMScorer(2, 8, window=3, delayed_readout=False).step(k[:, :, 0], v[:, :, 0], k[:, :, 0], v[:, :, 0])
    with pytest.raises(KVLearnError, match="readout_delay=0"):
        LinearScorer(2, 8).step(k[:, :, 0], v[:, :, 0], k[:, :, 0], v[:, :, 0])
    with pytest.raises(KVLearnError, match="num_kv_heads=0"):
        LinearScorer(0, 8)
    with pytest.raises(KVLearnError, match="compile='yes'") as err:
        MLSTMScorer(2, 8, window=3, compile="yes")
    assert "\n" not in str(err.value)
    with pytest.raises(KVLearnError, match="compile=1 is invalid"):
        MLSTMScorer(2, 8, window=3, compile=1)


def test_mlstm_prefill_ignores_left_padding_marked_invalid():
    torch.manual_seed(21)
    sc = MLSTMScorer(2, 16, window=3, chunk_size=8)
    for prm in sc.parameters():
        torch.nn.init.normal_(prm, std=0.5)
    k, v = torch.randn(1, 2, 19, 16), torch.randn(1, 2, 19, 16)
    valid = torch.zeros(1, 19, dtype=torch.bool)
    valid[:, 11:] = True
    scores_pad, state_pad = sc.prefill(k, v, valid=valid)
    scores_solo, state_solo = sc.prefill(k[:, :, 11:], v[:, :, 11:])
    torch.testing.assert_close(scores_pad[:, :, 11:], scores_solo, atol=1e-5, rtol=1e-5)
    for a, b in zip(state_pad, state_solo):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def _continue_in_chunks(s, k, v, bounds, valid=None):
    """Scores of the whole sequence from ``continue_prefill`` over the chunks ``bounds``: each token's last score
    (a delayed readout's past tokens are re-scored by the next chunk) and the final state."""
    d, t = s.readout_delay, k.shape[2]
    scores = torch.full(k.shape[:3], float("nan"))
    state = None
    for a, z in zip(bounds[:-1], bounds[1:]):
        past_k = past_v = None
        if d and a > 0:
            idx = torch.arange(a - d, a)
            have = (idx >= 0)[None, None, :, None]
            past_k = torch.where(have, k[:, :, idx.clamp(min=0)], 0.0)
            past_v = torch.where(have, v[:, :, idx.clamp(min=0)], 0.0)
        sc, past, state = s.continue_prefill(k[:, :, a:z], v[:, :, a:z], None, state, past_k, past_v)
        assert (past is None) == (d == 0)
        scores[:, :, a:z] = sc
        for j in range(d if a > 0 else 0):
            if a - d + j >= 0:
                scores[:, :, a - d + j] = past[:, :, j]
    assert t == bounds[-1]
    return scores, state


@pytest.mark.parametrize("delayed", [True, False])
@pytest.mark.parametrize("window", [1, 3, 7])
@pytest.mark.parametrize("bounds", [[0, 5, 6, 20, 37], [0, 1, 2, 3, 37], [0, 2, 4, 30, 31, 37], [0, 37]])
def test_continue_prefill_in_chunks_equals_forward(delayed, window, bounds):
    """Chunked prefill from the carried state (chunks of 1 token, shorter and longer than the window, not dividing
    the length): every score (the last window's provisional ones too) and the state equal the one-pass forward,
    to float32 rounding; and the forward equals the float64 brute force."""
    s = _mlstm(d=16, window=window, seed=window + len(bounds), chunk_size=4, delayed_readout=delayed, use_norm=delayed)
    k, v = _kv(window, d=16, t=37)
    full, state_full = s.prefill(k, v)
    scores, state = _continue_in_chunks(s, k, v, bounds)
    torch.testing.assert_close(scores, full, atol=1e-5, rtol=1e-5)
    for a, b in zip(state, state_full):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # prefill(state=...) gives the chunk's scores of continue_prefill
    head, st = s.prefill(k[:, :, :10], v[:, :, :10])
    tail, st2 = s.prefill(k[:, :, 10:], v[:, :, 10:], state=st)
    torch.testing.assert_close(tail, full[:, :, 10:], atol=1e-5, rtol=1e-5)
    for a, b in zip(st2, state_full):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("delayed", [True, False])
def test_continue_prefill_with_padding_anywhere_equals_the_row_alone(delayed):
    """Padding inside a chunk (left, in the middle, right, a whole row of it) neither writes nor decays the memory
    and the delayed readout counts real tokens: the real tokens' scores equal the unpadded run's."""
    s = _mlstm(d=16, window=3, seed=23, chunk_size=4, delayed_readout=delayed)
    k, v = _kv(24, b=1, d=16, t=30)
    full, state_full = s.prefill(k, v)
    _, state = s.prefill(k[:, :, :12], v[:, :, :12])
    # the second chunk: real tokens 12..29 spread over 26 columns, batch row 1 all padding
    cols = torch.tensor([0, 1, 2, 5, 6, 7, 8, 9, 10, 11, 15, 16, 17, 18, 19, 20, 21, 24])
    kc, vc = torch.zeros(2, 2, 26, 16), torch.zeros(2, 2, 26, 16)
    kc[0, :, cols], vc[0, :, cols] = k[0, :, 12:], v[0, :, 12:]
    kc[1], vc[1] = torch.randn(2, 26, 16), torch.randn(2, 26, 16)
    valid = torch.zeros(2, 26, dtype=torch.bool)
    valid[0, cols] = True
    state2 = type(state)(*(torch.cat([x, x]) for x in state))
    past_k = past_v = None
    if delayed:
        past_k, past_v = k[:, :, 9:12].expand(2, -1, -1, -1), v[:, :, 9:12].expand(2, -1, -1, -1)
    sc, past, new = s.continue_prefill(kc, vc, valid, state2, past_k, past_v)
    torch.testing.assert_close(sc[0][:, cols], full[0, :, 12:], atol=1e-5, rtol=1e-5)
    for a, b, old in zip(new, state_full, state):
        torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5)
        assert torch.equal(a[1], old[0])  # a row of padding only: its memory is untouched
    if delayed:
        torch.testing.assert_close(past[0], full[0, :, 9:12], atol=1e-5, rtol=1e-5)


def test_continue_prefill_bad_inputs_are_one_line():
    s = _mlstm(window=3, seed=1)
    k, v = _kv(2, t=6)
    _, state = s.prefill(k, v)
    for call, needle in (
        (lambda: s.continue_prefill(k, v, None, state, k[:, :, :2], v[:, :, :2]), "past_key.shape"),
        (lambda: s.continue_prefill(k, v, None, state, k[:, :, :3], None), "only one of past_key/past_value"),
        (lambda: s.continue_prefill(k, v, torch.ones(2, 5, dtype=torch.bool), state), "valid shape"),
        (lambda: s.continue_prefill(k, v, None, state[:2]), "expected an MLSTMState"),
        (lambda: s.continue_prefill(k, v, None, type(state)(state.C[:1], state.n[:1], state.m[:1])), "state.C.shape"),
        (lambda: _mlstm(window=3, delayed_readout=False).continue_prefill(k, v, None, None, k[:, :, :3], v[:, :, :3]),
         "delayed_readout=False"),
    ):
        with pytest.raises(KVLearnError, match=needle) as err:
            call()
        assert "\n" not in str(err.value)


# ---------------------------------------------------------------------------------------------------------------
# compiled path (CUDA by default; here traced on the CPU)


def _scores_args(s, k, v, valid=None):
    return (k, v, valid, s.score_params(), s.readout_delay, s.chunk_size, s.gate_softcap, s.eps, s.norm_eps)


def _compare_compiled(compiled, s, k, v, valid=None, tol=1e-5):
    outs = []
    for fn in (compiled, scorers_mod.mlstm_scores):
        out = fn(*_scores_args(s, k, v, valid))
        loss = (out[0] * torch.linspace(-1, 1, out[0].numel()).view_as(out[0])).sum() + out[1].sum() + out[2].sum()
        outs.append((out, torch.autograd.grad(loss, list(s.parameters()))))
    (oc, gc), (oe, ge) = outs
    for a, b in zip(oc, oe):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    for (name, _), a, b in zip(s.named_parameters(), gc, ge):
        assert ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() < tol, name


@pytest.mark.parametrize("delayed,use_norm,padded", [(True, False, False), (False, True, False), (True, True, True)])
def test_compiled_scores_equal_eager_in_one_graph(delayed, use_norm, padded):
    # fullgraph=True: the function traces without graph breaks; aot_eager runs the traced forward and backward
    compiled = torch.compile(scorers_mod.mlstm_scores, dynamic=False, fullgraph=True, backend="aot_eager")
    s = _mlstm(window=5, seed=11, chunk_size=8, delayed_readout=delayed, use_norm=use_norm)
    k, v = _kv(12, t=77, dtype=torch.bfloat16)  # 9 full chunks + a remainder of 5
    valid = None
    if padded:
        valid = torch.ones(2, 77, dtype=torch.bool)
        valid[1, :6] = False
    _compare_compiled(compiled, s, k, v, valid)


def test_scorer_with_compile_runs_the_compiled_function(monkeypatch):
    # pretend the CPU is a compile device (aot_eager backend): forward, backward, prefill + step as in eager
    monkeypatch.setattr(scorers_mod, "_COMPILE_DEVICES", ("cpu",))
    monkeypatch.setattr(scorers_mod, "_COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(scorers_mod, "_COMPILED", {})
    s = _mlstm(window=4, seed=13, chunk_size=8)
    eager = _mlstm(window=4, seed=13, chunk_size=8, compile=False)
    k, v = _kv(14, t=30)
    r = s(k, v)
    assert ("aot_eager", "default") in scorers_mod._COMPILED
    torch.testing.assert_close(r, eager(k, v), rtol=1e-5, atol=1e-5)
    r.square().sum().backward()
    eager(k, v).square().sum().backward()
    for (name, a), b in zip(s.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)
    # a compiled prefill continues into eager steps exactly as the eager prefill does
    scores, state = s.prefill(k[:, :, :20], v[:, :, :20])
    for t in range(20, 30):
        out, state = s.step(k[:, :, t], v[:, :, t], k[:, :, t - 4], v[:, :, t - 4], state)
        torch.testing.assert_close(out, r[:, :, t - 4], rtol=1e-5, atol=1e-5)
    # compile=False never compiles, nor does a call without autograd
    monkeypatch.setattr(scorers_mod, "_COMPILED", {})
    eager(k, v)
    with torch.no_grad():
        torch.testing.assert_close(s(k, v), r.detach(), rtol=1e-5, atol=1e-5)
    assert scorers_mod._COMPILED == {}


def _have_cxx() -> bool:
    import shutil

    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


@pytest.mark.slow
@pytest.mark.skipif(not _have_cxx(), reason="inductor on the CPU needs a C++ compiler")
def test_inductor_compiled_scores_equal_eager_on_cpu():
    """Inductor's CPU code for the scorer with its skip path, whose graph holds every operation of the scorer without
    one (one compile of about 40 s on CI's cores; the CUDA test compiles both forms)."""
    torch._dynamo.reset()  # mlstm_scores is compiled by other tests of this file: start below the recompile limit
    compiled = torch.compile(scorers_mod.mlstm_scores, dynamic=False, backend="inductor")
    s = _mlstm(window=5, seed=15, chunk_size=8, use_norm=True, skip=True)
    k, v = _kv(16, t=77, dtype=torch.bfloat16)
    _compare_compiled(compiled, s, k, v)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk,skip", [(32, False), (64, False), (128, False), (64, True)])
def test_compiled_scorer_on_cuda_equals_eager(chunk, skip):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    s = _mlstm(h=4, d=32, window=64, seed=17, chunk_size=chunk, skip=skip).cuda()
    eager = MLSTMScorer(4, 32, window=64, chunk_size=chunk, compile=False, skip=skip).cuda()
    eager.load_state_dict(s.state_dict())  # the same weights (the skip path's init draws from the global RNG)
    k, v = (x.cuda() for x in _kv(18, b=1, h=4, t=1000, d=32, dtype=torch.bfloat16))
    r, st = s.prefill(k, v)
    r_e, st_e = eager.prefill(k, v)
    torch.testing.assert_close(r, r_e, rtol=1e-5, atol=1e-5)
    for a, b in zip(st, st_e):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    r.square().mean().backward()
    r_e.square().mean().backward()
    for (name, a), b in zip(s.named_parameters(), eager.parameters()):
        assert ((a.grad - b.grad).abs().max() / b.grad.abs().max()).item() < 1e-4, name


def test_readout_inputs_are_the_delayed_readouts_and_chunking_keeps_them():
    """``read_key, read_value``: the delayed readout (query features and skip path) reads them, the memory is written
    from ``key, value``. Against a hand-built reference: the scores equal those of a scorer whose every input is the
    read form, except that the memory comes from the written form, which is checked by the state (equal to the
    plain run's) and by the scores moving; chunked ``continue_prefill`` with the chunks' read forms equals the full
    run; bad read inputs are one line."""
    s = _mlstm(window=5, seed=31, chunk_size=8, skip=True)
    k, v = _kv(32, t=60)
    rk, rv = k.round(decimals=1), v.round(decimals=1)  # a coarser "stored form" of the same tokens
    plain, st_plain = s._run(k, v)
    read, st_read = s._run(k, v, None, rk, rv)
    for a, b in zip(st_plain, st_read):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the memory is written from key/value alone
    assert (read - plain).abs().max() > 1e-3
    # reference: the readout of u at u + w is the plain readout of h_{u+w} with u's query features from the read form
    w_q, w_k, w_v, w_i, b_i, w_f, b_f, norm_w, a, b, sw1, sb1, sw2 = s.score_params()
    q_read = scorers_mod._project(scorers_mod._cat_kv(rk, rv), w_q, w_k, w_v, w_i, b_i, w_f, b_f, s.gate_softcap)[0]
    for u in (0, 7, 30, 54):
        _, st = s._run(k[:, :, :u + 6], v[:, :, :u + 6])  # the memory after token u + w
        h = scorers_mod.mlstm_readout_unchecked(q_read[:, :, u:u + 1], *st, s.eps)
        want = scorers_mod._score_head(h, a, b, norm_w, s.norm_eps)[..., 0] + scorers_mod._skip_score(
            scorers_mod._cat_kv(rk, rv)[:, :, u], sw1, sb1, sw2)
        torch.testing.assert_close(read[:, :, u], want, rtol=1e-5, atol=1e-5)
    # chunked: the past tokens read back in their read form, the chunk's given
    scores, past, state = s.continue_prefill(k[:, :, :23], v[:, :, :23], read_key=rk[:, :, :23], read_value=rv[:, :, :23])
    scores2, past2, _ = s.continue_prefill(k[:, :, 23:], v[:, :, 23:], None, state, rk[:, :, 18:23], rv[:, :, 18:23],
                                           rk[:, :, 23:], rv[:, :, 23:])
    torch.testing.assert_close(past2, read[:, :, 18:23], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(scores2[:, :, :-5], read[:, :, 23:-5], rtol=1e-5, atol=1e-5)
    with pytest.raises(KVLearnError, match="only one of read_key/read_value given"):
        s(k, v, read_key=rk)
    with pytest.raises(KVLearnError, match=r"read_key.shape=\(2, 2, 59, 8\) is invalid: expected the key's"):
        s(k, v, read_key=rk[:, :, 1:], read_value=rv[:, :, 1:])
    immediate = _mlstm(window=5, seed=31, chunk_size=8, delayed_readout=False)
    with pytest.raises(KVLearnError, match="read_key/read_value given with delayed_readout=False"):
        immediate(k, v, read_key=rk, read_value=rv)


def test_compile_mode_is_validated_and_reaches_the_scorer():
    """``compile_mode`` / ``KVpopConfig.mlstm_compile_mode``: one of ``COMPILE_MODES``, not with TF32 matmuls; the
    config's value is the built scorer's; on the CPU (no compiled path) both modes give the eager scores."""
    from kvlearn.config import KVpopConfig
    from kvlearn.kvpop.modules import KVpopModules

    assert KVpopConfig.COMPILE_MODES == scorers_mod.COMPILE_MODES  # the config's copy (config.py imports no scorer)
    with pytest.raises(KVLearnError, match="compile_mode='max' is unknown: expected one of default, reduce-overhead"):
        MLSTMScorer(2, 8, window=5, compile_mode="max")
    with pytest.raises(KVLearnError, match="with matmul_dtype='tf32' is not supported"):
        MLSTMScorer(2, 8, window=5, compile_mode="reduce-overhead", matmul_dtype="tf32")
    with pytest.raises(KVLearnError, match="mlstm_compile_mode='graphs' is unknown"):
        KVpopConfig(mlstm_compile_mode="graphs")
    with pytest.raises(KVLearnError, match="mlstm_compile_mode='reduce-overhead' with mlstm_matmul_dtype='tf32'"):
        KVpopConfig(mlstm_compile_mode="reduce-overhead", mlstm_matmul_dtype="tf32")
    mods = KVpopModules(KVpopConfig(window=5, topk=8, mlstm_compile_mode="reduce-overhead"), 2, 8)
    assert mods.scorer.compile_mode == "reduce-overhead"
    plain = MLSTMScorer(2, 8, window=5, skip=True)
    plain.load_state_dict(mods.scorer.state_dict())
    k, v = _kv(3, t=30)
    torch.testing.assert_close(mods.scorer(k, v), plain(k, v), rtol=0, atol=0)


@pytest.mark.gpu
def test_cudagraph_scorer_on_cuda_equals_default_compile_over_updates():
    """``compile_mode="reduce-overhead"`` (CUDA graphs, static buffers reused on every replay) against the default
    compile, through four training iterations: each call's scores and every parameter's gradient equal, and the
    parameters updated in place between calls (what the optimizer does), so a replay that read stale weights or
    returned a buffer the next replay overwrote would differ from the reference."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    ref = _mlstm(h=4, d=32, window=64, seed=29, chunk_size=64, skip=True).cuda()
    graphs = MLSTMScorer(4, 32, window=64, chunk_size=64, skip=True, compile_mode="reduce-overhead").cuda()
    graphs.load_state_dict(ref.state_dict())
    for it in range(4):
        k, v = (x.cuda() for x in _kv(40 + it, b=2, h=4, t=1024, d=32, dtype=torch.bfloat16))
        outs = []
        for s in (ref, graphs):
            r = s(k, v)
            (r.square().mean() + r[..., :100].mean()).backward()
            outs.append((r.detach().clone(), [p.grad.clone() for p in s.parameters()]))
        torch.testing.assert_close(outs[1][0], outs[0][0], rtol=1e-5, atol=1e-5)
        for (name, _), a, b in zip(ref.named_parameters(), outs[1][1], outs[0][1]):
            assert ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item() < 1e-4, (it, name)
        with torch.no_grad():
            for s in (ref, graphs):
                for p in s.parameters():
                    p.sub_(0.05 * p.grad.sign())
                    p.grad = None


# matmul_dtype of the mLSTM chunk matmuls (bounds measured in tests/ops/test_mlstm.py)


@pytest.mark.parametrize("matmul_dtype,skip", [("tf32", False), ("bfloat16", False), ("float32", True)])
def test_compiled_scores_with_reduced_precision_matmuls_trace_in_one_graph(matmul_dtype, skip):
    torch._dynamo.reset()  # mlstm_scores is compiled by other tests of this file: start below the recompile limit
    compiled = torch.compile(scorers_mod.mlstm_scores, dynamic=False, fullgraph=True, backend="aot_eager")
    s = _mlstm(window=5, seed=11, chunk_size=8, skip=skip)
    k, v = _kv(12, t=77)
    args = _scores_args(s, k, v) + (matmul_dtype,)
    got, want = compiled(*args), scorers_mod.mlstm_scores(*args)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_mlstm_scorer_bf16_matmuls_close_to_float32():
    k, v = _kv(21, t=150)
    out = {}
    for dtype in ("float32", "bfloat16"):
        s = _mlstm(window=5, seed=22, chunk_size=16, matmul_dtype=dtype)
        r = s(k, v)
        r.square().sum().backward()
        out[dtype] = (r.detach(), [p.grad for p in s.parameters()])
    (r0, g0), (r1, g1) = out["float32"], out["bfloat16"]
    err = ((r1 - r0).abs().max() / r0.abs().max()).item()
    assert 1e-5 < err < 1.5e-2, err  # nonzero (bf16 was used) and within the op's bound
    for a, b in zip(g1, g0):
        assert ((a - b).norm() / b.norm()).item() < 6e-2


def test_scorer_tf32_scope_covers_compiled_forward_and_backward(monkeypatch):
    # the compiled path with matmul_dtype="tf32" runs forward and backward inside tf32_matmuls() (CPU: aot_eager,
    # where TF32 changes nothing, so the results equal the eager float32 scorer's) and restores the setting
    monkeypatch.setattr(scorers_mod, "_COMPILE_DEVICES", ("cpu",))
    monkeypatch.setattr(scorers_mod, "_COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(scorers_mod, "_COMPILED", {})
    seen = []

    class Spy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            seen.append(("fwd", torch.backends.cuda.matmul.fp32_precision))
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            seen.append(("bwd", torch.backends.cuda.matmul.fp32_precision))
            return g

    real = scorers_mod._compiled_scores

    def spied(backend="inductor", mode="default"):
        fn = real(backend, mode)

        def run(*a):
            out = fn(*a)
            return (Spy.apply(out[0]), *out[1:])

        return run

    monkeypatch.setattr(scorers_mod, "_compiled_scores", spied)
    before = torch.backends.cuda.matmul.fp32_precision
    s = _mlstm(window=4, seed=13, chunk_size=8, matmul_dtype="tf32")
    eager = _mlstm(window=4, seed=13, chunk_size=8, compile=False)
    k, v = _kv(14, t=30)
    r = s(k, v)
    assert torch.backends.cuda.matmul.fp32_precision == before
    torch.testing.assert_close(r, eager(k, v), rtol=1e-5, atol=1e-5)
    r.square().sum().backward()
    eager(k, v).square().sum().backward()
    assert seen == [("fwd", "tf32"), ("bwd", "tf32")]
    assert torch.backends.cuda.matmul.fp32_precision == before
    for (name, a), b in zip(s.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_bad_matmul_dtype_in_scorer_and_config():
    from kvlearn.config import KVpopConfig
    from kvlearn.kvpop.modules import KVpopModules
    from kvlearn.ops.mlstm import MATMUL_DTYPES

    with pytest.raises(KVLearnError, match=r"^matmul_dtype='half' is unknown: expected one of float32, tf32, bfloat16$"):
        MLSTMScorer(2, 8, window=4, matmul_dtype="half")
    with pytest.raises(KVLearnError, match=r"^mlstm_matmul_dtype='bf16' is unknown: expected one of float32, tf32, bfloat16$"):
        KVpopConfig(mlstm_matmul_dtype="bf16")
    assert KVpopConfig.MATMUL_DTYPES == MATMUL_DTYPES
    assert KVpopConfig().mlstm_matmul_dtype == "float32"
    mods = KVpopModules(KVpopConfig(window=4, topk=8, mlstm_matmul_dtype="bfloat16"), 2, 8)
    assert mods.scorer.matmul_dtype == "bfloat16"


# ---------------------------------------------------------------------------------------------------------------
# per-head projections in token chunks (head_matmul): the einsum's products, a weight gradient batched over chunks


@pytest.mark.parametrize("shape,rows", [((2, 3, 7, 5), 4), ((2, 3, 12, 5), 4), ((2, 3, 3, 5), 4), ((2, 3, 5), 4),
                                        ((2, 3, 4, 6, 5), 5), ((1, 3, 40, 5), None)])
def test_head_matmul_equals_the_einsum_float64(shape, rows):
    """Values and gradients (input and weight) of :func:`head_matmul` / :func:`head_matvec` against the einsum in
    float64: rows fewer than a chunk, a multiple of it, a remainder, the decode step's [B, H, C], two token axes."""
    g = torch.Generator().manual_seed(len(shape) + (rows or 0))
    x = torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 5, 4, generator=g, dtype=torch.float64, requires_grad=True)
    a = torch.randn(3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    got = (scorers_mod.head_matmul(x, w, rows), scorers_mod.head_matvec(x, a, rows))
    want = (torch.einsum("bh...c,hcn->bh...n", x, w), torch.einsum("bh...c,hc->bh...", x, a))
    for y, ref in zip(got, want):
        assert y.shape == ref.shape
        torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    up = [torch.randn(y.shape, generator=g, dtype=torch.float64) for y in want]
    grads = torch.autograd.grad(got, (x, w, a), up)
    refs = torch.autograd.grad(want, (x, w, a), up)
    for gr, ref in zip(grads, refs):
        torch.testing.assert_close(gr, ref, rtol=1e-12, atol=1e-12)


def test_head_matmul_weight_gradient_is_batched_over_token_chunks():
    """The point of :func:`head_matmul`: no matmul of the backward reduces over more than ``rows`` tokens (the
    einsum's weight gradient is one reduction over all B * T tokens per head), and in float32 it matches the
    einsum's weight gradient to rounding."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Matmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.bmm.default, torch.ops.aten.mm.default):
                self.shapes.append((tuple(args[0].shape), tuple(args[1].shape)))
            return func(*args, **(kwargs or {}))

    x = torch.randn(2, 2, 100, 16)  # 3 chunks of 32 rows and a remainder of 4
    w = torch.randn(2, 16, 8, requires_grad=True)
    y = scorers_mod.head_matmul(x, w, rows=32)
    with Matmuls() as mode:
        (gw,) = torch.autograd.grad(y, w, torch.ones_like(y))
    assert mode.shapes and all(a[-1] <= 32 for a, _ in mode.shapes), mode.shapes  # [entries, C, rows] @ [.., rows, N]
    (ref,) = torch.autograd.grad(torch.einsum("bhtc,hcn->bhtn", x, w), w, torch.ones(2, 2, 100, 8))
    torch.testing.assert_close(gw, ref, rtol=1e-5, atol=1e-4)


def test_mlp_scorer_over_several_chunks_matches_the_float64_reference(monkeypatch):
    """The MLP scorer at more tokens than a chunk (here 8 rows a chunk, 2 x 29 tokens: chunks and a remainder):
    scores and parameter gradients of the float64 per-head reference."""
    monkeypatch.setattr(scorers_mod, "HEAD_MATMUL_ROWS", 8)
    s = _randomize(MLPScorer(3, 8, hidden=12, zero_init=False), 7)
    k, v = _kv(3, b=2, h=3, t=29)
    x = torch.cat([k, v], -1).double()
    p64 = {n: p.detach().double().requires_grad_() for n, p in s.named_parameters()}
    ref = torch.stack([F.silu(x[:, h] @ p64["w1"][h] + p64["b1"][h]) @ p64["w2"][h] + p64["b2"][h] for h in range(3)], 1)
    got = s(k, v)
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    weight = torch.linspace(-1, 1, got.numel()).view_as(got)
    grads = torch.autograd.grad((got * weight).sum(), list(s.parameters()))
    refs = torch.autograd.grad((ref * weight.double()).sum(), [p64[n] for n, _ in s.named_parameters()])
    for (name, _), a, b in zip(s.named_parameters(), grads, refs):
        torch.testing.assert_close(a.double(), b, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("skip", [False, True])
def test_compiled_scores_over_several_chunks_trace_in_one_graph(monkeypatch, skip):
    """The compiled mLSTM scorer with its projections split into token chunks (8 rows; 77 tokens: 9 chunks and a
    remainder) traces without graph breaks and equals the eager function (which the float64 references check)."""
    monkeypatch.setattr(scorers_mod, "HEAD_MATMUL_ROWS", 8)
    torch._dynamo.reset()  # mlstm_scores is compiled by other tests of this file: start below the recompile limit
    compiled = torch.compile(scorers_mod.mlstm_scores, dynamic=False, fullgraph=True, backend="aot_eager")
    s = _mlstm(window=5, seed=11, chunk_size=8, skip=skip)
    k, v = _kv(12, t=77)
    _compare_compiled(compiled, s, k, v)
    torch._dynamo.reset()


def test_mlstm_scores_over_several_chunks_match_bruteforce_float64(monkeypatch):
    """The float64 brute-force reference of the mLSTM scorer with the projections in chunks of 4 token rows."""
    monkeypatch.setattr(scorers_mod, "HEAD_MATMUL_ROWS", 4)
    s = _mlstm(window=3, seed=31, chunk_size=4, use_norm=True, skip=False)
    s.eps = 0.0
    k, v = _kv(32, b=1, t=13)
    assert torch.allclose(s(k, v).double(), _ref_mlstm_scores(s, k, v), rtol=1e-4, atol=1e-5)
