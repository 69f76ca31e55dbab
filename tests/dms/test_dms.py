"""DMS (Łańcucki et al. 2025, arXiv 2506.05345) against independent references, on tiny random GQA Qwen3 models
(float32, 2 layers, 2 KV heads, 4 query heads = 2 per KV head, head_dim 16).

- the cache (decode, chunked prefill, any budget) equals a full-sequence forward under a brute-force mask of the
  same decisions (Python loops over positions, evaluated on each layer's own gate logits in that forward);
- with hard gates and no budget, the training attention equals that mask and the cache;
- zero-initialised gates keep every token: an untrained DMS model equals the dense model (cache and training);
- the shift by one (bias and cache slot scores); the Gumbel noise; the hinge loss against a hand-computed case;
- gate parameter counts; save/load round trip; bad input is one line.
"""

import json
import math

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import kvlearn
from kvlearn import KVLearnError
from kvlearn.config import DMSConfig
from kvlearn.dms.apply import apply_dms, dms_gates, make_dms_cache
from kvlearn.dms.attention import (DMSRecord, DMSTrainForward, compression_loss, dms_bias, logistic_noise,
                                   use_train_attention)
from kvlearn.dms.gates import DMSGate, gate_parameter_count, kvpop_mlp_parameter_count, matched_gate_hidden
from kvlearn.methods import get_method, make_config

VOCAB = 97
T = 40


def tiny(seed=0):
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      pad_token_id=0)
    return Qwen3ForCausalLM(cfg).eval()


def dms_model(config: DMSConfig, seed=0, std=0.01):
    """A DMS model with random gates: about a quarter of the logits are > 0, differently per KV head."""
    model = apply_dms(tiny(seed), config)
    torch.manual_seed(seed + 1)
    for gate in dms_gates(model):
        torch.nn.init.normal_(gate.proj.weight, std=std)
    return model


def reference_keep(alpha: torch.Tensor, sinks: int, window: int, budget: int | None,
                   overflow_evicts: str = "highest_logit") -> torch.Tensor:
    """Brute force ``[B, H, T, T]`` bool from ``alpha [B, H, T]`` (logit produced at each token): simulate the rule
    query by query. Key ``u`` leaves the window at query ``u + window``; it is dropped iff ``alpha[u + 1] > 0``;
    else it joins the long-range set, which holds at most ``budget - sinks - window`` tokens: over that, the one with
    the highest decision logit goes (the later one on ties), or with ``overflow_evicts`` "oldest" / "newest" the
    earliest / the latest held one."""
    B, H, n = alpha.shape
    topk = math.inf if budget is None else budget - sinks - window
    keep = torch.zeros(B, H, n, n, dtype=torch.bool)
    a = alpha.tolist()
    for b in range(B):
        for h in range(H):
            held = []
            for q in range(n):
                u = q - window
                if u >= sinks:
                    decision = a[b][h][u + 1]
                    if not decision > 0:
                        held.append(u)
                        if len(held) > topk:
                            if overflow_evicts == "oldest":
                                worst = min(held)
                            elif overflow_evicts == "newest":
                                worst = max(held)
                            else:
                                worst = max(held, key=lambda t: (a[b][h][t + 1], t))
                            held.remove(worst)
                for k in range(q + 1):
                    keep[b, h, q, k] = k < sinks or q - k < window or k in held
    return keep


def cache_logits(model, config, ids, chunks):
    cache = make_dms_cache(model, config)
    out = []
    with torch.no_grad():
        for a, b in chunks:
            out.append(model(input_ids=ids[:, a:b], past_key_values=cache, use_cache=True).logits)
    return torch.cat(out, 1), cache


def masked_logits(model, config, ids, hard=True, keep_mask=None):
    use_train_attention(model)
    state = DMSTrainForward(config, hard=hard, noise=False, keep_mask=keep_mask)
    try:
        with torch.no_grad():
            return model(input_ids=ids, dms_train=state).logits, state
    finally:
        kvlearn.attach(model)


