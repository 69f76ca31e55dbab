"""Fused Triton transposed pass (``future_attention_target(backend="triton")``) against float64 written out here.

The kernel runs in Triton's CPU interpreter (``TRITON_INTERPRET=1`` must be set before triton is imported, so the
cases run in one subprocess); the ``gpu`` tests run it compiled on CUDA.
"""

import math
import textwrap

import pytest
import torch

from kvlearn.errors import KVLearnError
from kvlearn.ops.future_target import future_attention_target

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def band_logits(query, key, lse, window, scale, lookahead=None):
    """float64 ``ℓ(d, t) - lse_d`` ``[B, Hq, d, t]`` (query head ``i`` reads KV head ``i // G``), ``-inf`` outside
    the band ``t + w <= d (<= t + w + L)``."""
    g = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(g, dim=1)
    logits = query.double() @ k.transpose(-1, -2) * scale - lse.double()[..., None]  # [B, Hq, d, t]
    s = logits.shape[-1]
    d = torch.arange(s)[:, None]
    t = torch.arange(s)[None, :]
    keep = d >= t + window
    if lookahead is not None:
        keep &= d <= t + window + lookahead
    return logits.masked_fill(~keep, -math.inf)


def dense_log_mass(query, key, lse, window, scale, lookahead=None):
    """float64 ``log m̄ [B, Hq, S]``: logsumexp over the band, ``-inf`` where it is empty."""
    return band_logits(query, key, lse, window, scale, lookahead).logsumexp(dim=-2)


def dense_log_peak(query, key, lse, window, scale, lookahead=None):
    """float64 ``max`` over the same band (``reduction="peak"``), ``-inf`` where it is empty."""
    return band_logits(query, key, lse, window, scale, lookahead).amax(dim=-2)


