"""``benchmarks/kvpop_mlstm_from_mlp.py``: an MLP KVpop student converted to an mLSTM student whose skip path is the
MLP scorer and whose readout weight is 0. Checked against the MLP student itself: the same scores for every token of
every layer and head, and the same logits through prefill + token-by-token decoding in the KVpop cache (the same
top-k: the state is left out of the budget here), on a tiny random GQA Qwen3 whose MLP scorers are non-trivial."""

import json

import pytest
import torch
from benchmark_loader import load_benchmark
from test_kvpop_cache import decode_logits
from transformers import Qwen3Config, Qwen3ForCausalLM

import kvlearn
from kvlearn import KVLearnError, KVpopConfig
from kvlearn.kvpop.apply import apply_kvpop, kvpop_modules, make_kvpop_cache

KV = dict(sinks=2, window=3, topk=4, decay_min=0.6, decay_max=0.95)  # budget 9; sequences of 30 tokens


def mlp_student(folder, seed=0):
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=71, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0)
    model = Qwen3ForCausalLM(cfg).eval()
    apply_kvpop(model, KVpopConfig(**KV, scorer="mlp"))
    scorers, decays = kvpop_modules(model)
    for sc in scorers:
        for prm in sc.parameters():  # the output layer too: a trained student's is not zero
            torch.nn.init.normal_(prm, std=1.0)
    for dc in decays:
        torch.nn.init.normal_(dc.alpha, std=1.0)
    model.save_pretrained(folder)
    return model


def test_converted_student_scores_and_decodes_as_the_mlp_student(tmp_path):
    convert = load_benchmark("kvpop_mlstm_from_mlp").convert
    mlp = mlp_student(tmp_path / "mlp")
    convert(str(tmp_path / "mlp"), str(tmp_path / "mlstm"), state_in_budget=False)
    loaded = kvlearn.load(tmp_path / "mlstm")
    assert loaded.config.kvpop["scorer"] == "mlstm" and loaded.config.kvpop["mlstm_skip"]
    assert json.loads((tmp_path / "mlstm" / "config.json").read_text())["kvpop"]["topk"] == KV["topk"]
    # backbone and decays copied exactly
    want, got = mlp.state_dict(), loaded.state_dict()
    for name, value in want.items():
        if ".kvpop.scorer." not in name:
            assert torch.equal(got[name], value), name
    # every token's score, every layer and head
    torch.manual_seed(3)
    key, value = torch.randn(2, 2, 30, 16), torch.randn(2, 2, 30, 16)
    for (s_mlp, _), (s_mlstm, _) in zip(zip(*kvpop_modules(mlp)), zip(*kvpop_modules(loaded))):
        with torch.no_grad():
            torch.testing.assert_close(s_mlstm(key, value), s_mlp(key, value), atol=1e-5, rtol=1e-5)
    # the same kept tokens, hence the same logits, through the cache
    ids = torch.randint(1, 71, (2, 30))
    torch.testing.assert_close(decode_logits(loaded, make_kvpop_cache(loaded), ids, prefill=10),
                               decode_logits(mlp, make_kvpop_cache(mlp), ids, prefill=10), atol=1e-5, rtol=1e-5)
    # with the state in the budget (Table 1's rule) the config records it, and the cache keeps fewer slots
    convert(str(tmp_path / "mlp"), str(tmp_path / "mlstm_b"), state_in_budget=True)
    assert kvlearn.load(tmp_path / "mlstm_b").config.kvpop["state_in_budget"] is True


def test_a_folder_that_is_no_mlp_student_is_one_line(tmp_path, capsys):
    bench = load_benchmark("kvpop_mlstm_from_mlp")
    mlp_student(tmp_path / "mlp")
    bench.convert(str(tmp_path / "mlp"), str(tmp_path / "mlstm"))
    with pytest.raises(KVLearnError, match="has scorer 'mlstm': expected 'mlp'"):
        bench.convert(str(tmp_path / "mlstm"), str(tmp_path / "again"))
    capsys.readouterr()
    assert bench.main(["--mlp-student", str(tmp_path / "mlstm"), "--out", str(tmp_path / "again")]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("error: --mlp-student") and "Traceback" not in err


def test_zero_readout_leaves_the_skip_path_and_graft_moves_every_scorer(tmp_path):
    """``zero_readout``: an mLSTM student (random non-trivial weights) then scores every token as ``b`` plus its skip
    path, computed here by an MLP scorer holding those weights; ``graft_scorers``: the backbone of one student, the
    scorers and decays of another, bit for bit."""
    from kvlearn.kvpop.scorers import MLPScorer

    bench = load_benchmark("kvpop_mlstm_from_mlp")
    mlp_student(tmp_path / "mlp")
    trained = bench.convert(str(tmp_path / "mlp"), str(tmp_path / "mlstm"), state_in_budget=False)
    torch.manual_seed(5)
    with torch.no_grad():
        for name, prm in trained.named_parameters():  # a "trained" student: every weight moved
            prm.add_(0.3 * torch.randn_like(prm))
    trained.save_pretrained(tmp_path / "trained")
    bench.zero_readout(str(tmp_path / "trained"), str(tmp_path / "zeroed"))
    loaded = kvlearn.load(tmp_path / "zeroed")
    key, value = torch.randn(2, 2, 30, 16), torch.randn(2, 2, 30, 16)
    for layer in loaded.model.layers:
        scorer = layer.self_attn.kvpop.scorer
        assert bool((scorer.a == 0).all())
        reference = MLPScorer(2, 16)
        with torch.no_grad():
            reference.w1.copy_(scorer.skip_w1), reference.b1.copy_(scorer.skip_b1)
            reference.w2.copy_(scorer.skip_w2), reference.b2.copy_(scorer.b)
            torch.testing.assert_close(scorer(key, value), reference(key, value), atol=1e-5, rtol=1e-5)
    assert not any(bool((layer.self_attn.kvpop.scorer.a == 0).all()) for layer in trained.model.layers)
    grafted = bench.graft_scorers(str(tmp_path / "mlstm"), str(tmp_path / "trained"), str(tmp_path / "grafted"))
    donor, base = kvlearn.load(tmp_path / "mlstm").state_dict(), trained.state_dict()
    for name, tensor in grafted.state_dict().items():
        assert torch.equal(tensor, donor[name] if ".kvpop." in name else base[name]), name
    with pytest.raises(KVLearnError, match="has scorer 'mlp': expected 'mlstm'"):
        bench.zero_readout(str(tmp_path / "mlp"), str(tmp_path / "bad"))
    with pytest.raises(KVLearnError, match="expected the same"):
        bench.graft_scorers(str(tmp_path / "mlp"), str(tmp_path / "trained"), str(tmp_path / "bad"))
