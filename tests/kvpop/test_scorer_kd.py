"""The straight-through scorer distillation (:mod:`kvlearn.kvpop.scorer_kd`) against independent references.

* the soft retention bias equals a per-entry Python loop over the definition (cutoff key found by its rank);
* as the temperature goes to 0 it becomes the hard retention mask of :func:`kvlearn.ops.masks.retention_mask_dense`;
* the straight-through output equals the hard output bit for bit, sends the hard output's gradient unchanged, no
  gradient to the queries, keys and values, and to the priorities exactly the gradient of a dense soft attention
  built from the loop's bias (GQA: 2 KV heads, 2 query heads each);
* in a hand-built case the gradient raises the priority of a dropped key the loss needs and lowers the cutoff key's;
* on a tiny GQA Qwen3 student the logits and the backbone's KD gradient are unchanged, and the KD loss reaches the
  scorers and decays only with it;
* the retrofit runs with it, a resumed run must keep its settings, and bad settings are one-line errors.
"""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from kvlearn import KVLearnError
from kvlearn.cli import main
from kvlearn.kvpop import scorer_kd as scorer_kd_mod
from kvlearn.kvpop.apply import kvpop_modules
from kvlearn.kvpop.scorer_kd import (ScorerKD, cutoff_priorities, scorer_kd_rows, soft_retention_bias,
                                     straight_through_retention)
from kvlearn.ops.fenwick import running_topk_cutoff
from kvlearn.ops.masks import retention_mask_dense
from kvlearn.testbed.data import training_batch
from kvlearn.ops.distill_loss import kd_loss
from kvlearn.train.distill import LOG_FILE, build_models, retrofit, student_forward
from tests.train.test_distill import SEQ, make_config  # the trainer tests' tiny setting

SINKS, WINDOW, TOPK = 2, 4, 5


