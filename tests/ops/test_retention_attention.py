"""KVpop sparse attention vs a dense masked softmax in float64 (output, natural-log LSE, gradients), with GQA,
on both layouts (the interval-gathered default and the [T, T] block mask)."""

import math

import pytest
import torch

from kvlearn.errors import KVLearnError
from kvlearn.ops.retention_attention import (
    block_sparsity,
    gathered_plan,
    gathered_tile_fraction,
    sparse_retention_attention,
)
from kvlearn.ops.fenwick import running_topk_cutoff
from kvlearn.ops.future_target import future_attention_target
from kvlearn.ops.masks import retention_block_mask, retention_mask_dense


def make_inputs(seed, B, Hkv, G, T, D, sinks, window, topk, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv * G, T, D, generator=g).to(device, dtype)
    k = torch.randn(B, Hkv, T, D, generator=g).to(device, dtype)
    v = torch.randn(B, Hkv, T, D, generator=g).to(device, dtype)
    priorities = torch.randn(B, Hkv, T, generator=g).to(device)
    ranks, cutoffs = running_topk_cutoff(priorities, sinks, window, topk)
    return q, k, v, ranks, cutoffs


def dense_reference(q, k, v, ranks, cutoffs, sinks, window, scale=None):
    """float64 masked softmax; query head h reads KV head h // G."""
    G = q.shape[1] // k.shape[1]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    mask = retention_mask_dense(ranks.cpu(), cutoffs.cpu(), sinks, window).repeat_interleave(G, dim=1)
    kd = k.double().repeat_interleave(G, dim=1)
    vd = v.double().repeat_interleave(G, dim=1)
    logits = (q.double() @ kd.transpose(-1, -2)) * scale
    logits = logits.masked_fill(~mask.to(q.device), -math.inf)
    lse = torch.logsumexp(logits, dim=-1)
    return torch.softmax(logits, dim=-1) @ vd, lse


CASES = [
    # seed, B, Hkv, G, T, D, sinks, window, topk
    (0, 2, 2, 2, 96, 16, 4, 8, 16),
    (1, 1, 2, 2, 200, 8, 2, 16, 24),
    (2, 2, 2, 2, 64, 16, 0, 1, 5),
]


@pytest.mark.parametrize("layout", ["gathered", "blockmask"])
@pytest.mark.parametrize("case", CASES, ids=[f"seed{c[0]}" for c in CASES])
def test_flex_output_and_lse_match_dense_float64(case, layout):
    seed, B, Hkv, G, T, D, sinks, window, topk = case
    q, k, v, ranks, cutoffs = make_inputs(seed, B, Hkv, G, T, D, sinks, window, topk)
    with torch.no_grad():  # eager flex path (CPU flex has no backward)
        out, lse = sparse_retention_attention(q, k, v, ranks, cutoffs, sinks, window, layout=layout)
    ref_out, ref_lse = dense_reference(q, k, v, ranks, cutoffs, sinks, window)
    assert out.shape == q.shape and out.dtype == torch.float32
    assert lse.shape == q.shape[:3] and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)  # natural log, not log2


def test_custom_scale_and_no_lse():
    q, k, v, ranks, cutoffs = make_inputs(3, 1, 2, 2, 80, 16, 2, 8, 10)
    with torch.no_grad():
        out, lse = sparse_retention_attention(q, k, v, ranks, cutoffs, 2, 8, scale=0.7, return_lse=False)
    ref_out, _ = dense_reference(q, k, v, ranks, cutoffs, 2, 8, scale=0.7)
    assert lse is None
    torch.testing.assert_close(out.double(), ref_out, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("layout", ["gathered", "blockmask"])
@pytest.mark.parametrize("case", CASES[:2], ids=[f"seed{c[0]}" for c in CASES[:2]])
def test_gradients_match_dense_float64(case, layout):
    seed, B, Hkv, G, T, D, sinks, window, topk = case
    q, k, v, ranks, cutoffs = make_inputs(seed, B, Hkv, G, T, D, sinks, window, topk)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    g = torch.Generator().manual_seed(seed + 100)
    grad_out = torch.randn(q.shape, generator=g)
    grad_lse = torch.randn(q.shape[:3], generator=g)
    out, lse = sparse_retention_attention(*leaves, ranks, cutoffs, sinks, window, layout=layout)
    ref_out, ref_lse = dense_reference(*ref_leaves, ranks, cutoffs, sinks, window)
    torch.testing.assert_close(out.double(), ref_out.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), atol=1e-5, rtol=1e-5)
    ((out * grad_out).sum() + (lse * grad_lse).sum()).backward()
    ((ref_out * grad_out.double()).sum() + (ref_lse * grad_lse.double()).sum()).backward()
    for got, ref in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad.double(), ref.grad, atol=1e-5, rtol=1e-5)


