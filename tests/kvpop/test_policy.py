"""Decay, static priorities, teacher cutoffs, boundary decisions and the query sampler."""

import math

import pytest
import torch

from kvlearn.errors import KVLearnError
from kvlearn.kvpop.policy import (
    LearnedDecay,
    boundary_decisions,
    log_decay,
    sample_query_positions,
    static_priorities,
    teacher_policies,
    teacher_policy,
)

# ------------------------------------------------------------------------------------------------------------
# decay and priorities
# ------------------------------------------------------------------------------------------------------------


def test_log_decay_endpoints_and_midpoint():
    lo, hi = 0.9, 0.999
    out = log_decay(torch.tensor([-60.0, 0.0, 60.0]), lo, hi)
    assert out.dtype == torch.float32
    expected = torch.tensor([math.log(lo), 0.5 * (math.log(lo) + math.log(hi)), math.log(hi)])
    torch.testing.assert_close(out, expected, atol=1e-7, rtol=1e-6)
    # gamma stays inside the range for any alpha
    gam = log_decay(torch.linspace(-20, 20, 101), lo, hi).exp()
    assert (gam >= lo - 1e-7).all() and (gam <= hi + 1e-7).all()
    assert (gam[1:] >= gam[:-1]).all()


def test_learned_decay_module():
    mod = LearnedDecay(3, 0.99, 0.9999)
    assert mod.alpha.shape == (3,) and (mod.alpha == 0).all()
    out = mod()
    mid = 0.5 * (math.log(0.99) + math.log(0.9999))
    torch.testing.assert_close(out, torch.full((3,), mid))
    out.sum().backward()
    assert mod.alpha.grad is not None and (mod.alpha.grad != 0).all()


@pytest.mark.parametrize(
    "lo,hi,needle",
    [(0.0, 0.5, "decay_min=0.0"), (0.5, 1.0, "decay_max=1.0"), (0.9, 0.8, "decay_min=0.9 > decay_max=0.8"),
     (-0.1, 0.5, "decay_min=-0.1"), (0.5, 1.5, "decay_max=1.5")],
)
def test_decay_range_validation(lo, hi, needle):
    with pytest.raises(KVLearnError, match=needle):
        log_decay(torch.zeros(2), lo, hi)
    with pytest.raises(KVLearnError, match=needle):
        LearnedDecay(2, lo, hi)


def test_static_priorities_match_loop_and_are_differentiable():
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(2, 3, 9, generator=g, requires_grad=True)
    lg = (-torch.rand(3, generator=g) * 0.2).requires_grad_()
    got = static_priorities(raw, lg)
    assert got.dtype == torch.float32 and got.shape == raw.shape
    for b in range(2):
        for h in range(3):
            for t in range(9):
                assert abs(got[b, h, t].item() - (raw[b, h, t].item() - t * lg[h].item())) < 1e-6
    got.sum().backward()
    torch.testing.assert_close(raw.grad, torch.ones_like(raw))
    torch.testing.assert_close(lg.grad, torch.full((3,), -2.0 * sum(range(9))))
    shifted = static_priorities(raw, lg, offset=5)
    torch.testing.assert_close(shifted - got, (-5 * lg)[None, :, None].expand_as(got).detach())
    with pytest.raises(KVLearnError, match="log_gamma shape"):
        static_priorities(raw, lg[:2])


# ------------------------------------------------------------------------------------------------------------
# boundary decisions: a hand-computed case
# ------------------------------------------------------------------------------------------------------------


def test_boundary_decisions_hand_computed():
    # sinks=1, window=2, topk=2 -> decisions exist for q in [5, 8).
    # head 0: log γ = -0.5, priority p_t = r_t + 0.5 t:
    #   t: 0    1    2    3    4    5    6    7
    #   r: 9    1    3    0.5  0    2    0    0
    #   p: 9    1.5  4    2    2    4.5  3    3.5     (t=3 and t=4 tie; the earlier token t=3 ranks higher)
    #   q=5: E={1,2,3}, t_new=3; order 2,3,1 -> keep (y=+1), boundary = 3rd best = t1
    #   q=6: E={1..4},  t_new=4; order 2,3,4,1 -> drop (y=-1), boundary = 2nd best = t3 (last retained)
    #   q=7: E={1..5},  t_new=5; order 5,2,3,4,1 -> keep (y=+1), boundary = 3rd best = t3 (the evicted token)
    # head 1: log γ = 0, p_t = r_t:
    #   q=5: E={1,2,3}: order 2,1,3 -> t_new=3 dropped, boundary = t1
    #   q=6: order 2,1,3,4 -> t_new=4 dropped, boundary = t1
    #   q=7: order 2,5,1,3,4 -> t_new=5 kept, boundary = 3rd best = t1
    r = torch.tensor([9, 1, 3, 0.5, 0, 2, 0, 0])
    target = torch.stack([r, r])[None]  # [1, 2, 8]
    log_gamma = torch.tensor([-0.5, 0.0])
    teacher = teacher_policy(target, log_gamma, sinks=1, window=2, topk=2)
    queries = torch.tensor([7, 4, 5, 6, 8, 0])
    dec = boundary_decisions(teacher, queries, sinks=1, window=2, topk=2)
    valid = torch.tensor([True, False, True, True, False, False])
    assert dec.valid.shape == (1, 2, 6)
    assert torch.equal(dec.valid[0, 0], valid) and torch.equal(dec.valid[0, 1], valid)
    assert torch.equal(dec.t_new[0, 0][valid], torch.tensor([5, 3, 4]))
    assert torch.equal(dec.t_bnd[0, 0][valid], torch.tensor([3, 1, 3]))
    assert torch.equal(dec.y[0, 0][valid], torch.tensor([1.0, 1.0, -1.0]))
    assert torch.equal(dec.t_bnd[0, 1][valid], torch.tensor([1, 1, 1]))
    assert torch.equal(dec.y[0, 1][valid], torch.tensor([1.0, -1.0, -1.0]))
    assert (dec.y[..., ~valid] == 0).all()
    # teacher tensors: priorities, inverse map
    torch.testing.assert_close(teacher.priorities[0, 0], torch.tensor([9, 1.5, 4, 2, 2, 4.5, 3, 3.5]))
    assert torch.equal(teacher.order[0, 0], torch.tensor([0, 5, 2, 7, 6, 3, 4, 1]))


