"""benchmarks/kaizen_conditioning.py: the selector's choice per target, against hand-set selectors."""

import json

import pytest
import torch
from benchmark_loader import load_benchmark

from kvlearn.kaizen.apply import KaizenMethodConfig, apply_kaizen, selector_of


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny GQA Qwen3 (2 KV heads, 2 query heads each) with an untrained selector, saved as a kaizen folder."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kvlearn.testbed.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024,
                      pad_token_id=PAD_ID, bos_token_id=BOS_ID, eos_token_id=EOS_ID, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg)
    apply_kaizen(model, KaizenMethodConfig(target=2.0))
    path = tmp_path_factory.mktemp("cond") / "sel"
    model.save_pretrained(path)
    return model, path


def test_untrained_selector_returns_the_least_compressed_choice_at_every_target(folder, tmp_path):
    _, path = folder
    out = tmp_path / "c.json"
    assert load_benchmark("kaizen_conditioning").main(
        ["--model", str(path), "--targets", "1,4", "--n-per-task", "2", "--context", "512", "--tasks", "niah,vt",
         "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["target"], r["task"]) for r in rows] == [(1.0, "niah"), (1.0, "vt"), (4.0, "niah"), (4.0, "vt")]
    for r in rows:  # init: the argmax is 16 bits everywhere, whatever the target (the FiLM layer starts at zero)
        assert r["argmax_factor"] == r["argmax_factor_min"] == r["argmax_factor_max"] == 1.0
        assert r["distinct_configurations"] == 1
    for r in rows[:2]:  # target 1: within budget, the argmax itself
        assert r["factor"] == 1.0 and r["projected"] == 0 and r["configurations"] == {"b16 b16 b16 b16": 2}
    for r in rows[2:]:  # target 4: over budget, projected onto it (the most likely configuration within 4x)
        assert r["factor"] == r["factor_min"] == 4.0 and r["projected"] == 2


def test_a_target_conditioned_selector_is_reported_per_target(folder):
    """FiLM set by hand so that log2(target) tips every layer from 16 to 4 bits: factor 1 at target 1, 4 at 4."""
    model, _ = folder
    sel = selector_of(model)
    names = [str(a) for a in sel.space]
    width = sel.film.out_features // 2
    with torch.no_grad():
        sel.head_weight.zero_()
        sel.head_bias.zero_()
        sel.head_bias[:, names.index("b16")] = 1.0
        sel.film.bias[width:] = 0.0
        sel.film.weight[width:, 0] = 1.0  # beta(t) = log2 t on every channel
        sel.head_weight[:, names.index("b4"), :] = 1.0 / width  # b4's logit = mean(h + log2 t) ~ log2 t (h ~ norm)
    rows = load_benchmark("kaizen_conditioning").conditioning_rows(model, (1.0, 4.0), ("niah",), 2, 512)
    factors = {r["target"]: r["factor"] for r in rows}
    assert factors == {1.0: 1.0, 4.0: 4.0}


def test_bad_targets_are_one_line_errors(folder, tmp_path, capsys):
    _, path = folder
    assert load_benchmark("kaizen_conditioning").main(["--model", str(path), "--targets", "0,2", "--out",
                                                       str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert "--targets '0,2' is invalid: expected a compression factor > 0 or a comma list" in err and err.count("\n") == 1
