"""The demo's two-panel plot, the Pareto plot and `kvlearn demo` end to end on a tiny checkpoint."""

import json

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from kvlearn.cli import main
from kvlearn.eval.plots import mean_accuracy, plot_accuracy, plot_pareto
from kvlearn.testbed.tokenizer import VOCAB_SIZE


def rows():
    out = []
    for method, budget, cr, kv, accs in (("dense", 4096, 0.0, 16e6, (1.0, 1.0)), ("streaming", 1024, 0.75, 4e6, (0.0, 0.5))):
        for protocol in ("bounded", "context"):
            for task, acc in zip(("niah", "vt"), accs):
                out.append(dict(method=method, protocol=protocol, split="eval", budget=budget, compression=cr, context=4096,
                                task=task, accuracy=acc, n=6, kv_bytes=int(kv), incomplete=protocol == "context"))
    return out


def test_accuracy_plot_handles_exact_zeros_and_ones(tmp_path):
    r = [x for x in rows() if x["protocol"] == "bounded"]
    assert plot_accuracy(r, tmp_path / "a.png").stat().st_size > 5000


def test_pareto_plot_and_its_means(tmp_path):
    agg = mean_accuracy(rows())
    assert agg[("eval", "streaming", "bounded", 1024)]["accuracy"] == 0.25
    assert agg[("eval", "streaming", "context", 1024)]["incomplete"] is True
    assert plot_pareto(rows(), tmp_path / "p.png").stat().st_size > 5000


def test_demo_end_to_end_on_a_tiny_checkpoint(tmp_path, capsys):
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                                 pad_token_id=0)).save_pretrained(tmp_path / "tiny")
    out, plot = tmp_path / "d" / "demo.json", tmp_path / "d" / "demo.png"
    code = main(["demo", "--model", str(tmp_path / "tiny"), "--context", "256", "--budget", "64", "--n-per-task", "1",
                 "--tasks", "niah,vt", "--device", "cpu", "--out", str(out), "--plot", str(plot)])
    assert code == 0
    data = json.loads(out.read_text())
    assert [(r["method"], r["task"]) for r in data["rows"]] == [("dense", "niah"), ("dense", "vt"), ("streaming", "niah"), ("streaming", "vt")]
    assert data["wall_seconds"] > 0 and data["split"] == "eval" and data["protocol"] == "bounded"
    assert plot.stat().st_size > 5000
    assert "wall time" in capsys.readouterr().out


def test_eval_command_writes_protocol_and_split_rows(tmp_path, capsys):
    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                                 pad_token_id=0)).save_pretrained(tmp_path / "tiny")
    out = tmp_path / "e.json"
    code = main(["eval", "--model", str(tmp_path / "tiny"), "--method", "streaming", "--budget", "48", "--protocol",
                 "context", "--context", "256", "--n-per-task", "2", "--batch-size", "2", "--tasks", "recall",
                 "--device", "cpu", "--out", str(out), "--plot", str(tmp_path / "e.png")])
    assert code == 0
    data = json.loads(out.read_text())
    (row,) = data["rows"]
    assert (row["method"], row["protocol"], row["split"], row["budget"], row["n"]) == ("streaming", "context", "eval", 48, 2)
    assert data["protocol"] == "context" and (tmp_path / "e.png").exists()
