"""Future-attention target (transposed pass) against a dense float64 computation written out here."""

import math

import pytest
import torch

from kvlearn.errors import KVLearnError
from kvlearn.ops.future_target import causal_lse, future_attention_target


def _dense_logits(query, key, scale):
    """float64 logits ``[B, Hq, S(d), S(t)]`` with kv head ``i // G`` for query head ``i``."""
    g = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(g, dim=1)
    return query.double() @ k.transpose(-1, -2) * scale


def _dense_causal_lse(query, key, scale):
    logits = _dense_logits(query, key, scale)
    s = logits.shape[-1]
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    return logits.masked_fill(~causal, -math.inf).logsumexp(-1)


def _sparse_lse(query, key, scale, generator):
    """LSE over a random retention mask that always keeps the diagonal (Eq. 9 with a random M), float64."""
    logits = _dense_logits(query, key, scale)
    b, hq, s, _ = logits.shape
    keep = torch.rand(b, hq, s, s, generator=generator, dtype=torch.float64) < 0.4
    keep |= torch.eye(s, dtype=torch.bool)
    keep &= torch.ones(s, s, dtype=torch.bool).tril()
    return logits.masked_fill(~keep, -math.inf).logsumexp(-1)


def _dense_target(query, key, lse, window, eps, aggregation, count_normalize, scale):
    """Materialise P[d, t] = exp(ℓ(d, t) - LSE_d) in float64, sum over d >= t + w, / N_t, aggregate, log(eps + .)."""
    logits = _dense_logits(query, key, scale)
    b, hq, s, _ = logits.shape
    hkv = key.shape[1]
    prob = torch.exp(logits - lse.double()[..., None])  # [B, Hq, d, t]
    d = torch.arange(s)[:, None]
    t = torch.arange(s)[None, :]
    prob = prob * (d >= t + window)  # only future queries after the window (this also implies causality)
    mass = prob.sum(dim=-2)  # [B, Hq, t]
    if count_normalize:
        count = torch.clamp(s - (torch.arange(s) + window), min=1).double()
        mass = mass / count
    grouped = mass.reshape(b, hkv, hq // hkv, s)
    agg = grouped.amax(2) if aggregation == "max" else grouped.mean(2)
    return torch.log(eps + agg)


CASES = [
    # (B, Hq, Hkv, S, D, window)
    (1, 2, 2, 17, 8, 1),  # MHA, window 1
    (2, 4, 2, 37, 16, 5),  # GQA 2 kv heads x 2 query heads
    (1, 6, 2, 50, 8, 30),  # GQA 2 x 3, window > S / 2
    (2, 3, 1, 131, 16, 7),  # one kv head x 3, S not a multiple of 128 (crosses a block)
]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("case", CASES)
def test_causal_lse_matches_dense(case, seed):
    b, hq, hkv, s, d, _ = case
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, s, d, generator=g)
    k = torch.randn(b, hkv, s, d, generator=g)
    ref = _dense_causal_lse(q, k, 1 / math.sqrt(d))
    for backend in ("torch", "flex"):
        got = causal_lse(q, k, backend=backend)
        assert got.dtype == torch.float32 and got.shape == (b, hq, s)
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("lse_kind", ["dense", "sparse"])
@pytest.mark.parametrize("case", CASES)
def test_target_matches_dense_reference(case, lse_kind):
    b, hq, hkv, s, d, window = case
    for seed in (0, 1):
        g = torch.Generator().manual_seed(100 + seed)
        q = torch.randn(b, hq, s, d, generator=g) * 1.5
        k = torch.randn(b, hkv, s, d, generator=g)
        scale = 1 / math.sqrt(d) if seed == 0 else 0.3
        if lse_kind == "dense":
            lse64 = _dense_causal_lse(q, k, scale)
        else:
            lse64 = _sparse_lse(q, k, scale, g)
        lse = lse64.float()
        for aggregation in ("max", "mean"):
            for count_normalize in (True, False):
                eps = 1e-6 if count_normalize else 1e-3
                ref = _dense_target(q, k, lse, window, eps, aggregation, count_normalize, scale)
                for backend in ("torch", "flex"):
                    got = future_attention_target(q, k, lse, window, eps=eps, aggregation=aggregation,
                                                  count_normalize=count_normalize, scale=scale, backend=backend)
                    assert got.dtype == torch.float32 and got.shape == (b, hkv, s)
                    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5,
                                               msg=f"{backend} {aggregation} norm={count_normalize}")


