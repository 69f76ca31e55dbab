"""MLSTMScorer(skip=True): the mLSTM readout plus the skip path (an MLP of x_u added to the score) on x_u (every entry point agrees)."""

import pytest
import torch

from kvlearn.kvpop.scorers import MLPScorer, MLSTMScorer


def _kv(seed, b=2, h=2, t=30, d=8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, h, t, d, generator=g), torch.randn(b, h, t, d, generator=g)


def _with_skip(window=5, seed=0, d=8, **kw):
    s = MLSTMScorer(2, d, window=window, skip=True, compile=False, **kw)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in s.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return s


def test_default_has_no_skip_path_and_the_paper_parameter_count():
    s = MLSTMScorer(8, 128, window=256)
    assert not s.skip and s.skip_w1 is None
    assert s.num_parameters_per_head() == 49731
    d = MLSTMScorer(8, 128, window=256, skip=True)
    assert d.num_parameters_per_head() == 49731 + 256 * 256 + 256 + 256
    with pytest.raises(Exception):
        MLSTMScorer(2, 8, window=3, skip=1)


def test_zero_init_is_constant_and_the_skip_path_gets_the_first_gradient():
    s = MLSTMScorer(2, 8, window=3, skip=True, compile=False)
    k, v = _kv(0)
    r = s(k, v)
    assert torch.equal(r, torch.zeros_like(r))
    (r * torch.randn_like(r)).sum().backward()
    assert s.skip_w2.grad is not None and float(s.skip_w2.grad.norm()) > 0
    assert float(s.a.grad.norm()) > 0


@pytest.mark.parametrize("delayed", [True, False])
def test_forward_is_the_plain_mlstm_plus_the_mlp(delayed):
    s = _with_skip(window=4, seed=1, delayed_readout=delayed)
    plain = MLSTMScorer(2, 8, window=4, delayed_readout=delayed, compile=False)
    mlp = MLPScorer(2, 8)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            p.copy_(getattr(s, name))
        mlp.w1.copy_(s.skip_w1)
        mlp.b1.copy_(s.skip_b1)
        mlp.w2.copy_(s.skip_w2)
    k, v = _kv(2)
    torch.testing.assert_close(s(k, v), plain(k, v) + mlp(k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("delayed", [True, False])
def test_continue_prefill_in_chunks_equals_forward(delayed):
    window, t = 3, 37
    s = _with_skip(window=window, seed=5, d=16, chunk_size=4, delayed_readout=delayed)
    k, v = _kv(9, d=16, t=t)
    full, state_full = s.prefill(k, v)
    scores = torch.full_like(full, float("nan"))
    state = None
    d = s.readout_delay
    for a, b in ((0, 5), (5, 6), (6, 20), (20, t)):
        past_k = past_v = None
        if d and a >= d:
            past_k, past_v = k[:, :, a - d:a], v[:, :, a - d:a]
        got, past, state = s.continue_prefill(k[:, :, a:b], v[:, :, a:b], None, state, past_k, past_v)
        scores[:, :, a:b] = got
        if past is not None and a >= d:
            scores[:, :, a - d:a] = past
    torch.testing.assert_close(scores, full, atol=1e-5, rtol=1e-5)
    for x, y in zip(state, state_full):
        torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
