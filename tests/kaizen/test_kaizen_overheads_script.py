"""benchmarks/kaizen_overheads.py on the CPU, and the trainer step it times:

- ``--smoke`` (a tiny random GQA Qwen3) times the selector against the dense prefill and a kaizen training step
  against a plain distillation step, and writes the results file (provenance, four rows with their settings, the
  axes and actions per layer, the ratios and the paper's values); bad input is a one-line error, never a traceback,
  and writes no file;
- :func:`~kvlearn.train.kaizen_train.kaizen_train_step` called by hand on the trainer's objects (models, multiplier,
  optimizer, batches) returns what ``kaizen_train`` logged for those steps, bit for bit (the loop is this call).
"""

import json

import pytest
import torch
from benchmark_loader import load_benchmark

from kvlearn.testbed.data import TestbedStream
from kvlearn.train.kaizen_train import (LOG_FILE, KaizenStep, KaizenTrainConfig, build_models, kaizen_train,
                                        kaizen_train_step, make_multiplier, make_optimizer)

ROWS = ["selector", "prefill_dense", "distill_dense_step", "kaizen_train_step"]


def test_smoke_writes_every_row_and_the_summary(tmp_path):
    script = load_benchmark("kaizen_overheads")
    out = tmp_path / "overheads.json"
    assert script.main(["--smoke", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    for key in ("schema", "kind", "command", "commit", "date", "device", "torch", "model_shape", "rows", "summary"):
        assert key in data, key
    assert data["command"].startswith("python benchmarks/kaizen_overheads.py --smoke")
    assert data["partial"] is False and data["smoke"] is True
    assert (data["context"], data["latency_batch"], data["seq_len"], data["batch_size"]) == (256, 1, 128, 2)
    assert data["axes"] == ["precision", "depth"] and data["actions_per_layer"] == 5  # b16 b8 b4 b2 share
    rows = {r["name"]: r for r in data["rows"]}
    assert list(rows) == ROWS
    for name, r in rows.items():
        assert "error" not in r and r["steps_timed"] == 2 and r["ms"] > 0 and r["parameters"] > 0, name
    assert rows["selector"]["part"] == rows["prefill_dense"]["part"] == "latency"
    assert rows["selector"]["context"] == 256 and rows["selector"]["batch"] == 1
    assert rows["selector"]["dtype"] == "float32" and rows["prefill_dense"]["dtype"] == "float32"  # bf16 on CUDA
    kaizen, plain = rows["kaizen_train_step"], rows["distill_dense_step"]
    assert kaizen["part"] == plain["part"] == "training" and kaizen["batch"] == plain["batch"] == 2
    assert kaizen["axes"] == ["precision", "depth"] and kaizen["actions_per_layer"] == 5 and kaizen["layers"] == 2
    assert kaizen["actions"] == ["b16", "b8", "b4", "b2", "share"]
    assert kaizen["parameters"] == plain["parameters"] + kaizen["selector_parameters"]
    assert plain["last_step"]["kd"] >= 0 and {"kd", "penalty", "beta", "factor"} <= set(kaizen["last_step"])
    summary = data["summary"]
    assert summary["selector_ms"] == rows["selector"]["ms"] and summary["prefill_ms"] == rows["prefill_dense"]["ms"]
    assert summary["selector_over_prefill"] == pytest.approx(rows["selector"]["ms"] / rows["prefill_dense"]["ms"])
    assert summary["kaizen_step_over_distill_step"] == pytest.approx(kaizen["ms"] / plain["ms"])
    assert kaizen["ratio_to_distill_dense_step"] == summary["kaizen_step_over_distill_step"]
    assert summary["paper"] == {"selector_ms": 3, "training_cost": [1.0, 1.4]}


def test_smoke_with_other_axes(tmp_path):
    out = tmp_path / "precision.json"
    assert load_benchmark("kaizen_overheads").main(["--smoke", "--axes", "precision", "--steps", "1", "--warmup", "0",
                                                    "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    kaizen = data["rows"][-1]
    assert data["axes"] == kaizen["axes"] == ["precision"] and kaizen["actions"] == ["b16", "b8", "b4", "b2"]
    assert kaizen["steps_timed"] == 1 and data["summary"]["kaizen_step_over_distill_step"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--shape", "qwen3-4b"], "--shape='qwen3-4b' is unknown: expected qwen3-0.6b, qwen3-1.7b"),
    (["--shape", "qwen3-0.6b", "--model", "checkpoints/testbed-teacher"], "--model and --shape exclude each other"),
    (["--smoke", "--axes", "precision,width"], "--axes='precision,width' is invalid"),
    (["--smoke", "--axes", "rank"], "axis 'rank' needs an MLA backbone"),
    (["--smoke", "--seq-len", "64"], "--seq-len=64 is invalid"),
    (["--smoke", "--seq-len", "20000"], "--seq-len=20000 is invalid"),
    (["--smoke", "--steps", "0"], "--steps=0 is invalid"),
    (["--smoke", "--context", "0"], "--context=0 is invalid"),
    (["--smoke", "--context", "1000"], "--context=1000 is invalid: expected an integer in [1, 512]"),
    (["--smoke", "--batch-size", "0"], "--batch-size=0 is invalid"),
    (["--model", "no/such/folder", "--device", "cpu"], "does not exist"),
])
def test_bad_input_is_one_line(tmp_path, capsys, argv, message):
    script = load_benchmark("kaizen_overheads")
    assert script.main([*argv, "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and err.startswith("kaizen_overheads: error: "), err
    assert not (tmp_path / "x.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_no_cuda_is_one_line(capsys):
    assert load_benchmark("kaizen_overheads").main([]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "CUDA is not available" in err


def test_kaizen_train_step_by_hand_takes_the_loops_steps(teacher_path, tmp_path):
    """``kaizen_train_step`` called by hand, on the trainer's models, multiplier, optimizer and batches, returns what
    ``kaizen_train`` logged for its first two steps (bit for bit: the loop is this call), the multiplier moving
    (two targets, over budget at first) and the selector's learning rate warming up."""
    config = KaizenTrainConfig(model=teacher_path, out=str(tmp_path / "loop"), targets=(2.0, 4.0), steps=6,
                               batch_size=2, seq_len=128, warmup_steps=2, lr=1e-3, lr_new=0.2, beta=1.0, eta=0.5)
    result = kaizen_train(config, stop_after=2, progress=False)
    logged = [json.loads(ln) for ln in (tmp_path / "loop" / LOG_FILE).read_text().splitlines()]
    assert len(logged) == 2 and result["final"] is None
    torch.manual_seed(config.seed)  # as kaizen_train() seeds before build_models
    teacher, student, _ = build_models(config, torch.device("cpu"))
    joint = KaizenStep(student, make_multiplier(config), config.kd_topk)
    optimizer = make_optimizer(config, student)
    batches = iter(TestbedStream(length=config.seq_len, batch_size=config.batch_size, seed=config.seed,
                                 dense=config.dense_fraction))
    betas = []
    for step in range(2):
        ids, labels = next(batches)
        got = kaizen_train_step(config, teacher, joint, optimizer, ids, labels, step, step / config.steps)
        assert got == {k: v for k, v in logged[step].items() if k not in ("step", "seconds")}, step
        betas.append(joint.multiplier.beta)
    assert betas == result["betas"] and betas[0] != config.beta  # the multiplier moved
    assert logged[0]["lr_new"] < logged[1]["lr_new"]  # warm-up