def distinct_ids(rows: int = 2) -> torch.Tensor:
    """``[rows, T]`` token ids, no token twice in a row: layer 0's gate reads the token embedding alone, so a repeated
    token gives two bitwise-equal logits in one full forward, an exact tie that the brute-force rule breaks by
    position, while the cache computed the two in different forwards (a chunk, a decode step) whose matmuls may round
    differently and break it the other way."""
    return torch.stack([torch.randperm(VOCAB - 1)[:T] + 1 for _ in range(rows)])


def decode_chunks(prefill):
    return [(0, prefill)] + [(t, t + 1) for t in range(prefill, T)]


@pytest.mark.parametrize("prefill", [1, 6, 23])
@pytest.mark.parametrize("budget", [None, 9, 12])
def test_cache_equals_the_brute_force_mask(prefill, budget):
    config = DMSConfig(sinks=2, window=4, budget=budget if budget is not None else T + 1)
    model = dms_model(config)
    torch.manual_seed(3)
    ids = distinct_ids()
    ref, state = masked_logits(model, config, ids,
                               keep_mask=lambda alpha: reference_keep(alpha, config.sinks, config.window, budget))
    evicted = [(r.alpha[..., 1:] > 0).float().mean().item() for r in state.records.values()]
    assert all(0.05 < e < 0.6 for e in evicted), evicted  # the gates really evict (and differ from keep-all)
    got, cache = cache_logits(model, config, ids, decode_chunks(prefill))
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
    assert cache.get_seq_length() == T
    if budget is not None:  # the budget binds: the reference without it differs
        free, _ = masked_logits(model, config, ids,
                                keep_mask=lambda alpha: reference_keep(alpha, config.sinks, config.window, None))
        assert (free - ref).abs().max() > 1e-3


@pytest.mark.parametrize("overflow", ["oldest", "newest"])
@pytest.mark.parametrize("chunks", [decode_chunks(6), [(0, 7), (7, 20), (20, 21), (21, 33), (33, T)]])
def test_overflow_orders_equal_the_brute_force_mask(overflow, chunks):
    """Each order of the full slots, in decoding and in chunked prefill, against the brute-force rule; the three
    orders give three different functions here (the option is not ignored)."""
    config = DMSConfig(sinks=2, window=4, budget=9, overflow_evicts=overflow)
    model = dms_model(config, seed=2)
    ids = distinct_ids()
    refs = {order: masked_logits(model, config, ids, keep_mask=lambda alpha, o=order: reference_keep(
        alpha, config.sinks, config.window, 9, o))[0] for order in ("highest_logit", "oldest", "newest")}
    got, _ = cache_logits(model, config, ids, chunks)
    torch.testing.assert_close(got, refs[overflow], atol=1e-4, rtol=1e-4)
    others = [o for o in refs if o != overflow]
    assert all((refs[o] - refs[overflow]).abs().max() > 1e-3 for o in others)


def test_chunked_prefill_equals_the_brute_force_mask():
    config = DMSConfig(sinks=2, window=4, budget=10)
    model = dms_model(config, seed=1)
    ids = distinct_ids()
    ref, _ = masked_logits(model, config, ids,
                           keep_mask=lambda alpha: reference_keep(alpha, config.sinks, config.window, 10))
    got, _ = cache_logits(model, config, ids, [(0, 7), (7, 20), (20, 21), (21, 33), (33, T)])
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_hard_training_attention_equals_the_reference_and_the_unbounded_cache():
    config = DMSConfig(sinks=2, window=4, budget=T + 1)
    model = dms_model(config, seed=2)
    ids = torch.randint(1, VOCAB, (2, T))
    hard, _ = masked_logits(model, config, ids, hard=True)
    ref, _ = masked_logits(model, config, ids,
                           keep_mask=lambda alpha: reference_keep(alpha, config.sinks, config.window, None))
    torch.testing.assert_close(hard, ref, atol=1e-5, rtol=1e-5)
    got, _ = cache_logits(model, config, ids, decode_chunks(5))
    torch.testing.assert_close(got, hard, atol=1e-4, rtol=1e-4)
    # soft attention with very sharp gates (tau -> 0, no noise) tends to the hard rule
    sharp = DMSConfig(sinks=2, window=4, tau=1e-4)
    soft, _ = masked_logits(model, sharp, ids, hard=False)
    torch.testing.assert_close(soft, hard, atol=1e-4, rtol=1e-4)


