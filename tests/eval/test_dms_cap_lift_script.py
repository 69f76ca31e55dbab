"""benchmarks/dms_cap_lift.py on a tiny DMS checkpoint (testbed vocabulary, GQA 2 KV heads x 2 query heads, random
gates that keep most tokens, so a small budget binds): every layer lifted serves exactly as the plain cache at the
lifted budget; one layer lifted holds in that layer what the uncapped cache holds there and caps the others; the
rows are ``kvlearn eval``'s (the checkpoint's trained window) with the lifted layers named; bad input is one line."""

import json

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import kvlearn
from kvlearn.config import DMSConfig
from kvlearn.dms.apply import apply_dms, dms_gates
from kvlearn.errors import KVLearnError
from kvlearn.eval.accuracy import EvalConfig
from kvlearn.methods import get_method
from kvlearn.testbed.tokenizer import VOCAB_SIZE
from benchmark_loader import load_benchmark

WINDOW, BUDGET, CONTEXT = 24, 64, 256


def checkpoint(path):
    torch.manual_seed(7)
    cfg = Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      pad_token_id=0, tie_word_embeddings=True)
    model = apply_dms(Qwen3ForCausalLM(cfg), DMSConfig(sinks=4, window=WINDOW, budget=BUDGET))
    for gate in dms_gates(model):  # alpha = 100 * proj - 5: small weights keep most tokens
        torch.nn.init.normal_(gate.proj.weight, std=0.01)
    model.save_pretrained(path)
    return str(path)


def run(model, config, ids, decode=6):
    """Prefill ``ids [1, T]`` then ``decode`` greedy tokens through ``config``'s cache; returns (logits of every
    forward, the cache)."""
    cache = config.make_cache(model)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    logits = [out.logits[:, -1]]
    for _ in range(decode):
        nxt = logits[-1].argmax(-1, keepdim=True)
        out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
    return torch.cat(logits), cache


def held(cache, layer):
    """Sorted held positions of one layer, per KV head."""
    pos = cache.layers[layer].slot_positions[0]
    return [sorted(int(p) for p in row if p >= 0) for row in pos]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    script = load_benchmark("dms_cap_lift")
    ck = checkpoint(tmp_path_factory.mktemp("capl") / "ck")
    model = kvlearn.load(ck, dtype=torch.float32)
    options = {"window": WINDOW}
    get_method("dms").prepare(model, EvalConfig(method="dms", budget=BUDGET, context=CONTEXT,
                                                options=options).method_config)
    ids = torch.randint(3, VOCAB_SIZE, (1, 200), generator=torch.Generator().manual_seed(1))
    return script, ck, model, options, ids


def test_every_layer_lifted_equals_the_plain_cache_at_the_lifted_budget(setup):
    script, _, model, options, ids = setup
    lifted = script.LiftedEvalConfig(method="dms", budget=BUDGET, context=CONTEXT, options=options, lifted=(0, 1),
                                     lifted_budget=CONTEXT - 1)
    plain = EvalConfig(method="dms", budget=CONTEXT - 1, context=CONTEXT, options=options)
    with torch.inference_mode():
        a, ca = run(model, lifted, ids)
        b, cb = run(model, plain, ids)
    assert torch.equal(a, b)
    assert held(ca, 1) == held(cb, 1)


def test_one_layer_lifted_holds_what_the_uncapped_cache_holds_there(setup):
    script, _, model, options, ids = setup
    one = script.LiftedEvalConfig(method="dms", budget=BUDGET, context=CONTEXT, options=options, lifted=(0,),
                                  lifted_budget=CONTEXT - 1)
    uncapped = EvalConfig(method="dms", budget=CONTEXT - 1, context=CONTEXT, options=options)
    capped = EvalConfig(method="dms", budget=BUDGET, context=CONTEXT, options=options)
    with torch.inference_mode():
        _, c_one = run(model, one, ids)
        _, c_unc = run(model, uncapped, ids)
        _, c_cap = run(model, capped, ids)
    # layer 0 sees the same inputs in every run: lifted, it holds the uncapped set, more than the capped one
    assert held(c_one, 0) == held(c_unc, 0)
    assert all(len(u) > BUDGET for u in held(c_unc, 0))  # the cap binds on this model
    assert held(c_cap, 0) != held(c_unc, 0)
    # layer 1 stays capped, under the checkpoint's window
    assert c_one.layers[1].capacity == BUDGET and c_one.layers[0].capacity == CONTEXT - 1
    assert all(len(h) <= BUDGET for h in held(c_one, 1))
    assert one.method_config.window == WINDOW


def test_main_writes_eval_rows_with_the_lifted_layers(setup, tmp_path):
    script, ck, _, _, _ = setup
    out = tmp_path / "lift.json"
    assert script.main(["--model", ck, "--budget", str(BUDGET), "--lift", "none,1,all", "--tasks", "niah",
                        "--n-per-task", "2", "--context", str(CONTEXT), "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["lifted_layers"] for r in rows] == [[], [1], [0, 1]]
    assert all(r["budget"] == BUDGET and r["lifted_budget"] == CONTEXT - 1 and r["n"] == 2 for r in rows)
    assert all(r["options"] == {"window": WINDOW} for r in rows)


@pytest.mark.parametrize("lift, words", [("7", "outside 0 to 1"), ("1+x", "'1+x' is invalid"), (",", "names no layer")])
def test_bad_lift_is_one_line(setup, capsys, lift, words):
    script, ck, _, _, _ = setup
    assert script.main(["--model", ck, "--lift", lift, "--context", str(CONTEXT), "--tasks", "niah"]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]  # after transformers' loading bar
    assert last.startswith("dms_cap_lift: error: ") and words in last


def test_a_lifted_budget_over_the_context_is_refused(setup):
    script, _, _, options, _ = setup
    with pytest.raises(KVLearnError, match="budget"):
        script.LiftedEvalConfig(method="dms", budget=BUDGET, context=CONTEXT, options=options, lifted=(0,),
                                lifted_budget=CONTEXT + 10)
    with pytest.raises(KVLearnError, match="DMS students only"):
        script.LiftedEvalConfig(method="streaming", budget=BUDGET, context=CONTEXT)