def dense_target(log_mass, hkv, window, eps, aggregation, lookahead=None):
    """``log(eps + Agg_g m / N_t)`` from float64 ``log m̄`` (count normalisation on)."""
    b, hq, s = log_mass.shape
    count = torch.clamp(s - (torch.arange(s) + window), min=1)
    if lookahead is not None:
        count = count.clamp(max=lookahead + 1)
    mass = (log_mass.exp() / count.double()).reshape(b, hkv, hq // hkv, s)
    agg = mass.amax(2) if aggregation == "max" else mass.mean(2)
    return torch.log(eps + agg)


def make_inputs(seed, B, Hq, Hkv, S, D, lse_kind, dtype="fp32", device="cpu"):
    """q, k in ``dtype`` and a float32 lse: the dense causal one, a sparse one (a random retention mask keeping
    the diagonal: ``ℓ - lse`` can be > 0), or the dense one minus 150 (scores up to ~e^150: overflows float32
    unless the kernel keeps a running max)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(B, Hq, S, D, generator=g) * 1.5).to(_DTYPES[dtype])
    k = torch.randn(B, Hkv, S, D, generator=g).to(_DTYPES[dtype])
    scale = 1 / math.sqrt(D)
    logits = q.double() @ k.double().repeat_interleave(Hq // Hkv, dim=1).transpose(-1, -2) * scale
    keep = torch.ones(S, S, dtype=torch.bool).tril().expand(B, Hq, S, S)
    if lse_kind == "sparse":
        keep = keep & ((torch.rand(B, Hq, S, S, generator=g, dtype=torch.float64) < 0.3) | torch.eye(S, dtype=torch.bool))
    lse = logits.masked_fill(~keep, -math.inf).logsumexp(-1)
    if lse_kind == "shifted":
        lse = lse - 150.0
    return q.to(device), k.to(device), lse.float().to(device), scale


# name: (seed, B, Hq, Hkv, S, D, window, lookahead, lse kind, dtype, kernel_options)
INTERP_CASES = {
    # ragged S, masked band-start tiles, full tiles, a masked last tile
    "g2_dense": (0, 1, 4, 2, 75, 16, 5, None, "dense", "fp32", {"block_t": 16, "block_d": 16}),
    # G = 3, sparse lse (scores above the normaliser), query tiles wider than key tiles
    "g3_sparse": (1, 2, 6, 2, 70, 16, 3, None, "sparse", "fp32", {"block_t": 16, "block_d": 32}),
    "mha_window1": (2, 1, 2, 2, 40, 16, 1, None, "dense", "fp32", {"block_t": 16, "block_d": 16}),
    # the lookahead band narrower than a key tile (no full tile), wider (full tiles between two masked edges), zero
    "lookahead3": (3, 1, 4, 2, 80, 16, 4, 3, "dense", "fp32", {"block_t": 16, "block_d": 16}),
    "lookahead40": (4, 1, 4, 2, 100, 16, 4, 40, "sparse", "fp32", {"block_t": 16, "block_d": 16}),
    "lookahead0": (5, 1, 4, 2, 50, 16, 2, 0, "dense", "fp32", {"block_t": 16, "block_d": 16}),
    "window_ge_S": (6, 1, 4, 2, 30, 16, 40, None, "dense", "fp32", {"block_t": 16, "block_d": 16}),
    "shorter_than_tile": (7, 1, 4, 2, 10, 16, 2, None, "dense", "fp32", {"block_t": 16, "block_d": 16}),
    "shifted_lse": (8, 1, 4, 2, 60, 16, 4, None, "shifted", "fp32", {"block_t": 16, "block_d": 16}),
    # q/k/lse as [batch, seq, heads, ...] memory viewed as [batch, heads, seq, ...] (strided heads)
    "seq_major_inputs": (9, 2, 4, 2, 50, 16, 3, None, "dense", "fp32", {"block_t": 16, "block_d": 16, "seq_major": True}),
    # the default launch shape (128 keys x 64 queries), bf16 and fp16
    "bf16_default": (10, 1, 4, 2, 200, 32, 8, None, "sparse", "bf16", {}),
    "fp16_lookahead": (11, 1, 4, 2, 150, 32, 8, 70, "dense", "fp16", {}),
}
TOLERANCES = {"fp32": 2e-4, "bf16": 2e-3, "fp16": 2e-3}  # on log values, atol and rtol, against float64


def run_case(name, device="cpu"):
    """Kernel vs float64 reference: per-head ``log m̄`` and the aggregated targets (max and mean) within
    tolerance, the same ``-inf`` pattern, and the largest error."""
    from kvlearn.ops.future_target_triton import future_log_mass_triton

    seed, B, Hq, Hkv, S, D, window, look, lse_kind, dtype, options = INTERP_CASES[name]
    q, k, lse, scale = make_inputs(seed, B, Hq, Hkv, S, D, lse_kind, dtype, device)
    options = dict(options)
    if options.pop("seq_major", False):
        q, k, lse = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, lse))
        assert not q.is_contiguous() and not lse.is_contiguous()
    ref = dense_log_mass(q.cpu(), k.cpu(), lse.cpu(), window, scale, look)
    got = future_log_mass_triton(q, k, lse, window, scale, look, **options).cpu().double()
    tol = TOLERANCES[dtype]
    finite = torch.isfinite(ref)
    same_inf = bool((torch.isfinite(got) == finite).all())
    err = (got[finite] - ref[finite]).abs().max().item() if finite.any() else 0.0
    ok = same_inf and torch.allclose(got[finite], ref[finite], atol=tol, rtol=tol)
    peak_ref = dense_log_peak(q.cpu(), k.cpu(), lse.cpu(), window, scale, look)
    peak = future_log_mass_triton(q, k, lse, window, scale, look, peak=True, **options).cpu().double()
    peak_ok = bool((torch.isfinite(peak) == finite).all()) and torch.allclose(
        peak[finite], peak_ref[finite], atol=tol, rtol=tol)
    targets_ok = True
    for aggregation in ("max", "mean"):
        tgt = future_attention_target(q, k, lse, window, aggregation=aggregation, scale=scale, backend="triton",
                                      lookahead=look, kernel_options=options or None)
        want = dense_target(ref, Hkv, window, 1e-6, aggregation, look)
        targets_ok &= tgt.shape == (B, Hkv, S) and torch.allclose(tgt.cpu().double(), want, atol=tol, rtol=tol)
    return {"ok": bool(ok), "same_inf": same_inf, "err": err, "targets_ok": bool(targets_ok), "peak_ok": bool(peak_ok),
            "n_finite": int(finite.sum()), "n_inf": int((~finite).sum()), "max_ref": ref[finite].max().item()
            if finite.any() else None}


@pytest.mark.parametrize("name", list(INTERP_CASES))
def test_interpreter_matches_dense_float64(interpreter_results, name):
    res = interpreter_results[name]
    assert res["ok"] and res["targets_ok"] and res["peak_ok"], res


def test_cases_reach_what_they_claim(interpreter_results):
    """Empty bands exist where they should (and only there), and the shifted case really needs the running max."""
    assert interpreter_results["window_ge_S"]["n_finite"] == 0
    assert interpreter_results["g2_dense"]["n_inf"] == 5 * 4  # the last w keys of each of 4 heads
    assert interpreter_results["shifted_lse"]["max_ref"] > 100  # e^100 overflows float32 without a running max


def test_bad_inputs_raise_one_line_errors():
    q, k, lse, _ = make_inputs(0, 1, 4, 2, 20, 16, "dense")
    cases = [
        (dict(backend="triton"), "device cpu is invalid for backend='triton'"),
        (dict(backend="triton", kernel_options={"BLOCK_M": 64}), r"key\(s\) \['BLOCK_M'\] are invalid for backend='triton'"),
        (dict(backend="flex", kernel_options={"block_t": 64}), "block_t"),
    ]
    for kwargs, match in cases:
        with pytest.raises(KVLearnError, match=match) as err:
            future_attention_target(q, k, lse, 3, **kwargs)
        assert "\n" not in str(err.value)


def test_bad_tunables_raise_one_line_errors(run_in_triton_interpreter):
    script = textwrap.dedent(
        """
        import torch
        from kvlearn.errors import KVLearnError
        from kvlearn.ops.future_target_triton import future_log_mass_triton
        q, k, lse = torch.randn(1, 4, 20, 16), torch.randn(1, 2, 20, 16), torch.zeros(1, 4, 20)
        for kw, want in [(dict(block_t=48), "block_t=48 is invalid"), (dict(block_d=8), "block_d=8 is invalid"),
                         (dict(num_warps=3), "num_warps=3 is invalid"), (dict(num_stages=0), "num_stages=0 is invalid"),
                         (dict(fp32_precision="tf64"), "fp32_precision='tf64' is invalid")]:
            try:
                future_log_mass_triton(q, k, lse, 2, 0.25, **kw)
            except KVLearnError as e:
                assert want in str(e) and "\\n" not in str(e), str(e)
            else:
                raise AssertionError(kw)
        try:
            future_log_mass_triton(q.to(torch.float64), k.to(torch.float64), lse, 2, 0.25)
        except KVLearnError as e:
            assert "dtype torch.float64 is invalid for the Triton kernel" in str(e), str(e)
        else:
            raise AssertionError("float64")
        print("OK")
        """
    )
    assert "OK" in run_in_triton_interpreter(script)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["g3_sparse", "lookahead40", "shifted_lse", "bf16_default", "fp16_lookahead"])
def test_cuda_matches_dense_float64(name):
    res = run_case(name, device="cuda")
    assert res["ok"] and res["targets_ok"] and res["peak_ok"], res


@pytest.mark.gpu
@pytest.mark.parametrize("lookahead", [None, 300])
def test_cuda_default_backend_is_triton_and_agrees_with_flex(lookahead):
    """At a realistic size (bf16, G = 4, head_dim 128) the default CUDA backend equals flex to bf16 accuracy."""
    torch.manual_seed(0)
    q = torch.randn(1, 8, 2048, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 2048, 128, device="cuda", dtype=torch.bfloat16)
    lse = torch.randn(1, 8, 2048, device="cuda") + 6.0
    auto = future_attention_target(q, k, lse, 64, lookahead=lookahead)
    tri = future_attention_target(q, k, lse, 64, lookahead=lookahead, backend="triton")
    flex = future_attention_target(q, k, lse, 64, lookahead=lookahead, backend="flex")
    torch.testing.assert_close(auto, tri, atol=0, rtol=0)
    torch.testing.assert_close(tri, flex, atol=2e-3, rtol=2e-3)


def test_auto_takes_triton_only_for_inputs_the_kernel_supports(monkeypatch):
    """On CUDA "auto" must fall back to flex for what the kernel refuses (float64, odd head_dim, mixed dtypes,
    flex options): the decision ``future_attention_target`` hands to the backend resolution, recorded here."""
    import kvlearn.ops.future_target as ft
    from kvlearn.ops.triton_support import HAS_TRITON

    seen = []

    def record(backend, device, *, triton_ok=False):
        seen.append(triton_ok)
        return "torch"  # run the CPU backend whatever was decided

    monkeypatch.setattr(ft, "resolve_backend", record)
    lse = torch.zeros(1, 4, 20)
    cases = [
        (torch.randn(1, 4, 20, 16, dtype=torch.bfloat16), torch.randn(1, 2, 20, 16, dtype=torch.bfloat16), None, True),
        (torch.randn(1, 4, 20, 16, dtype=torch.bfloat16), torch.randn(1, 2, 20, 16, dtype=torch.bfloat16), {}, True),
        (torch.randn(1, 4, 20, 16, dtype=torch.float64), torch.randn(1, 2, 20, 16, dtype=torch.float64), None, False),
        (torch.randn(1, 4, 20, 24), torch.randn(1, 2, 20, 24), None, False),
        (torch.randn(1, 4, 20, 16, dtype=torch.bfloat16), torch.randn(1, 2, 20, 16), None, False),
        (torch.randn(1, 4, 20, 16), torch.randn(1, 2, 20, 16), {"BLOCK_M": 64}, False),
    ]
    for q, k, options, want in cases:
        future_attention_target(q, k, lse, 3, kernel_options=options)
        assert seen[-1] is want, (q.dtype, k.dtype, q.shape[-1], options)
    monkeypatch.undo()
    from kvlearn.ops.triton_support import kernel_supports  # the rule both "auto" backends (target, attention) use

    assert kernel_supports(torch.bfloat16, 128) and kernel_supports(torch.float16, 64) and kernel_supports(torch.float32, 16)
    assert not any(kernel_supports(dt, d) for dt, d in ((torch.float64, 128), (torch.bfloat16, 96), (torch.bfloat16, 8),
                                                        (torch.bfloat16, 512), (torch.int32, 128)))
    cuda = torch.device("cuda")
    assert ft.resolve_backend("auto", cuda, triton_ok=True) == ("triton" if HAS_TRITON else "flex")
    assert ft.resolve_backend("auto", cuda, triton_ok=False) == "flex"
    assert ft.resolve_backend("auto", torch.device("cpu"), triton_ok=True) == "torch"