def _setup(B=2, H=2, T=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(B, H, T, generator=g)
    ranks, cutoffs = running_topk_cutoff(p, SINKS, WINDOW, TOPK)
    return p, ranks, cutoffs


def _reference_bias(p, ranks, cutoffs, tau):
    """``[B, H, T, T]`` by the definition, one entry at a time."""
    B, H, T = p.shape
    out = torch.zeros(B, H, T, T, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for q in range(T):
                c = int(cutoffs[b, h, q])
                for k in range(T):
                    if k > q:
                        out[b, h, q, k] = -math.inf
                    elif k < SINKS or q - k < WINDOW or c == T:
                        out[b, h, q, k] = 0.0
                    elif c < 0:
                        out[b, h, q, k] = -math.inf
                    else:
                        m = int((ranks[b, h] == c).nonzero())
                        x = (float(p[b, h, k]) - float(p[b, h, m])) / tau
                        out[b, h, q, k] = -math.log1p(math.exp(-x)) if x > -30 else x
    return out


def _bias_all_rows(p, cutoffs, tau):
    T = p.shape[-1]
    rows = torch.arange(T)
    return soft_retention_bias(p, cutoff_priorities(p, cutoffs), cutoffs, rows, SINKS, WINDOW, tau)


@pytest.mark.parametrize("tau", [1.0, 0.3])
def test_bias_equals_the_definition(tau):
    p, ranks, cutoffs = _setup()
    assert (cutoffs == p.shape[-1]).any() and ((cutoffs >= 0) & (cutoffs < p.shape[-1])).any()  # both regimes
    got = _bias_all_rows(p, cutoffs, tau).double()
    ref = _reference_bias(p, ranks, cutoffs, tau)
    assert torch.equal(torch.isinf(got), torch.isinf(ref))
    finite = torch.isfinite(ref)
    torch.testing.assert_close(got[finite], ref[finite], rtol=1e-5, atol=1e-5)
    # rows sampled out of order of the whole: the same entries
    rows = torch.tensor([7, 11, 23])
    part = soft_retention_bias(p, cutoff_priorities(p, cutoffs)[:, :, rows], cutoffs[:, :, rows], rows, SINKS,
                               WINDOW, tau)
    assert torch.equal(part, got.float()[:, :, rows])


def test_cold_limit_is_the_hard_mask():
    p, ranks, cutoffs = _setup(seed=3)
    keep = retention_mask_dense(ranks, cutoffs, SINKS, WINDOW)  # [B, H, T, T] bool
    weight = _bias_all_rows(p, cutoffs, 1e-4).exp()
    # the cutoff key itself sits at sigmoid(0) = 1/2; every other key is 0 or 1
    assert torch.equal(weight >= 0.5, keep)
    assert ((weight < 1e-6) | (weight > 1 - 1e-6) | ((weight - 0.5).abs() < 1e-6)).all()


def _soft_reference(q_rows, key, value, bias_rows, scale):
    """Dense softmax attention, GQA by repeating the KV heads, float64."""
    G = q_rows.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(G, dim=1)
    v = value.double().repeat_interleave(G, dim=1)
    logits = q_rows.double() @ k.transpose(-1, -2) * scale + bias_rows.repeat_interleave(G, dim=1)
    return torch.softmax(logits, dim=-1) @ v


def test_straight_through_forward_and_gradients():
    torch.manual_seed(1)
    B, Hkv, G, T, D, tau, weight = 2, 2, 2, 24, 8, 0.5, 3.0
    p, ranks, cutoffs = _setup(B, Hkv, T)
    p.requires_grad_(True)
    query = torch.randn(B, Hkv * G, T, D, requires_grad=True)
    key = torch.randn(B, Hkv, T, D, requires_grad=True)
    value = torch.randn(B, Hkv, T, D, requires_grad=True)
    out = torch.randn(B, Hkv * G, T, D, requires_grad=True)
    rows = torch.tensor([9, 14, 20, 23])
    st = straight_through_retention(out, query, key, value, p, cutoffs, SINKS, WINDOW, None,
                                    ScorerKD(rows, weight, tau, T))
    assert torch.equal(st, out)  # the forward is the hard output, bit for bit
    upstream = torch.randn_like(out)
    (st * upstream).sum().backward()
    assert torch.equal(out.grad, upstream)
    assert query.grad is None and key.grad is None and value.grad is None
    # the priorities' gradient: weight x d/dp of <upstream rows, dense soft attention with the loop's bias>
    p_ref = p.detach().double().requires_grad_(True)
    sorted_p = torch.sort(p_ref, dim=-1, descending=True, stable=True).values
    cut = sorted_p.gather(-1, cutoffs.long().clamp(0, T - 1))
    k_idx, q_idx = torch.arange(T)[None, :], rows[:, None]
    eligible = (k_idx <= q_idx) & (k_idx >= SINKS) & (q_idx - k_idx >= WINDOW)
    active = ((cutoffs >= 0) & (cutoffs < T))[:, :, rows, None]
    soft = F.logsigmoid((p_ref[:, :, None, :] - cut[:, :, rows, None]) / tau)
    bias = torch.where(eligible & active, soft, torch.zeros((), dtype=torch.float64))
    bias = bias.masked_fill(k_idx > q_idx, -math.inf)
    ref_bias = _reference_bias(p.detach(), ranks, cutoffs, tau)[:, :, rows]
    finite = torch.isfinite(ref_bias)
    torch.testing.assert_close(bias.detach()[finite], ref_bias[finite], rtol=1e-5, atol=1e-5)
    s = _soft_reference(query.detach()[:, :, rows], key.detach(), value.detach(), bias, D ** -0.5)
    (weight * (s * upstream.double()[:, :, rows]).sum()).backward()
    assert p.grad.abs().max() > 0
    torch.testing.assert_close(p.grad.double(), p_ref.grad, rtol=1e-4, atol=1e-6)


def _have_cxx() -> bool:
    import shutil

    return any(shutil.which(c) for c in ("g++", "c++", "clang++"))


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=[
    pytest.mark.slow, pytest.mark.skipif(not _have_cxx(), reason="inductor on the CPU needs a C++ compiler")])])