def test_untrained_gates_keep_everything():
    """Zero-initialised gates: every logit is -5 (keep), so the DMS model equals the dense model: through a cache
    with a budget covering the sequence, and in training (soft, tau 0.1: log keep-prob logsigmoid(50) ~ 0)."""
    base = tiny(4)
    ids = torch.randint(1, VOCAB, (2, T))
    with torch.no_grad():
        dense = base(input_ids=ids).logits
    config = DMSConfig(sinks=2, window=4, budget=T + 1)
    model = apply_dms(base, config)
    for gate in dms_gates(model):
        assert torch.count_nonzero(gate.proj.weight) == 0
    got, _ = cache_logits(model, config, ids, decode_chunks(3))
    torch.testing.assert_close(got, dense, atol=1e-4, rtol=1e-4)
    soft, state = masked_logits(model, config, ids, hard=False)
    torch.testing.assert_close(soft, dense, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(r.alpha, torch.full_like(r.alpha, -5.0)) for r in state.records.values())


def test_shift_by_one_in_the_bias():
    z = torch.full((1, 2, 12), -30.0)
    z[0, 1, 6] = 30.0  # produced at token 6: decides key 5 of KV head 1
    bias = dms_bias(z, sinks=1, window=3, hard=False)  # [1, 2, 12, 12]
    assert bias.shape == (1, 2, 12, 12)
    evicted = bias < -1  # keep-prob ~ 0 exactly where key 5 has left the window
    expect = torch.zeros(1, 2, 12, 12, dtype=torch.bool)
    expect[0, 1, 8:, 5] = True  # q - 5 >= 3
    assert torch.equal(evicted & (bias > float("-inf")), expect)
    assert torch.isinf(bias[0, :, 3, 4:]).all() and (bias[0, :, 4, :5] > float("-inf")).all()  # causal
    hard = dms_bias(z, sinks=1, window=3, hard=True)
    assert torch.equal(torch.isinf(hard) & (hard < 0), torch.isinf(bias) | expect)
    # a key inside the window or a sink is never penalised
    z2 = torch.full((1, 1, 12), 30.0)
    b2 = dms_bias(z2, sinks=2, window=3, hard=True)
    for q in range(12):
        for k in range(q + 1):
            assert (b2[0, 0, q, k] == 0) == (k < 2 or q - k < 3 or k == 11), (q, k)


def test_shift_by_one_in_the_cache():
    """After decoding, each held token's slot score is minus the logit of the token after it."""
    config = DMSConfig(sinks=2, window=4, budget=T + 1)
    model = dms_model(config, seed=5)
    ids = torch.randint(1, VOCAB, (1, T))
    _, state = masked_logits(model, config, ids)
    _, cache = cache_logits(model, config, ids, decode_chunks(9))
    for i, layer in enumerate(cache.layers):
        alpha = state.records[i].alpha[0]  # [H, T]
        pos, score = layer.slot_positions[0].long(), layer.slot_state["score"][0]
        for h in range(2):
            for slot in range(pos.shape[1]):
                t = int(pos[h, slot])
                if t < 0:
                    continue
                if t == T - 1:
                    assert score[h, slot] == float("inf")  # no next token yet
                else:
                    torch.testing.assert_close(score[h, slot], -alpha[h, t + 1], atol=1e-3, rtol=1e-4)
                    if t >= 2 and t <= T - 1 - 4:  # left the window: kept only if its decision keeps it
                        assert alpha[h, t + 1] <= 0


