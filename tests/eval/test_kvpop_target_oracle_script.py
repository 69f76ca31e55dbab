"""benchmarks/kvpop_target_oracle.py: its brute-force future statistics give the library's target (every aggregation
and normalisation), its peak is the largest future probability recounted by hand, an arm's attention equals softmax
attention under a by-hand retention (sinks, window, top-k of ``target - t log γ`` among the eligible tokens), a
budget that keeps everything gives the dense logits, and the script runs and rejects bad arguments in one line.
GQA: 2 KV heads x 2 query heads."""

import json
import math

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from kvlearn.ops.future_target import causal_lse, future_attention_target
from kvlearn.testbed.tokenizer import VOCAB_SIZE
from benchmark_loader import load_benchmark



def load_script():
    return load_benchmark("kvpop_target_oracle")


def qkv(T=48, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 4, T, D, generator=g), torch.randn(1, 2, T, D, generator=g),
            torch.randn(1, 2, T, D, generator=g))


def probabilities(q, k, scale):
    """Dense causal probabilities ``[B, Hq, T, T]`` (query head i reads KV head i // 2)."""
    T = q.shape[2]
    logits = scale * q @ k.repeat_interleave(2, 1).transpose(-1, -2)
    logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(logits, -1)


@pytest.mark.parametrize("aggregation,count", [("max", "1"), ("mean", "1"), ("max", "0"), ("mean", "0")])
def test_statistics_give_the_library_target(aggregation, count):
    script = load_script()
    q, k, _ = qkv()
    scale, w = 1 / math.sqrt(8), 5
    mass, peak = script.future_statistics(q, k, w, scale)
    mine = script.arm_target(f"{aggregation}:{count}:1", mass, peak, 2, w, 1e-6)
    lib = future_attention_target(q, k, causal_lse(q, k, scale=scale), w, eps=1e-6, aggregation=aggregation,
                                  count_normalize=count == "1", scale=scale)
    torch.testing.assert_close(mine.exp(), lib.exp(), atol=1e-6, rtol=1e-4)


def test_peak_is_the_largest_future_probability():
    script = load_script()
    q, k, _ = qkv(T=32)
    scale, w = 1 / math.sqrt(8), 3
    _, peak = script.future_statistics(q, k, w, scale)
    p = probabilities(q, k, scale)
    T = q.shape[2]
    for i in range(4):
        for t in range(T):
            future = [float(p[0, i, d, t]) for d in range(t + w, T)]
            assert abs(float(peak[0, i, t]) - max(future, default=0.0)) < 1e-6
    target = script.arm_target("maxq:-:1", *script.future_statistics(q, k, w, scale), 2, w, 1e-6)
    torch.testing.assert_close(target.exp() - 1e-6, peak.view(1, 2, 2, T).amax(2), atol=1e-6, rtol=1e-5)
    lib = future_attention_target(q, k, causal_lse(q, k, scale=scale), w, eps=1e-6, scale=scale, reduction="peak")
    torch.testing.assert_close(target, lib, atol=1e-5, rtol=1e-5)  # the library's peak target is this arm


class Layer(torch.nn.Module):
    layer_idx = 0


def by_hand_keep(prio, sinks, window, topk):
    """bool ``[Hkv, T, T]``: sinks, the ``window`` newest keys, and the ``topk`` highest-priority eligible keys
    ``sinks <= t <= q - window``."""
    H, T = prio.shape
    keep = torch.zeros(H, T, T, dtype=torch.bool)
    for h in range(H):
        for q in range(T):
            for t in range(q + 1):
                keep[h, q, t] = t < sinks or t > q - window
            eligible = list(range(sinks, q - window + 1))
            for t in sorted(eligible, key=lambda t: -float(prio[h, t]))[:topk]:
                keep[h, q, t] = True
    return keep