def test_compiled_soft_rows_equal_the_eager_path(backend, monkeypatch):
    """``ScorerKD(compile=True)`` on a device of ``COMPILE_DEVICES`` (the CPU added here, with ``backend``) runs the
    rows through the compiled function: the forward is still the hard output bit for bit and the priorities' gradient
    equals the eager path's to float32 rounding (T = 300 keys, 40 rows, GQA 2 x 2); with ``compile=False``, or on a
    device outside the list, the eager function runs and nothing is compiled."""
    torch.manual_seed(3)
    B, Hkv, G, T, D, tau = 2, 2, 2, 300, 16, 0.7
    g = torch.Generator().manual_seed(5)
    p0 = torch.randn(B, Hkv, T, generator=g)
    _, cutoffs = running_topk_cutoff(p0, SINKS, WINDOW, 20)
    query, out = torch.randn(B, Hkv * G, T, D), torch.randn(B, Hkv * G, T, D)
    key, value = torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    rows, scale = scorer_kd_rows(T, SINKS, WINDOW, 20, 40, g)
    upstream = torch.randn_like(out)
    calls = []
    real = scorer_kd_mod.compiled_soft_retention_rows

    def counted(backend_=backend):
        calls.append(backend_)
        return real(backend)

    monkeypatch.setattr(scorer_kd_mod, "compiled_soft_retention_rows", counted)

    def grad(compile_: bool):
        p = p0.clone().requires_grad_(True)
        st = straight_through_retention(out, query, key, value, p, cutoffs, SINKS, WINDOW, None,
                                        ScorerKD(rows, scale, tau, T, compile=compile_))
        assert torch.equal(st, out)
        (st * upstream).sum().backward()
        return p.grad

    eager = grad(False)
    assert calls == []  # cpu is not a compile device by default
    assert grad(True) is not None and calls == []
    monkeypatch.setattr(scorer_kd_mod, "COMPILE_DEVICES", ("cuda", "cpu"))
    eager_again = grad(False)
    assert calls == [] and torch.equal(eager_again, eager)
    torch._dynamo.reset()
    compiled = grad(True)
    assert calls and eager.abs().max() > 0
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-6)


def test_gradient_raises_a_dropped_key_the_loss_needs():
    """One head, every score equal (zero queries), values zero but for key ``j`` = e_0; the loss wants the last row's
    output to move toward e_0, so descent raises ``p[j]`` and lowers the cutoff key's priority."""
    T, D = 16, 2
    p = torch.linspace(1.0, 0.0, T)[None, None].clone()  # earlier tokens first in rank
    j = 9
    p[0, 0, j] = -1.0  # below the cutoff: dropped
    ranks, cutoffs = running_topk_cutoff(p, 1, 2, 3)
    q = T - 1
    assert not retention_mask_dense(ranks, cutoffs, 1, 2)[0, 0, q, j]
    cut_key = int((ranks[0, 0] == cutoffs[0, 0, q]).nonzero())
    value = torch.zeros(1, 1, T, D)
    value[0, 0, j, 0] = 1.0
    query, key = torch.zeros(1, 1, T, D), torch.zeros(1, 1, T, D)
    pr = p.clone().requires_grad_(True)
    out = torch.zeros(1, 1, T, D, requires_grad=True)
    st = straight_through_retention(out, query, key, value, pr, cutoffs, 1, 2, None,
                                    ScorerKD(torch.tensor([q]), 1.0, 1.0, T))
    (-st[0, 0, q, 0]).backward()
    assert pr.grad[0, 0, j] < 0 and pr.grad[0, 0, cut_key] > 0
    assert pr.grad[0, 0, 0] == 0  # a sink: not ranked against the cutoff


def test_rows_sample_the_evicting_range():
    g = torch.Generator().manual_seed(0)
    rows, scale = scorer_kd_rows(128, 4, 16, 32, 20, g)
    assert rows.dtype == torch.int64 and len(rows) == 20 and len(set(rows.tolist())) == 20
    assert rows.min() >= 52 and rows.max() < 128 and torch.equal(rows, rows.sort().values)
    assert scale == pytest.approx(76 / 20)
    rows, scale = scorer_kd_rows(128, 4, 16, 32, 500, g)  # more than there are: all of them once
    assert torch.equal(rows, torch.arange(52, 128)) and scale == 1.0
    with pytest.raises(KVLearnError, match="num=0"):
        scorer_kd_rows(128, 4, 16, 32, 0, g)
    with pytest.raises(KVLearnError, match="no row evicts"):
        scorer_kd_rows(52, 4, 16, 32, 8, g)
    with pytest.raises(KVLearnError, match="temperature=0"):
        ScorerKD(torch.tensor([3]), 1.0, 0, 8)
    with pytest.raises(KVLearnError, match="rows="):
        ScorerKD(torch.tensor([3.0]), 1.0, 1.0, 8)
    with pytest.raises(KVLearnError, match=r"positions 3..8: expected positions in \[0, seq_len=8\)"):
        ScorerKD(torch.tensor([3, 8]), 1.0, 1.0, 8)