def test_block_sparsity_counts_skipped_tiles():
    B, Hkv, G, T, sinks, window, topk = 1, 2, 2, 128, 2, 8, 8
    _, _, _, ranks, cutoffs = make_inputs(4, B, Hkv, G, T, 8, sinks, window, topk)
    bm = retention_block_mask(ranks, cutoffs, sinks, window, G, block_size=16)
    dense = retention_mask_dense(ranks, cutoffs, sinks, window)
    tiles = dense.reshape(B, Hkv, T // 16, 16, T // 16, 16).any(dim=(3, 5))
    expected = 1.0 - tiles.float().mean().item()
    assert block_sparsity(bm) == pytest.approx(expected, abs=1e-9)
    assert 0.3 < block_sparsity(bm) < 1.0  # causal alone would skip 7/16 of the tiles; the budget skips more


def test_attention_bad_inputs_raise():
    q, k, v, ranks, cutoffs = make_inputs(5, 1, 2, 2, 32, 8, 1, 4, 4)
    with pytest.raises(KVLearnError, match="kv_heads=2"):
        sparse_retention_attention(q[:, :3], k, v, ranks, cutoffs, 1, 4)
    with pytest.raises(KVLearnError, match="ranks with shape"):
        sparse_retention_attention(q, k, v, ranks[:, :1], cutoffs, 1, 4)
    with pytest.raises(KVLearnError, match="value shape"):
        sparse_retention_attention(q, k, v[..., :4], ranks, cutoffs, 1, 4)
    with pytest.raises(KVLearnError, match="query with shape"):
        sparse_retention_attention(q[0], k, v, ranks, cutoffs, 1, 4)
    with pytest.raises(KVLearnError, match="zero window"):
        sparse_retention_attention(q, k, v, ranks, cutoffs, 1, 0)
    with pytest.raises(KVLearnError, match="block_mask"):
        block_sparsity("not a mask")
    with pytest.raises(KVLearnError, match="layout='dense' is invalid"):
        sparse_retention_attention(q, k, v, ranks, cutoffs, 1, 4, layout="dense")
    with pytest.raises(KVLearnError, match="block_mask is invalid with layout='gathered'"):
        sparse_retention_attention(q, k, v, ranks, cutoffs, 1, 4, block_mask=retention_block_mask(ranks, cutoffs, 1, 4, 2))
    with pytest.raises(KVLearnError, match="topk=-2"):
        sparse_retention_attention(q, k, v, ranks, cutoffs, 1, 4, topk=-2)
    with pytest.raises(KVLearnError, match="block_size=0"):
        sparse_retention_attention(q, k, v, ranks, cutoffs, 1, 4, block_size=0)
    plan = gathered_plan(ranks, cutoffs, 1, 4, 2, topk=4, block_size=8)
    with pytest.raises(KVLearnError, match="plan is invalid with layout='blockmask'"):
        sparse_retention_attention(q, k, v, ranks, cutoffs, 1, 4, layout="blockmask", plan=plan)
    with pytest.raises(KVLearnError, match="plan for"):
        sparse_retention_attention(q[:, :2], k[:, :1], v[:, :1], ranks[:, :1], cutoffs[:, :1], 1, 4, plan=plan)
    with pytest.raises(KVLearnError, match="plan of type"):
        sparse_retention_attention(q, k, v, ranks, cutoffs, 1, 4, plan="plan")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["gathered", "blockmask"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_flex_on_cuda_matches_dense(dtype, layout):
    pytest.importorskip("triton")
    B, Hkv, G, T, D, sinks, window, topk = 2, 2, 2, 1024, 64, 4, 64, 128
    q, k, v, ranks, cutoffs = make_inputs(11, B, Hkv, G, T, D, sinks, window, topk, device="cuda", dtype=dtype)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    out, lse = sparse_retention_attention(*leaves, ranks, cutoffs, sinks, window, layout=layout)
    ref_out, ref_lse = dense_reference(*ref_leaves, ranks, cutoffs, sinks, window)
    assert out.dtype == dtype and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out.detach(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), atol=2e-2, rtol=2e-2)
    grad_out = torch.randn(q.shape, device="cuda")
    (out.float() * grad_out).sum().backward()
    (ref_out * grad_out.double()).sum().backward()
    for got, ref in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad.double(), ref.grad, atol=5e-2, rtol=5e-2)
    bm = retention_block_mask(ranks, cutoffs, sinks, window, G)
    dense = retention_mask_dense(ranks, cutoffs, sinks, window)
    tiles = dense.reshape(B, Hkv, T // 128, 128, T // 128, 128).any(dim=(3, 5))
    assert block_sparsity(bm) == pytest.approx(1.0 - tiles.float().mean().item(), abs=1e-9)


def test_no_grad_call_with_grad_requiring_inputs_uses_flex_path_on_cpu():
    """Inputs that require grad, called under no_grad (evaluation of a training model), must not raise."""
    torch.manual_seed(5)
    B, Hkv, G, T, D = 1, 2, 2, 40, 8
    q = torch.randn(B, Hkv * G, T, D, requires_grad=True)
    k = torch.randn(B, Hkv, T, D, requires_grad=True)
    v = torch.randn(B, Hkv, T, D, requires_grad=True)
    ranks, cutoffs = running_topk_cutoff(torch.randn(B, Hkv, T), 2, 4, 6)
    with torch.no_grad():
        out, lse = sparse_retention_attention(q, k, v, ranks, cutoffs, 2, 4)
    ref, ref_lse = sparse_retention_attention(q, k, v, ranks, cutoffs, 2, 4)  # dense twin (grad path)
    torch.testing.assert_close(out, ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse.detach(), atol=1e-5, rtol=1e-5)


# ---- the interval-gathered layout (default) ----

GATHERED_CASES = [
    # seed, B, Hkv, G, T, D, sinks, window, topk, block_size: T never a multiple of the block size
    (20, 2, 2, 2, 100, 16, 4, 8, 16, 16),  # saturates at q = 27
    (21, 1, 2, 2, 77, 8, 0, 1, 5, 8),  # no sinks, window 1
    (22, 2, 2, 2, 90, 8, 2, 6, 200, 16),  # budget never binds (k > T)
    (23, 1, 2, 2, 60, 8, 3, 4, 0, 16),  # k = 0: sinks + window only
    (24, 1, 2, 2, 40, 8, 1, 50, 3, 16),  # window >= T
    (25, 1, 2, 2, 150, 8, 2, 16, 24, 128),  # the default block size, two blocks, the second one partial
]


@pytest.mark.parametrize("topk_arg", ["given", "none"])
@pytest.mark.parametrize("case", GATHERED_CASES, ids=[f"seed{c[0]}" for c in GATHERED_CASES])
def test_gathered_output_lse_and_gradients_match_dense_float64(case, topk_arg):
    seed, B, Hkv, G, T, D, sinks, window, topk, bs = case
    q, k, v, ranks, cutoffs = make_inputs(seed, B, Hkv, G, T, D, sinks, window, topk)
    kw = dict(layout="gathered", block_size=bs, topk=topk if topk_arg == "given" else None)
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = dense_reference(*ref_leaves, ranks, cutoffs, sinks, window)
    with torch.no_grad():  # eager flex on the gathered layout (its BlockMask and mask_mod)
        out, lse = sparse_retention_attention(q, k, v, ranks, cutoffs, sinks, window, **kw)
    torch.testing.assert_close(out.double(), ref_out.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), atol=1e-5, rtol=1e-5)
    # with gradients: the dense twin on the same gathered layout (gather forward, index_put backward)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = sparse_retention_attention(*leaves, ranks, cutoffs, sinks, window, **kw)
    assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), atol=1e-5, rtol=1e-5)
    g = torch.Generator().manual_seed(seed + 100)
    grad_out = torch.randn(q.shape, generator=g)
    grad_lse = torch.randn(q.shape[:3], generator=g)
    ((out * grad_out).sum() + (lse * grad_lse).sum()).backward()
    ((ref_out * grad_out.double()).sum() + (ref_lse * grad_lse.double()).sum()).backward()
    for got, ref in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad.double(), ref.grad, atol=1e-5, rtol=1e-5)