def test_logistic_noise_and_straight_through_decisions():
    gen = torch.Generator().manual_seed(0)
    noise = logistic_noise((400_000,), gen, "cpu")
    assert abs(float((noise > 5).float().mean()) - 1 / (1 + math.exp(5))) < 1e-3  # P(L > 5) = sigmoid(-5)
    assert abs(float(noise.mean())) < 0.02 and abs(float(noise.var()) - math.pi ** 2 / 3) < 0.05
    config = DMSConfig(tau=0.5)
    alpha = torch.tensor([[[0.0, 1.0, -1.0, 0.2]]], requires_grad=True)
    state = DMSTrainForward(config, noise=False)
    state.add_gate(0, alpha)
    d = state.records[0].decisions
    assert d.tolist() == [[[1.0, 0.0, 1.0]]]  # hard forward values: sigmoid(z / tau) > 1/2
    d.sum().backward()
    z = alpha.detach()[0, 0, 1:] / 0.5
    torch.testing.assert_close(alpha.grad[0, 0, 1:], torch.sigmoid(z) * (1 - torch.sigmoid(z)) / 0.5)
    assert alpha.grad[0, 0, 0] == 0  # the first logit decides no key


def test_compression_hinge_hand_computed():
    def rec(rows):
        d = torch.tensor(rows, dtype=torch.float32)  # [B, H, T-1]
        return DMSRecord(alpha=d, z=d, decisions=d)

    # layer 0: row 0 closes 4/4, row 1 1/4; layer 1: row 0 2/4, row 1 1/4  -> closed = [0.75, 0.25]
    records = {0: rec([[[1, 1], [1, 1]], [[1, 0], [0, 0]]]), 1: rec([[[1, 0], [0, 1]], [[0, 0], [1, 0]]])}
    loss, closed, _ = compression_loss(records, target=0.5)
    assert float(loss) == pytest.approx((0.0 + 0.25) / 2)  # one-sided: row 0 over-compresses for free
    assert closed == pytest.approx(0.5)
    loss, _, _ = compression_loss(records, target=0.2)
    assert float(loss) == 0.0
    # per head: layer 0 row 0 heads close 1, 1; row 1 0.5, 0; layer 1 row 0 0.5, 0.5; row 1 0, 0.5 -> with target
    # 0.5 the gaps are 0, 0, 0, 0.5, 0, 0, 0.5, 0 over the 8 (layer, row, head): a head over the target pays nothing
    # for one under it, unlike the model scope, where row 0's closing heads cover row 0's open ones
    loss, closed, per_head = compression_loss(records, target=0.5, scope="head")
    assert float(loss) == pytest.approx(1.0 / 8) and closed == pytest.approx(0.5)
    assert per_head.tolist() == [[[1.0, 1.0], [0.5, 0.0]], [[0.5, 0.5], [0.0, 0.5]]]  # [layer][row][KV head]
    assert not per_head.requires_grad
    lopsided = {0: rec([[[1, 1], [0, 0]]])}  # one row, two heads: the first closes everything, the second nothing
    assert float(compression_loss(lopsided, target=0.5)[0]) == 0.0
    assert float(compression_loss(lopsided, target=0.5, scope="head")[0]) == pytest.approx(0.25)
    with pytest.raises(KVLearnError, match="scope='layer' is invalid"):
        compression_loss(records, target=0.5, scope="layer")
    ramp = DMSConfig(target_cr=4.0, ramp_fraction=0.5)
    assert ramp.target_fraction(0.0) == 0.0
    assert ramp.target_fraction(0.25) == pytest.approx(1 - 1 / 2.5)
    assert ramp.target_fraction(0.5) == ramp.target_fraction(1.0) == pytest.approx(0.75)


def test_gate_parameter_counts_and_matching():
    for m in (0, 7, 32):
        gate = DMSGate(64, 2, m)
        assert sum(p.numel() for p in gate.parameters()) == gate_parameter_count(64, 2, m)
        assert float(gate(torch.randn(2, 5, 64)).detach().abs().sub(5).abs().max()) == 0  # zero-initialised: -5 everywhere
    from kvlearn.kvpop.scorers import MLPScorer

    assert kvpop_mlp_parameter_count(2, 32) == sum(p.numel() for p in MLPScorer(2, 32).parameters())
    target = kvpop_mlp_parameter_count(2, 32)  # the testbed teacher: hidden 256, 2 KV heads, head_dim 32
    m = matched_gate_hidden(256, 2, target)
    assert m == 32 and abs(gate_parameter_count(256, 2, m) - target) <= 259 // 2 + 1