@pytest.mark.parametrize("arm", ["max:1:0.99", "maxq:-:1", "streaming"])
def test_an_arm_attends_under_the_by_hand_retention(arm):
    script = load_script()
    q, k, v = qkv(T=40, seed=1)
    scale, sinks, window, topk = 1 / math.sqrt(8), 2, 6, 7
    mass, peak = script.future_statistics(q, k, window, scale)
    plans = script.arm_plans(arm, {0: (mass, peak)}, 2, sinks, window, topk, 1e-6)
    w = window + topk if arm == "streaming" else window
    out, _ = script.oracle_attention(Layer(), q, k, v, None, scaling=scale,
                                     oracle=script.OracleForward("plan", window, plans, (sinks, w, topk)))
    if arm == "streaming":
        prio = torch.zeros(2, 40)
        keep = by_hand_keep(prio, sinks, window + topk, 0)
    else:
        gamma = float(arm.split(":")[2])
        prio = script.arm_target(arm, mass, peak, 2, window, 1e-6)[0] - torch.arange(40) * math.log(gamma)
        keep = by_hand_keep(prio, sinks, window, topk)
    logits = scale * q @ k.repeat_interleave(2, 1).transpose(-1, -2)
    logits = logits.masked_fill(~keep.repeat_interleave(2, 0)[None], float("-inf"))
    want = torch.softmax(logits, -1) @ v.repeat_interleave(2, 1)
    torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-5, rtol=1e-4)


def tiny_model(path):
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      pad_token_id=0, tie_word_embeddings=True)
    Qwen3ForCausalLM(cfg).save_pretrained(path)
    return str(path)


def test_a_budget_that_keeps_everything_gives_the_dense_logits(tmp_path):
    script = load_script()
    import kvlearn
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import sdpa_mask

    model = kvlearn.load(tiny_model(tmp_path / "m"), dtype=torch.float32, device="cpu")
    AttentionInterface.register(script.ORACLE_ATTENTION, script.oracle_attention)
    AttentionMaskInterface.register(script.ORACLE_ATTENTION, sdpa_mask)
    model.set_attn_implementation(script.ORACLE_ATTENTION)
    ids = torch.randint(5, VOCAB_SIZE, (1, 64), generator=torch.Generator().manual_seed(0))
    rec = script.OracleForward("record", 8, check_layer=0)  # also runs the in-script check against the library
    with torch.no_grad():
        dense = model(input_ids=ids, oracle=rec, use_cache=False).logits
        plans = script.arm_plans("max:1:0.999", rec.records, 2, 4, 8, 64, 1e-6)
        full = model(input_ids=ids, oracle=script.OracleForward("plan", 8, plans, (4, 8, 64)), use_cache=False).logits
        tight = script.arm_plans("max:1:0.999", rec.records, 2, 4, 8, 4, 1e-6)
        cut = model(input_ids=ids, oracle=script.OracleForward("plan", 8, tight, (4, 8, 4)), use_cache=False).logits
    torch.testing.assert_close(full, dense, atol=1e-5, rtol=1e-4)
    assert (cut - dense).abs().max() > 1e-3  # a tight budget changes the model's output


def test_script_runs_and_rejects_bad_arguments(tmp_path, capsys):
    script = load_script()
    model = tiny_model(tmp_path / "m")
    out = tmp_path / "o.json"
    assert script.main(["--model", model, "--families", "niah", "--splits", "eval", "--n", "1", "--length", "256",
                        "--budget", "64", "--window", "16", "--arms", "streaming,max:1:0.999,maxq:-:1",
                        "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert {r["arm"] for r in rows} == {"dense", "streaming", "max:1:0.999", "maxq:-:1"}
    assert all(r["n"] == 1 and r["accuracy"] in (0.0, 1.0) for r in rows)
    capsys.readouterr()
    assert script.main(["--model", model, "--families", "bogus"]) == 2
    assert "--families='bogus' is invalid" in capsys.readouterr().err
    assert script.main(["--model", model, "--budget", "8", "--window", "16"]) == 2
    assert "--budget=8" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="'max:2:0.9' is invalid"):
        script.main(["--model", model, "--arms", "max:2:0.9"])