def test_gathered_prebuilt_plan_and_float64_inputs():
    seed, B, Hkv, G, T, D, sinks, window, topk, bs = GATHERED_CASES[0]
    q, k, v, ranks, cutoffs = make_inputs(seed, B, Hkv, G, T, D, sinks, window, topk, dtype=torch.float64)
    plan = gathered_plan(ranks, cutoffs, sinks, window, G, topk=topk, block_size=bs)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = sparse_retention_attention(*leaves, ranks, cutoffs, sinks, window, scale=0.3, plan=plan)
    ref_leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out, ref_lse = dense_reference(*ref_leaves, ranks, cutoffs, sinks, window, scale=0.3)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    out.square().sum().backward()
    ref_out.square().sum().backward()
    for got, ref in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad, ref.grad, atol=1e-10, rtol=1e-10)


def test_gathered_tile_fraction_counts_computed_tiles():
    B, Hkv, G, T, sinks, window, topk, bs = 1, 2, 2, 256, 2, 8, 8, 16
    _, _, _, ranks, cutoffs = make_inputs(4, B, Hkv, G, T, 8, sinks, window, topk)
    plan = gathered_plan(ranks, cutoffs, sinks, window, G, topk=topk, block_size=bs)
    lay = plan.layout
    nQ = T // bs
    # independent count: per query block, the keys any of its queries sees (dense mask), in tiles of bs slots
    seen = retention_mask_dense(ranks, cutoffs, sinks, window).view(B, Hkv, nQ, bs, T).any(dim=3)  # [B, Hkv, nQ, T]
    expected = ((seen.sum(-1) + bs - 1) // bs).sum().item() / (B * Hkv * nQ * nQ)
    assert gathered_tile_fraction(plan) == pytest.approx(expected, abs=1e-12)
    # at most ceil((s + w + k + bs - 1) / bs) tiles per query block, however scattered the kept keys are
    assert gathered_tile_fraction(plan) <= lay.capacity // bs / nQ
    bm = retention_block_mask(ranks, cutoffs, sinks, window, G, block_size=bs)
    assert gathered_tile_fraction(plan) < 1.0 - block_sparsity(bm)  # scattered random keys: fewer tiles


@pytest.mark.gpu
def test_gathered_compiled_cuda_bf16_matches_float64():
    pytest.importorskip("triton")
    B, Hkv, G, T, D, sinks, window, topk = 1, 2, 2, 4096, 64, 4, 256, 480
    q, k, v, ranks, cutoffs = make_inputs(12, B, Hkv, G, T, D, sinks, window, topk, device="cuda",
                                          dtype=torch.bfloat16)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    out, lse = sparse_retention_attention(*leaves, ranks, cutoffs, sinks, window, topk=topk)
    ref_out, ref_lse = dense_reference(*ref_leaves, ranks, cutoffs, sinks, window)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref_out.detach(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), ref_lse.detach(), atol=2e-2, rtol=2e-2)
    g = torch.Generator(device="cuda").manual_seed(0)
    grad_out = torch.randn(q.shape, device="cuda", generator=g)
    grad_lse = torch.randn(q.shape[:3], device="cuda", generator=g)
    ((out.float() * grad_out).sum() + (lse * grad_lse).sum()).backward()
    ((ref_out * grad_out.double()).sum() + (ref_lse * grad_lse.double()).sum()).backward()
    for got, ref in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad.double(), ref.grad, atol=5e-2, rtol=5e-2)
    # the layout sized from the data (one sync, possibly another compile) gives the same result
    with torch.no_grad():
        out2, lse2 = sparse_retention_attention(q, k, v, ranks, cutoffs, sinks, window)
    torch.testing.assert_close(out2, out.detach(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse2, lse.detach(), atol=1e-3, rtol=1e-3)
    plan = gathered_plan(ranks, cutoffs, sinks, window, G, topk=topk)
    assert bool((plan.layout.num_used <= plan.layout.capacity).all())
    assert gathered_tile_fraction(plan) <= plan.layout.capacity // 128 / (T // 128)


def test_flex_calls_run_with_a_recompile_limit_for_every_kernel(monkeypatch):
    """Past dynamo's recompile limit a compiled flex silently runs eager: every call widens the limit, scoped."""
    import torch._dynamo

    from kvlearn.ops import flex

    name = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
    before = getattr(torch._dynamo.config, name)
    seen = []

    def spy(query, key, value, **kwargs):
        seen.append(getattr(torch._dynamo.config, name))
        return torch.zeros_like(query), None

    monkeypatch.setattr(flex, "flex_fn", lambda device: spy)
    q = torch.randn(1, 2, 8, 16)
    flex.flex_attention_lse(q, q.clone(), q.clone(), return_lse=False)
    assert seen == [max(before, flex.RECOMPILE_LIMIT)] and seen[0] >= 64
    assert getattr(torch._dynamo.config, name) == before  # restored after the call


def test_kernel_options_reach_flex_and_bad_ones_are_named(monkeypatch):
    from kvlearn.ops import flex

    torch.manual_seed(3)
    B, Hkv, G, T, D = 1, 2, 2, 40, 16
    q = torch.randn(B, Hkv * G, T, D)
    k, v = torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    ranks, cutoffs = running_topk_cutoff(torch.randn(B, Hkv, T), 2, 4, 6)
    opts = {"num_warps": 4, "BLOCK_N": 16}
    seen = []
    real = flex.flex_fn

    def spy_fn(device):
        fn = real(device)

        def spy(*args, **kwargs):
            seen.append(kwargs.get("kernel_options"))
            kwargs.pop("kernel_options", None)  # eager CPU flex: the options only matter to the compiled kernel
            return fn(*args, **kwargs)

        return spy

    monkeypatch.setattr(flex, "flex_fn", spy_fn)
    with torch.no_grad():
        sparse_retention_attention(q, k, v, ranks, cutoffs, 2, 4, topk=6, block_size=16, kernel_options=opts)
        sparse_retention_attention(q, k, v, ranks, cutoffs, 2, 4, layout="blockmask", block_size=16, kernel_options=opts)
        future_attention_target(q, k, torch.zeros(B, Hkv * G, T), 4, backend="flex", kernel_options=opts)
        sparse_retention_attention(q, k, v, ranks, cutoffs, 2, 4, topk=6, block_size=16)
    assert seen == [opts, opts, opts, None]
    with pytest.raises(KVLearnError, match=r"kernel_options keys \['BLOCK_Q'\] are invalid"):
        sparse_retention_attention(q, k, v, ranks, cutoffs, 2, 4, topk=6, kernel_options={"BLOCK_Q": 64})
    with pytest.raises(KVLearnError, match="kernel_options of type list is invalid"):
        future_attention_target(q, k, torch.zeros(B, Hkv * G, T), 4, kernel_options=[("num_warps", 4)])

# ---- backend dispatch: the fused Triton forward (CUDA, no gradient) vs FlexAttention ----


def test_backend_choice_errors_are_named():
    q, k, v, ranks, cutoffs = make_inputs(0, 1, 2, 2, 40, 16, 2, 4, 6)
    cases = [
        (dict(backend="cuda"), "backend='cuda' is invalid"),
        (dict(backend="triton", layout="blockmask"), "backend='triton' is invalid with layout='blockmask'"),
        (dict(backend="triton", kernel_options={"BLOCK_M": 64}), r"key\(s\) \['BLOCK_M'\] are invalid for backend='triton'"),
        (dict(backend="flex", kernel_options={"block_m": 64}), "block_m"),
        (dict(backend="triton"), "device cpu is invalid"),  # the kernel needs CUDA (or the interpreter)
    ]
    for kwargs, match in cases:
        with pytest.raises(KVLearnError, match=match) as err, torch.no_grad():
            sparse_retention_attention(q, k, v, ranks, cutoffs, 2, 4, **kwargs)
        assert "\n" not in str(err.value)


def test_auto_backend_on_cpu_is_flex(monkeypatch):
    """On the CPU "auto" never reaches the Triton kernel (it would raise there): same result as backend="flex"."""
    import kvlearn.ops.gathered_triton as gt

    def boom(*a, **k):
        raise AssertionError("the Triton forward must not run on the CPU")

    monkeypatch.setattr(gt, "gathered_attention_forward", boom)
    q, k, v, ranks, cutoffs = make_inputs(1, 1, 2, 2, 40, 16, 2, 4, 6)
    with torch.no_grad():
        auto = sparse_retention_attention(q, k, v, ranks, cutoffs, 2, 4)
        flex = sparse_retention_attention(q, k, v, ranks, cutoffs, 2, 4, backend="flex")
    torch.testing.assert_close(auto[0], flex[0], atol=0, rtol=0)


@pytest.mark.gpu
def test_cuda_auto_backend_takes_triton_without_grad_and_flex_with_grad(monkeypatch):
    pytest.importorskip("triton")
    import kvlearn.ops.gathered_triton as gt

    calls = []
    real = gt.gathered_attention_forward

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(gt, "gathered_attention_forward", spy)
    B, Hkv, G, T, D, sinks, window, topk = 1, 2, 4, 2048, 128, 4, 128, 256
    q, k, v, ranks, cutoffs = make_inputs(12, B, Hkv, G, T, D, sinks, window, topk, device="cuda", dtype=torch.bfloat16)
    ref_out, ref_lse = dense_reference(q.double(), k.double(), v.double(), ranks, cutoffs, sinks, window)
    with torch.no_grad():
        out, lse = sparse_retention_attention(q, k, v, ranks, cutoffs, sinks, window, topk=topk)
    assert len(calls) == 1
    torch.testing.assert_close(out.double(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse.double(), ref_lse, atol=2e-2, rtol=2e-2)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out_g, _ = sparse_retention_attention(*leaves, ranks, cutoffs, sinks, window, topk=topk)
    assert len(calls) == 1  # training: flex (the Triton kernel has no backward)
    out_g.float().sum().backward()
    torch.testing.assert_close(out_g.detach().double(), ref_out, atol=2e-2, rtol=2e-2)


def test_gathered_plan_rejects_a_bad_group_size():
    _, _, _, ranks, cutoffs = make_inputs(0, 1, 2, 2, 40, 16, 2, 4, 6)
    for bad in (0, 1.5, True):
        with pytest.raises(KVLearnError, match=rf"query_heads_per_kv={bad!r} is invalid: expected an integer >= 1"):
            gathered_plan(ranks, cutoffs, 2, 4, bad, topk=6)