def test_save_and_load_round_trip(tmp_path):
    config = DMSConfig(sinks=2, window=4, budget=12, gate_hidden=8)
    model = apply_dms(tiny(6), config)
    torch.manual_seed(7)
    for gate in dms_gates(model):
        torch.nn.init.normal_(gate.proj[2].weight, std=0.05)
    ids = torch.randint(1, VOCAB, (1, T))
    before, _ = cache_logits(model, config, ids, decode_chunks(8))
    model.save_pretrained(tmp_path / "ck")
    loaded = kvlearn.load(tmp_path / "ck")
    assert [g.gate_hidden for g in dms_gates(loaded)] == [8, 8]
    assert DMSConfig(**loaded.config.dms) == config
    want, got = model.state_dict(), loaded.state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, loaded(input_ids=ids).logits)
    after, _ = cache_logits(loaded, config, ids, decode_chunks(8))
    # identical weights; one-token GEMMs of two model instances may differ in the last bit (memory alignment)
    torch.testing.assert_close(after, before, atol=1e-6, rtol=0)


def one_line(err) -> str:
    message = str(err.value)
    assert message and "\n" not in message
    return message


def test_bad_input_is_one_line():
    with pytest.raises(KVLearnError) as err:
        DMSConfig(train_attention="triton")
    assert "train_attention='triton'" in one_line(err) and "flex_channel" in one_line(err)
    with pytest.raises(KVLearnError) as err:
        DMSConfig(window=0)
    assert "window=0" in one_line(err) and ">= 1" in one_line(err)
    with pytest.raises(KVLearnError) as err:
        DMSConfig(sinks=4, window=32, budget=20)
    assert "budget=20" in one_line(err) and ">= 37" in one_line(err)
    with pytest.raises(KVLearnError) as err:
        make_config("dms", budget=30, sinks=4, context=256)
    assert "budget=30" in one_line(err) and ">= 37" in one_line(err)
    with pytest.raises(KVLearnError) as err:
        make_config("dms", budget=300, sinks=4, context=256)
    assert "budget=300" in one_line(err) and "context = 256" in one_line(err)
    for bad in (dict(tau=0), dict(target_cr=0.5), dict(ramp_fraction=0), dict(gate_hidden=-1),
                dict(compression_scope="layer"), dict(overflow_evicts="lowest_logit")):
        with pytest.raises(KVLearnError) as err:
            DMSConfig(**bad)
        name, value = next(iter(bad.items()))
        assert f"{name}={value!r}" in one_line(err)
    with pytest.raises(KVLearnError) as err:
        get_method("dmz")
    assert "'dmz'" in one_line(err) and "dms" in one_line(err)
    model = apply_dms(tiny(), DMSConfig())
    with pytest.raises(KVLearnError) as err:
        make_dms_cache(model)  # the recorded config has no budget
    assert "budget" in one_line(err)
    plain = kvlearn.attach(tiny())
    cache = make_dms_cache(model, DMSConfig(budget=40))
    with pytest.raises(KVLearnError) as err:
        plain(input_ids=torch.ones(1, 3, dtype=torch.long), past_key_values=cache, use_cache=True)
    assert "no DMS gates" in one_line(err)


def test_registry_entry():
    m = get_method("dms")
    assert m.protocols == ("bounded", "context") and m.apply is not None
    config = make_config("dms", budget=48, sinks=4, context=256)
    assert (config.sinks, config.window, config.budget, config.topk) == (4, 32, 48, 12)


def _attention_inputs(device, requires_grad=False):
    torch.manual_seed(11)
    B, Hq, Hkv, T, D = 2, 4, 2, 200, 16  # T > 128: more than one flex block
    q, k, v = (torch.randn(B, h, T, D, device=device, requires_grad=requires_grad) for h in (Hq, Hkv, Hkv))
    z = (torch.randn(B, Hkv, T, device=device) * 3).requires_grad_(requires_grad)
    return q, k, v, z