def test_tokens_without_future_query_get_log_eps_and_sparse_differs_from_dense():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, 40, 8, generator=g)
    k = torch.randn(1, 2, 40, 8, generator=g)
    dense = causal_lse(q, k)
    r = future_attention_target(q, k, dense, window=10, eps=1e-4)
    torch.testing.assert_close(r[..., 30:], torch.full((1, 2, 10), math.log(1e-4)))
    assert (r[..., :30] > math.log(1e-4)).all()
    # the sparse normaliser is smaller, so the approximate target is larger
    sparse = _sparse_lse(q, k, 1 / math.sqrt(8), g).float()
    assert (sparse <= dense + 1e-5).all()
    r_sparse = future_attention_target(q, k, sparse, window=10, eps=1e-4)
    assert (r_sparse[..., :30] >= r[..., :30] - 1e-5).all() and (r_sparse[..., :30] > r[..., :30] + 1e-3).any()


def test_max_aggregation_equals_max_of_per_head_logs():
    """log(eps + max_g m) == max_g log(eps + m): eps placement does not matter for max (see notes)."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 30, 8, generator=g)
    k = torch.randn(1, 2, 30, 8, generator=g)
    lse = causal_lse(q, k)
    r = future_attention_target(q, k, lse, 3)
    per_head = torch.stack([future_attention_target(q[:, i:i + 1], k[:, i // 2:i // 2 + 1], lse[:, i:i + 1], 3)
                            for i in range(4)], dim=1)[:, :, 0]  # [1, 4, 30]
    torch.testing.assert_close(r, per_head.reshape(1, 2, 2, 30).amax(2))


def test_validation_errors():
    q = torch.randn(1, 4, 10, 8)
    k = torch.randn(1, 2, 10, 8)
    lse = causal_lse(q, k)
    bad = [
        (dict(window=0), "window=0"),
        (dict(eps=0.0), "eps=0.0"),
        (dict(aggregation="sum"), "aggregation='sum'"),
        (dict(backend="cuda"), "backend='cuda'"),
        (dict(lse=lse.double()), "lse dtype"),
        (dict(lse=lse[:, :2]), "lse shape"),
        (dict(key=torch.randn(1, 3, 10, 8)), "q_heads=4"),
        (dict(key=torch.randn(1, 2, 11, 8)), "key shape"),
        (dict(scale=-1.0), "scale=-1.0"),
    ]
    for override, needle in bad:
        kwargs = dict(query=q, key=k, lse=lse, window=2)
        kwargs.update(override)
        with pytest.raises(KVLearnError, match=needle.replace("(", r"\(").replace("[", r"\[")) as err:
            future_attention_target(**kwargs)
        assert "\n" not in str(err.value)
    with pytest.raises(KVLearnError, match="query shape"):
        causal_lse(torch.randn(4, 10, 8), k)


@pytest.mark.gpu
def test_cuda_compiled_path_matches_dense_reference():
    pytest.importorskip("triton")
    torch.manual_seed(0)
    b, hq, hkv, s, d, window = 2, 4, 2, 1024, 64, 64
    q = torch.randn(b, hq, s, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(b, hkv, s, d, device="cuda", dtype=torch.bfloat16)
    lse = causal_lse(q, k)  # compiled flex on CUDA
    ref_lse = _dense_causal_lse(q.float().cpu(), k.float().cpu(), 1 / math.sqrt(d))
    torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=2e-3, rtol=0)
    for aggregation in ("max", "mean"):
        got = future_attention_target(q, k, lse, window, aggregation=aggregation)
        assert got.dtype == torch.float32 and got.is_cuda
        ref = _dense_target(q.float().cpu(), k.float().cpu(), lse.cpu(), window, 1e-6, aggregation, True,
                            1 / math.sqrt(d))
        torch.testing.assert_close(got.double().cpu(), ref, atol=2e-3, rtol=1e-3)
        # the chunked torch backend on the GPU agrees too
        alt = future_attention_target(q, k, lse, window, aggregation=aggregation, backend="torch")
        torch.testing.assert_close(alt, got, atol=2e-3, rtol=1e-3)


@pytest.mark.parametrize("lookahead", [0, 3, 20, 500])
@pytest.mark.parametrize("backend", ["torch", "flex"])
def test_finite_lookahead_matches_dense_band(lookahead, backend):
    """Appendix B.2: only queries t + w <= d <= t + w + L count, and N_t is clipped to L + 1."""
    g = torch.Generator().manual_seed(7)
    b, hq, hkv, s, d, w = 2, 4, 2, 70, 16, 6
    q = torch.randn(b, hq, s, d, generator=g)
    k = torch.randn(b, hkv, s, d, generator=g)
    scale = 1 / math.sqrt(d)
    lse = _dense_causal_lse(q, k, scale).float()
    logits = _dense_logits(q, k, scale)
    prob = torch.exp(logits - lse.double()[..., None])
    dd = torch.arange(s)[:, None]
    tt = torch.arange(s)[None, :]
    prob = prob * ((dd >= tt + w) & (dd <= tt + w + lookahead))
    count = torch.clamp(torch.clamp(s - (torch.arange(s) + w), min=1), max=lookahead + 1).double()
    mass = (prob.sum(dim=-2) / count).reshape(b, hkv, hq // hkv, s).amax(2)
    ref = torch.log(1e-6 + mass)
    got = future_attention_target(q, k, lse, w, eps=1e-6, backend=backend, lookahead=lookahead)
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


def test_lookahead_validation():
    q, k = torch.randn(1, 2, 8, 4), torch.randn(1, 1, 8, 4)
    with pytest.raises(KVLearnError, match="lookahead=-1 is invalid"):
        future_attention_target(q, k, torch.zeros(1, 2, 8), 2, lookahead=-1)


def _dense_peak_target(query, key, lse, window, eps, aggregation, scale, lookahead=None):
    """float64 ``log(eps + Agg_g max_{d in D_t} P[d, t])`` written out (``reduction="peak"``; no count)."""
    logits = _dense_logits(query, key, scale)
    b, hq, s, _ = logits.shape
    prob = torch.exp(logits - lse.double()[..., None])
    d = torch.arange(s)[:, None]
    t = torch.arange(s)[None, :]
    keep = d >= t + window
    if lookahead is not None:
        keep &= d <= t + window + lookahead
    peak = (prob * keep).amax(dim=-2).reshape(b, key.shape[1], hq // key.shape[1], s)
    agg = peak.amax(2) if aggregation == "max" else peak.mean(2)
    return torch.log(eps + agg)


@pytest.mark.parametrize("aggregation", ["max", "mean"])
@pytest.mark.parametrize("lookahead", [None, 6])
@pytest.mark.parametrize("case", CASES)
def test_peak_reduction_matches_dense_reference(case, aggregation, lookahead):
    """``reduction="peak"``: the largest future probability per query head, aggregated, on dense and sparse
    normalisers; the count normalisation does not apply (same result with it on or off)."""
    b, hq, hkv, s, d, w = case
    g = torch.Generator().manual_seed(7)
    q, k = torch.randn(b, hq, s, d, generator=g), torch.randn(b, hkv, s, d, generator=g)
    scale = 1 / math.sqrt(d)
    for lse in (causal_lse(q, k), _sparse_lse(q, k, scale, g).float()):
        want = _dense_peak_target(q, k, lse, w, 1e-6, aggregation, scale, lookahead)
        for count in (True, False):
            got = future_attention_target(q, k, lse, w, aggregation=aggregation, count_normalize=count,
                                          reduction="peak", lookahead=lookahead)
            torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_peak_and_mass_on_a_hand_computed_case():
    """Every logit and normaliser 0, so every term exp(0 - 0) is 1: the peak is log 1 = 0 and the mass log N_t with
    N_t = S - (t + w) future queries; tokens with none are -inf (the torch backend's reduction itself)."""
    import kvlearn.ops.future_target as ft

    s, w = 12, 2
    q = torch.zeros(1, 1, s, 4)
    k = torch.zeros(1, 1, s, 4)
    lse = torch.zeros(1, 1, s)
    peak = ft._future_log_mass_torch(q, k, lse, w, 1.0, peak=True)
    mass = ft._future_log_mass_torch(q, k, lse, w, 1.0)
    # every logit is 0 and every normaliser 0: each term is exp(0) = 1, so peak = log 1 = 0 and mass = log N_t
    pos = torch.arange(s)
    n = (s - (pos + w)).clamp(min=0)
    has = n > 0
    torch.testing.assert_close(peak[0, 0][has], torch.zeros(int(has.sum())))
    torch.testing.assert_close(mass[0, 0][has], torch.log(n[has].float()))
    assert torch.isinf(peak[0, 0][~has]).all()


def test_peak_validation():
    q, k = torch.randn(1, 4, 10, 8), torch.randn(1, 2, 10, 8)
    lse = causal_lse(q, k)
    with pytest.raises(KVLearnError, match="reduction='sum' is unknown") as err:
        future_attention_target(q, k, lse, 2, reduction="sum")
    assert "\n" not in str(err.value)
    with pytest.raises(KVLearnError, match="reduction='peak' is invalid with backend='flex'") as err:
        future_attention_target(q, k, lse, 2, reduction="peak", backend="flex")
    assert "\n" not in str(err.value)
