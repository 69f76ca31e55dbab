"""benchmarks/niah_multivalue_errors.py: its answer parsing and error classes on hand-written answers, and a run on
a tiny random model whose classes agree with the testbed's scorer (the script asserts that per prompt)."""

import json

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from benchmark_loader import load_benchmark
from kvlearn.testbed.tokenizer import VOCAB_SIZE

bench = load_benchmark("niah_multivalue_errors")


def test_groups_and_classes_by_hand():
    want = bench.groups("fox is 1 2 3 4 , fox is 5 6 7 8 , fox is 9 0 1 2 <eos>")
    assert want == ["1 2 3 4", "5 6 7 8", "9 0 1 2"]
    assert bench.classify(want, list(want)) == "right"
    assert bench.classify(want, [want[0], want[2], want[1]]) == "order"
    assert bench.classify(want, [want[0], want[1], want[0]]) == "repeated"
    assert bench.classify(want, [want[0], want[1]]) == "repeated"  # a value missing, none foreign
    assert bench.classify(want, [want[0], want[1], "7 7 7 7"]) == "other"
    assert bench.classify(want, []) == "other"


def test_runs_on_a_tiny_model_and_writes_its_counts(tmp_path):
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                 max_position_embeddings=1024, pad_token_id=0)).save_pretrained(tmp_path / "m")
    out = tmp_path / "e.json"
    assert bench.main(["--model", str(tmp_path / "m"), "--n", "12", "--context", "512", "--device", "cpu",
                       "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert sum(data["counts"].values()) == len(data["rows"]) > 0
    assert all(r["kind"] in ("right", "order", "repeated", "other") for r in data["rows"])