def test_auto_backend_is_the_penalty_channel_on_cuda_and_dense_elsewhere():
    from kvlearn.dms.attention import resolve_backend

    assert resolve_backend("auto", "cuda", hard=False) == "flex_channel"  # 1.57x vs the score_mod's 2.21x (H200)
    assert resolve_backend("auto", "cuda", hard=True) == "flex"  # a -inf penalty cannot ride in a key channel
    assert resolve_backend("auto", "cpu", hard=False) == "dense"  # no FlexAttention backward on the CPU
    assert resolve_backend("flex", "cuda", hard=False) == "flex"  # an explicit choice stays
    with pytest.raises(KVLearnError) as err:
        resolve_backend("triton", "cuda", hard=False)
    assert "backend='triton'" in one_line(err) and "flex_channel" in one_line(err)


@pytest.mark.parametrize("backend", ["flex", "flex_channel"])
@pytest.mark.parametrize("hard", [False, True])
def test_flex_execution_equals_the_dense_bias_forward(hard, backend):
    from kvlearn.dms.attention import dms_attention

    q, k, v, z = _attention_inputs("cpu")
    with torch.no_grad():  # FlexAttention has no CPU backward
        dense = dms_attention(q, k, v, z, 3, 17, hard=hard, backend="dense")
        flex = dms_attention(q, k, v, z, 3, 17, hard=hard, backend=backend)
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)
    with pytest.raises(KVLearnError) as err:
        dms_attention(q, k, v, z, 3, 17, backend="triton")
    assert "backend='triton'" in one_line(err)


def test_penalty_channel_masks_cover_each_causal_key_once():
    """The two key copies of :func:`penalty_channel_inputs`: copy 1 holds exactly the keys :func:`dms_bias` penalises
    (written out by hand: k >= sinks and q - k >= window, causal), copy 0 the other causal keys, none twice."""
    from kvlearn.dms.attention import penalty_channel_inputs

    T, sinks, window = 23, 3, 5
    x = torch.zeros(1, 1, T, 4)
    *_, mask_mod = penalty_channel_inputs(x, x, x, torch.zeros(1, 1, T), sinks, window, 0.5)
    q, kv = torch.arange(T)[:, None], torch.arange(2 * T)[None, :]
    mask = mask_mod(None, None, q, kv)
    for qi in range(T):
        for k in range(T):
            penalised = k <= qi and k >= sinks and qi - k >= window
            assert bool(mask[qi, T + k]) == penalised, (qi, k)
            assert bool(mask[qi, k]) == (k <= qi and not penalised), (qi, k)