def test_topk_zero_has_no_decisions():
    target = torch.randn(2, 2, 20)
    teacher = teacher_policy(target, torch.full((2,), -0.01), sinks=2, window=3, topk=0)
    dec = boundary_decisions(teacher, torch.arange(20), sinks=2, window=3, topk=0)
    assert not dec.valid.any() and (dec.y == 0).all()


def test_budget_mismatch_is_rejected():
    teacher = teacher_policy(torch.randn(1, 1, 20), torch.zeros(1), sinks=1, window=2, topk=3)
    with pytest.raises(KVLearnError, match="differs from the teacher"):
        boundary_decisions(teacher, torch.arange(20), sinks=1, window=2, topk=4)


# ------------------------------------------------------------------------------------------------------------
# boundary decisions vs a brute-force per-query loop
# ------------------------------------------------------------------------------------------------------------


def _brute_force(target, log_gamma, q, sinks, window, topk, b, h):
    """Effective scores of Eq. 5 (decay step 1) in float64, explicit sort with earlier-token tie break."""
    t_new = q - window
    elig = list(range(sinks, q - window + 1))
    score = {t: float(target[b, h, t]) + (q - t) * float(log_gamma[h]) for t in elig}
    ranked = sorted(elig, key=lambda t: (-score[t], t))
    keep = t_new in ranked[:topk]
    rest = [t for t in ranked if t != t_new]
    return t_new, rest[topk - 1], 1.0 if keep else -1.0


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("sinks,window,topk,seq", [(0, 1, 1, 12), (2, 3, 4, 30), (1, 5, 2, 25), (4, 2, 7, 40)])
def test_boundary_decisions_match_brute_force(seed, sinks, window, topk, seq):
    g = torch.Generator().manual_seed(seed)
    b, h = 2, 3
    if seed == 2:  # many exact ties: integer targets, no decay
        target = torch.randint(0, 3, (b, h, seq), generator=g).float()
        log_gamma = torch.zeros(h)
    else:
        target = torch.randn(b, h, seq, generator=g)
        log_gamma = -torch.rand(h, generator=g) * 0.3
    teacher = teacher_policy(target, log_gamma, sinks, window, topk)
    queries = torch.arange(-1, seq + 2)
    dec = boundary_decisions(teacher, queries, sinks, window, topk)
    lo = sinks + window + topk
    for bi in range(b):
        for hi in range(h):
            for j, q in enumerate(queries.tolist()):
                ok = lo <= q < seq
                assert bool(dec.valid[bi, hi, j]) == ok
                if not ok:
                    continue
                t_new, t_bnd, y = _brute_force(target, log_gamma, q, sinks, window, topk, bi, hi)
                assert int(dec.t_new[bi, hi, j]) == t_new
                assert int(dec.t_bnd[bi, hi, j]) == t_bnd, (bi, hi, q)
                assert float(dec.y[bi, hi, j]) == y


def test_teacher_policy_cutoffs_and_order():
    g = torch.Generator().manual_seed(5)
    target = torch.randn(2, 2, 24, generator=g)
    lg = torch.tensor([-0.1, -0.02])
    teacher = teacher_policy(target, lg, sinks=2, window=3, topk=4)
    assert teacher.ranks.dtype == torch.int32 and teacher.order.dtype == torch.int64
    for b in range(2):
        for h in range(2):
            # order is the inverse permutation of ranks
            assert torch.equal(teacher.ranks[b, h][teacher.order[b, h]].long(), torch.arange(24))
            for q in range(24):
                elig = list(range(2, q - 3 + 1))
                rs = sorted(int(teacher.ranks[b, h, t]) for t in elig)
                want_k = rs[3] if len(rs) >= 4 else 24
                want_k1 = rs[4] if len(rs) >= 5 else 24
                assert int(teacher.cutoffs[b, h, q]) == want_k
                assert int(teacher.cutoffs_next[b, h, q]) == want_k1
    assert not teacher.priorities.requires_grad