def test_student_logits_and_backbone_gradient_unchanged(teacher_path, tmp_path):
    config = make_config(teacher_path, tmp_path / "s")
    teacher, student = build_models(config, torch.device("cpu"))
    for sc in kvpop_modules(student)[0]:  # scorers that rank: a non-zero output layer
        torch.nn.init.normal_(sc.w2, std=0.5)
    ids, labels = training_batch(2, SEQ, 5)
    with torch.no_grad():
        t_logits = teacher(input_ids=ids).logits
    rows, scale = scorer_kd_rows(SEQ, 4, 16, 32, 24, torch.Generator().manual_seed(1))
    grads = []
    for kd in (None, ScorerKD(rows, scale, 1.0, SEQ)):
        student.zero_grad(set_to_none=True)
        logits, _ = student_forward(student, ids, config.kvpop, scorer_kd=kd)
        kd_loss(logits, t_logits, labels, config.kd_topk).backward()
        grads.append((logits.detach(), {n: None if p.grad is None else p.grad.clone()
                                        for n, p in student.named_parameters()}))
    (plain, g0), (st, g1) = grads
    assert torch.equal(plain, st)
    backbone = [n for n in g0 if ".kvpop." not in n]
    for n in backbone:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-7, msg=n)
    added = [n for n in g0 if ".kvpop." in n]
    assert all(g0[n] is None or not g0[n].any() for n in added)  # without it the KD loss never reaches them
    reached = [n for n in added if g1[n] is not None and g1[n].abs().sum() > 0]
    assert any("scorer" in n for n in reached) and any("decay" in n for n in reached), reached


def test_retrofit_with_scorer_kd_and_resume(teacher_path, tmp_path):
    out = tmp_path / "run"
    result = retrofit(make_config(teacher_path, out, scorer_kd=1.0, scorer_kd_queries=16, scorer_kd_temperature=0.5),
                      progress=False)
    assert result["step"] == 3
    lines = [json.loads(ln) for ln in (out / LOG_FILE).read_text().splitlines()]
    assert all(math.isfinite(ln["loss"]) and math.isfinite(ln["grad_norm"]) for ln in lines)
    with pytest.raises(KVLearnError, match="scorer_kd"):  # the checkpoint was trained with other settings
        retrofit(make_config(teacher_path, out, steps=4, resume=True, scorer_kd=2.0, scorer_kd_queries=16,
                         scorer_kd_temperature=0.5), progress=False)
    # the compiled rows are a speed setting: a resumed run may change it (on the CPU the rows run eagerly either way)
    again = retrofit(make_config(teacher_path, out, resume=True, scorer_kd=1.0, scorer_kd_queries=16,
                                 scorer_kd_temperature=0.5, scorer_kd_compile=True), progress=False)
    assert again["step"] == 3


def test_bad_settings_are_one_line_errors(teacher_path, tmp_path, capsys):
    for kw, match in ((dict(scorer_kd=-1.0), "scorer_kd=-1.0"), (dict(scorer_kd_temperature=0.0), "temperature=0.0"),
                      (dict(scorer_kd_queries=0), "scorer_kd_queries=0"),
                      (dict(scorer_kd_queries=64), "scorer_kd_queries=64 sets the scorer distillation, which is off"),
                      (dict(scorer_kd_compile=True), "scorer_kd_compile=True compiles the scorer distillation, which "
                                                     "is off"),
                      (dict(scorer_kd=1.0, scorer_kd_compile=1), "scorer_kd_compile=1 is invalid: expected True or "
                                                                 "False"),
                      (dict(scorer_kd=1.0, method="streaming_plus", streaming=dict(budget=36, sinks=4)),
                       "for method 'kvpop'")):
        with pytest.raises(KVLearnError, match=match) as err:
            make_config(teacher_path, tmp_path / "bad", **kw)
        assert "\n" not in str(err.value)
    rc = main(["retrofit", "--model", teacher_path, "--out", str(tmp_path / "cli"), "--budget", "52", "--window", "16",
               "--seq-len", "128", "--steps", "1", "--scorer-kd-temperature", "0.5"])
    err = capsys.readouterr().err
    assert rc != 0 and "scorer_kd_temperature=0.5 sets the scorer distillation, which is off" in err
    assert "--scorer-kd WEIGHT" in err and err.count("\n") == 1
    rc = main(["retrofit", "--model", teacher_path, "--out", str(tmp_path / "cli2"), "--budget", "52", "--window", "16",
               "--seq-len", "128", "--steps", "1", "--scorer-kd-compile"])
    err = capsys.readouterr().err
    assert rc != 0 and "scorer_kd_compile=True compiles the scorer distillation, which is off" in err


