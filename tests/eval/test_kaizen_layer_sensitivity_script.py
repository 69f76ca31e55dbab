"""benchmarks/kaizen_layer_sensitivity.py on the tiny random GQA teacher of conftest (2 layers, 2 KV heads): its configurations, its measures against a
hand-computed case, and a run whose all16 row is the plain model (the script asserts the logits agree)."""

import json

import pytest
import torch
from transformers import Qwen3ForCausalLM

from benchmark_loader import load_benchmark

bench = load_benchmark("kaizen_layer_sensitivity")


def test_configurations_cover_every_layer_once():
    names = [n for n, _ in bench.configurations(3)]
    assert names == ["all16", "all4", "all4+share1", "all4+share2", "all4+b2@0", "all4+b2@1", "all4+b2@2"]
    for name, actions in bench.configurations(3):
        assert len(actions) == 3 and not actions[0].share  # layer 0 never shares
        assert sum(a.share for a in actions) == (1 if "share" in name else 0)


def test_measure_by_hand():
    # two rows, vocabulary 3; row 0 supervises positions 1 and 2 (predicted at 0 and 1), row 1 position 2
    labels = torch.tensor([[-100, 2, 0], [-100, -100, 1]])
    logits = torch.full((2, 3, 3), -5.0)
    logits[0, 0, 2] = logits[0, 1, 1] = logits[1, 1, 1] = 5.0  # row 0: right then wrong; row 1: right
    m = bench.measure(logits, logits.clone(), labels)
    assert m["token"] == pytest.approx(2 / 3) and m["answer"] == pytest.approx(0.5) and m["kd"] == pytest.approx(0.0)


def test_runs_on_a_tiny_model(tmp_path, teacher_path):
    out = tmp_path / "s.json"
    assert bench.main(["--model", teacher_path, "--families", "niah", "--formats", "eval,dense", "--n", "2",
                       "--context", "256", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * 5  # two formats x (all16, all4, share1, b2@0, b2@1)
    for r in rows:
        assert 0 <= r["token"] <= 1 and 0 <= r["answer"] <= 1 and r["kd"] >= 0
    assert {r["factor"] for r in rows if r["config"] == "all4"} == {4.0}
    # all16 is the plain model: its kd is only the top-256 truncation, -log(top-256 mass), computed here directly
    from kvlearn.testbed.data import example_labels
    from kvlearn.testbed.tasks import example_seed, generate

    model = Qwen3ForCausalLM.from_pretrained(teacher_path).eval()
    examples = [generate("niah", example_seed("niah", "eval", i), 256) for i in range(2)]
    ids = torch.tensor([e.prompt_ids + e.answer_ids for e in examples])
    labels = torch.tensor([example_labels(e) for e in examples])
    with torch.no_grad():
        probs = model(input_ids=ids).logits.float().softmax(-1)[:, :-1]
    mass = probs.topk(256, dim=-1).values.sum(-1)
    mask = labels[:, 1:] != -100
    want = (-mass.log())[mask].mean().item()
    all16 = [r for r in rows if r["config"] == "all16" and r["format"] == "eval"][0]
    assert all16["kd"] == pytest.approx(want, rel=1e-3, abs=1e-5)
    pred = probs.argmax(-1)
    assert all16["token"] == pytest.approx(((pred == labels[:, 1:]) & mask).sum().item() / mask.sum().item(), abs=1e-5)


def test_bad_family_is_a_one_line_error(capsys):
    assert bench.main(["--families", "nope"]) == 2
    assert "unknown family 'nope': expected one of trace, niah, vt, recall" in capsys.readouterr().err


def test_given_configurations_are_measured_after_all16(tmp_path, teacher_path, capsys):
    """``--configurations`` replaces the default set: all16 first, then each given one under its own name, with the
    factor the cost model gives it (2 layers: 'b4 share' keeps 4 of 32 bits per token pair, 8x; 'b8 b8' 2x);
    a bad word or the wrong number of layers is one line."""
    out = tmp_path / "c.json"
    assert bench.main(["--model", teacher_path, "--families", "niah", "--formats", "eval", "--n", "1",
                       "--context", "256", "--configurations", "b4 share; b8  b8", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["config"], r["factor"]) for r in rows] == [("all16", 1.0), ("b4 share", 8.0), ("b8 b8", 2.0)]
    capsys.readouterr()
    assert bench.main(["--model", teacher_path, "--configurations", "b4 b4 b4"]) == 2
    assert "kaizen_layer_sensitivity: error:" in capsys.readouterr().err
    assert bench.main(["--model", teacher_path, "--configurations", "b4 sharing"]) == 2
    assert "'sharing' is invalid" in capsys.readouterr().err