# ------------------------------------------------------------------------------------------------------------
# sampler
# ------------------------------------------------------------------------------------------------------------


def test_sampler_range_and_late_bias():
    g = torch.Generator().manual_seed(0)
    lo, seq = 4 + 16 + 20, 200
    uni = sample_query_positions(seq, 4, 16, 20, 4000, late_fraction=0.0, generator=g)
    late = sample_query_positions(seq, 4, 16, 20, 4000, late_fraction=1.0, generator=g)
    mixed = sample_query_positions(seq, 4, 16, 20, 101, late_fraction=0.5, generator=g)
    for x in (uni, late, mixed):
        assert x.dtype == torch.int64 and int(x.min()) >= lo and int(x.max()) < seq
    assert uni.shape == (4000,) and mixed.shape == (101,)
    # uniform mean ~ (lo + seq - 1) / 2 = 119.5; sqrt-biased mean ~ lo + 2/3 (seq - lo) = 146.7
    assert abs(uni.float().mean().item() - 119.5) < 3
    assert late.float().mean().item() > uni.float().mean().item() + 20
    # the last position and the first position are reachable
    assert int(uni.min()) == lo and int(late.max()) == seq - 1
    # deterministic with a seeded generator
    a = sample_query_positions(seq, 4, 16, 20, 50, generator=torch.Generator().manual_seed(7))
    b = sample_query_positions(seq, 4, 16, 20, 50, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_sampler_validation():
    with pytest.raises(KVLearnError, match="seq_len=40 is invalid"):
        sample_query_positions(40, 4, 16, 20, 10)
    with pytest.raises(KVLearnError, match="late_fraction=1.5"):
        sample_query_positions(100, 4, 16, 20, 10, late_fraction=1.5)
    with pytest.raises(KVLearnError, match="window=0"):
        sample_query_positions(100, 4, 0, 20, 10)
    assert sample_query_positions(41, 4, 16, 20, 5).eq(40).all()


def test_teacher_policies_of_several_layers_in_one_pass_equal_each_layer_alone():
    """The batched pass (layers stacked along the batch) gives each layer exactly its own policy, whose cutoffs are
    the brute-force k-th smallest eligible rank; targets with ties (integers) exercise the stable order."""
    torch.manual_seed(0)
    sinks, window, topk, T = 2, 3, 4, 23
    targets = [torch.randint(0, 4, (2, 3, T)).float() for _ in range(3)]
    log_gammas = [torch.tensor([-0.01, -0.2, 0.0]) * (i + 1) for i in range(3)]
    together = teacher_policies(targets, log_gammas, sinks, window, topk)
    for target, log_gamma, pol in zip(targets, log_gammas, together):
        alone = teacher_policy(target, log_gamma, sinks, window, topk)
        for name in ("priorities", "ranks", "cutoffs", "cutoffs_next", "order"):
            assert torch.equal(getattr(pol, name), getattr(alone, name)), name
        for b in range(2):
            for h in range(3):
                for q in range(T):
                    eligible = sorted(int(pol.ranks[b, h, t]) for t in range(sinks, q - window + 1))
                    want = eligible[topk - 1] if len(eligible) >= topk else T
                    assert int(pol.cutoffs[b, h, q]) == want
    with pytest.raises(KVLearnError, match=r"targets\[1\] shape=\(2, 3, 22\).*expected \(2, 3, 23\)"):
        teacher_policies([targets[0], targets[1][..., :-1]], log_gammas[:2], sinks, window, topk)
    with pytest.raises(KVLearnError, match="got 2 targets and 1 log_gammas"):
        teacher_policies(targets[:2], log_gammas[:1], sinks, window, topk)


@pytest.mark.gpu
def test_teacher_policies_on_cuda_equal_the_cpu_reference():
    """On CUDA the stacked pass runs the Triton cutoff over layers x batch x heads rows at once: every layer's
    policy equals the CPU policy of that layer alone (testbed teacher shape: 8 layers, batch 8, 2 KV heads, 4096)."""
    pytest.importorskip("triton")
    torch.manual_seed(0)
    targets = [torch.rand(8, 2, 4096) for _ in range(8)]
    log_gammas = [torch.full((2,), -1e-5 * (i + 1)) for i in range(8)]
    on_gpu = teacher_policies([t.cuda() for t in targets], [g.cuda() for g in log_gammas], 4, 256, 764)
    for target, log_gamma, pol in zip(targets, log_gammas, on_gpu):
        ref = teacher_policy(target, log_gamma, 4, 256, 764)
        for name in ("priorities", "ranks", "cutoffs", "cutoffs_next", "order"):
            assert torch.equal(getattr(pol, name).cpu(), getattr(ref, name)), name