@pytest.mark.gpu
def test_cuda_compiled_soft_rows_equal_eager():
    """On CUDA, ``ScorerKD(compile=True)`` (inductor) gives the eager path's priority gradient to float32 rounding at a
    training-like shape (T = 2048, 128 rows, GQA 2 x 4), the forward the hard output bit for bit."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dev = torch.device("cuda")
    B, Hkv, G, T, D, window, topk = 2, 2, 4, 2048, 32, 256, 764
    g = torch.Generator().manual_seed(7)
    p0 = torch.randn(B, Hkv, T, generator=g).to(dev)
    _, cutoffs = running_topk_cutoff(p0, 4, window, topk)
    query, out, upstream = (torch.randn(B, Hkv * G, T, D, generator=g).to(dev) for _ in range(3))
    key, value = (torch.randn(B, Hkv, T, D, generator=g).to(dev) for _ in range(2))
    rows, scale = scorer_kd_rows(T, 4, window, topk, 128, g)
    grads = []
    for compile_ in (False, True):
        p = p0.clone().requires_grad_(True)
        st = straight_through_retention(out, query, key, value, p, cutoffs, 4, window, None,
                                        ScorerKD(rows.to(dev), scale, 1.0, T, compile=compile_))
        assert torch.equal(st, out)
        (st * upstream).sum().backward()
        grads.append(p.grad)
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
def test_cuda_bf16_forward_unchanged_and_gradients_match_the_cpu(teacher_path, tmp_path):
    """On CUDA under the trainer's bf16 autocast: the logits with the scorer distillation equal those without bit for
    bit, and the scorers' gradient from the KD loss agrees in direction with the float32 CPU computation of the same
    step on the same weights (the soft pass runs in float32 on both; the KD loss differs by the backbone's bf16
    rounding)."""
    import copy

    config = make_config(teacher_path, tmp_path / "c")
    teacher, student = build_models(config, torch.device("cpu"))
    for sc in kvpop_modules(student)[0]:  # scorers that rank: a non-zero output layer
        torch.nn.init.normal_(sc.w2, std=0.5)
    ids, labels = training_batch(2, SEQ, 5)
    rows, scale = scorer_kd_rows(SEQ, 4, 16, 32, 24, torch.Generator().manual_seed(1))
    grads = {}
    for device in ("cpu", "cuda"):
        dev = torch.device(device)
        t, s = copy.deepcopy(teacher).to(dev), copy.deepcopy(student).to(dev)
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            with torch.no_grad():
                t_logits = t(input_ids=ids.to(dev)).logits
            plain = student_forward(s, ids.to(dev), config.kvpop)[0].detach()  # with autograd: the same kernels
            logits, _ = student_forward(s, ids.to(dev), config.kvpop, scorer_kd=ScorerKD(rows.to(dev), scale, 1.0, SEQ))
        assert torch.equal(plain, logits.detach())
        kd_loss(logits, t_logits, labels.to(dev), config.kd_topk).backward()
        grads[device] = torch.cat([p.grad.flatten().float().cpu() for n, p in s.named_parameters()
                                   if ".kvpop.scorer." in n and p.grad is not None])
        assert grads[device].abs().sum() > 0
    cos = torch.nn.functional.cosine_similarity(grads["cpu"], grads["cuda"], dim=0)
    assert cos > 0.9, float(cos)