def test_channel_block_mask_is_built_once_per_shape():
    """The channel's BlockMask is cached per (T, sinks, window, device): the same object for the same shape, another
    one for another window, and its blocks are those where the mask_mod keeps a cell."""
    from kvlearn.dms.attention import channel_block_mask, channel_mask_mod

    a = channel_block_mask(200, 3, 17, "cpu")
    assert channel_block_mask(200, 3, 17, "cpu") is a and channel_block_mask(200, 3, 18, "cpu") is not a
    dense = channel_mask_mod(200, 3, 17)(None, None, torch.arange(256)[:, None], torch.arange(512)[None, :])
    dense[200:] = False  # padding rows and columns of the last blocks
    dense[:, 400:] = False
    blocks = dense.reshape(2, 128, 4, 128).any(dim=3).any(dim=1)  # a 128 x 128 block is visited iff any cell is kept
    assert a.shape[-2:] == (200, 400) and torch.equal(a.to_dense()[0, 0].bool(), blocks)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_penalty_channel_equals_the_dense_bias_with_gradients(dtype):
    """The penalty as a key channel over two key copies (a dense mask here, FlexAttention's ``mask_mod`` on CUDA)
    against the materialised bias: same output and same gradients for query, key, value and the gate logits, GQA
    (4 query heads over 2 KV heads), T = 200 over a window of 17 and 3 sinks."""
    from kvlearn.dms.attention import dms_attention

    q, k, v, z = (x.detach().to(dtype).requires_grad_() for x in _attention_inputs("cpu"))
    outs = [dms_attention(q, k, v, z, 3, 17, backend=b) for b in ("dense", "dense_channel")]
    grads = [torch.autograd.grad((o * torch.linspace(-1, 1, o.shape[-1], dtype=dtype)).square().sum(), (q, k, v, z))
             for o in outs]
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-10, rtol=1e-10)
    f32 = dict(atol=1e-5, rtol=1e-5)  # the penalty is computed in float32 (dms_penalty), so z's gradient is float32's
    torch.testing.assert_close(outs[1], outs[0], **tol)
    for name, g_channel, g_dense in zip("qkvz", grads[1], grads[0]):
        torch.testing.assert_close(g_channel, g_dense, **(f32 if name == "z" else tol), msg=name)
    assert grads[1][3].abs().sum() > 0


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["flex", "flex_channel"])
def test_flex_execution_equals_the_dense_bias_with_gradients_on_cuda(backend):
    from kvlearn.dms.attention import dms_attention

    q, k, v, z = _attention_inputs("cuda", requires_grad=True)
    outs = [dms_attention(q, k, v, z, 3, 17, backend=b) for b in ("dense", backend)]
    grads = [torch.autograd.grad(o.square().sum(), (q, k, v, z)) for o in outs]
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)
    for g_flex, g_dense in zip(grads[1], grads[0]):
        torch.testing.assert_close(g_flex, g_dense, atol=1e-3, rtol=1e-3)
    assert grads[1][3].abs().sum() > 0  # the gate logits get gradient (the channel's key gradient or the score_mod)


def test_the_harness_evaluates_a_checkpoint_with_a_wider_gate(tmp_path):
    model = apply_dms(tiny(8), DMSConfig(sinks=2, window=4, budget=12, gate_hidden=8))
    model.save_pretrained(tmp_path / "ck")
    loaded = kvlearn.load(tmp_path / "ck")
    method = get_method("dms")
    config = make_config("dms", budget=20, sinks=2, context=64, window=4)  # gate_hidden defaults to 0
    method.prepare(loaded, config)
    assert loaded.config.dms["gate_hidden"] == 8 and loaded.config.dms["budget"] == 20
    with pytest.raises(KVLearnError) as err:  # the direct API stays strict
        apply_dms(loaded, DMSConfig(gate_hidden=4))
    assert "gate_hidden=4" in one_line(err) and "gate_hidden=8" in one_line(err)


def test_left_padded_batch_equals_rows_alone():
    """Padding columns are skipped by the shift (by position): each padded row generates with the logits it has
    alone, at a binding budget."""
    config = DMSConfig(sinks=2, window=4, budget=9)
    model = dms_model(config, seed=9)
    lengths = [30, 21, 12]
    t = max(lengths)
    torch.manual_seed(3)
    rows = [torch.randint(1, VOCAB, (n,)) for n in lengths]
    ids = torch.zeros(3, t, dtype=torch.long)
    am = torch.zeros(3, t, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, t - len(r):] = r
        am[i, t - len(r):] = 1
    kw = dict(max_new_tokens=10, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)
    with torch.no_grad():
        batch = model.generate(input_ids=ids, attention_mask=am, past_key_values=make_dms_cache(model, config), **kw)
    for i, r in enumerate(rows):
        with torch.no_grad():
            solo = model.generate(input_ids=r[None], past_key_values=make_dms_cache(model, config), **kw)
        assert batch.sequences[i, t:].tolist() == solo.sequences[0, len(r):].tolist()
        for step_batch, step_solo in zip(batch.logits, solo.logits):
            torch.testing.assert_close(step_batch[i], step_solo[0], atol=1e-4, rtol=1e-4)


def test_padding_inside_a_row_is_skipped_by_the_shift():
    """Pad columns in the middle of a row and at a chunk boundary: the decision of the last real token before them
    comes from the first real token after them (positions, not columns)."""
    config = DMSConfig(sinks=2, window=4, budget=10)
    model = dms_model(config, seed=10)
    torch.manual_seed(4)
    row = torch.randint(1, VOCAB, (1, 30))
    ref, _ = masked_logits(model, config, row,
                           keep_mask=lambda alpha: reference_keep(alpha, config.sinks, config.window, 10))
    pads = {0, 1, 9, 10, 11, 16, 17}  # two on the left, three mid-chunk, two that open the second chunk
    n = 30 + len(pads)
    real = torch.tensor([c not in pads for c in range(n)])
    ids = torch.zeros(1, n, dtype=torch.long)
    ids[0, real] = row[0]
    am = real.long()[None]
    pos = (am.cumsum(1) - 1).clamp(min=0)
    cache = make_dms_cache(model, config)
    out = []
    with torch.no_grad():
        for a, b in [(0, 16), (16, 25)] + [(c, c + 1) for c in range(25, n)]:
            out.append(model(input_ids=ids[:, a:b], attention_mask=am[:, :b], position_ids=pos[:, a:b],
                             past_key_values=cache, use_cache=True).logits)
    got = torch.cat(out, 1)[:, real]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("budget", [10, T + 1])
def test_context_protocol_keeps_what_the_rule_keeps_at_the_last_query(budget):
    """A dense forward (``cache.dense()``, the context protocol) compresses once: the held positions per KV head are
    the keys the brute-force rule shows the last query, on the gate logits of that dense forward."""
    config = DMSConfig(sinks=2, window=4, budget=budget)
    model = dms_model(config, seed=12)
    ids = torch.randint(1, VOCAB, (2, T))
    causal = lambda alpha: torch.ones(*alpha.shape, T, dtype=torch.bool).tril()  # noqa: E731
    _, state = masked_logits(model, config, ids, keep_mask=causal)  # dense forward: its gate logits
    cache = make_dms_cache(model, config)
    with torch.no_grad(), cache.dense():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    for i, layer in enumerate(cache.layers):
        want = reference_keep(state.records[i].alpha, config.sinks, config.window, budget)[:, :, -1]  # [B, H, T]
        for b in range(2):
            for h in range(2):
                held = sorted(p for p in layer.slot_positions[b, h].tolist() if p >= 0)
                assert held == torch.nonzero(want[b, h]).flatten().tolist(), (i, b, h)


def test_eval_command_serves_and_records_the_overflow_order(teacher_path, tmp_path, capsys):
    """``kvlearn eval --method dms --dms-overflow oldest`` serves a checkpoint under that order and records it in
    each row; the option is refused for another method, with its name in the message."""
    from kvlearn.cli import main

    model = apply_dms(kvlearn.load(teacher_path), DMSConfig(sinks=4, window=16, budget=48))
    torch.manual_seed(5)
    for gate in dms_gates(model):
        torch.nn.init.normal_(gate.proj.weight, std=0.01)
    model.save_pretrained(tmp_path / "ck")
    out = tmp_path / "rows.json"
    args = ["eval", "--model", str(tmp_path / "ck"), "--method", "dms", "--budget", "40", "--context", "256",
            "--tasks", "vt", "--n-per-task", "2", "--batch-size", "2", "--device", "cpu"]
    assert main(args + ["--dms-overflow", "oldest", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["options"]["overflow_evicts"] == "oldest" and row["budget"] == 40
    # the cache is built from that config, not only the row: the option reaches DMSConfig
    from kvlearn.cli import _eval_config, build_parser

    parsed = build_parser().parse_args(args + ["--dms-overflow", "newest"])
    config = _eval_config(parsed, "dms", 40, ("vt",))
    assert config.method_config.overflow_evicts == "newest" and config.method_config.budget == 40
    with pytest.raises(SystemExit):
        main(["eval", "--method", "dms", "--budget", "40", "--dms-overflow", "first"])
    capsys.readouterr()
    code = main(["eval", "--model", teacher_path, "--method", "streaming", "--budget", "40", "--context", "256",
                 "--dms-overflow", "oldest"])
    err = capsys.readouterr().err
    assert code != 0 and "--dms-overflow is for --method dms" in err and "--method streaming" in err
