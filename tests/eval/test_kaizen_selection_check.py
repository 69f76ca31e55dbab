"""``benchmarks/kaizen_selection_check.py`` on the CPU: a KV-Kaizen student saved by a one-step ``kaizen-train`` of
the shipped teacher (which answers some prompts), evaluated in every cell of servings x prompt sets x batch sizes.
Independent references: the selection-prompts cell equals ``kaizen_train.validate`` (the training loop's own
validation) on the same weights; on the CPU the two servings are the same float32 computation, so they agree; and
batches of 1 and 2 agree (batch invariance). Bad options are one-line errors."""

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import kaizen_selection_check as script  # noqa: E402
from kvlearn.train import kaizen_train as kt  # noqa: E402

TEACHER = ROOT / "checkpoints" / "testbed-teacher"


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    out = tmp_path_factory.mktemp("kaizen")
    config = kt.KaizenTrainConfig(model=str(TEACHER), out=str(out), targets=(2.0,), steps=1, batch_size=2,
                                  seq_len=512, lr=1e-7, lr_new=1e-7, warmup_steps=0, select_every=1, select_n=2,
                                  device="cpu")
    kt.kaizen_train(config, progress=False)
    return out, config


def test_every_cell_and_its_references(student, tmp_path):
    out, config = student
    path = tmp_path / "check.json"
    assert script.main(["--model", str(out / "final"), "--tasks", "vt,niah", "--n-select", "2", "--n-eval", "2",
                        "--batch-sizes", "1,2", "--context", "512", "--device", "cpu", "--out", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["kind"] == "kaizen_selection_check" and data["device"].startswith("cpu")
    rows = data["rows"]
    cells = {(r["serving"], r["prompts"], r["batch_size"], r["task"]): r["accuracy"] for r in rows}
    assert len(cells) == len(rows) == 2 * 2 * 2 * 2
    for (serving, prompts, batch, task), acc in cells.items():
        assert acc == cells[("served", prompts, batch, task)] == cells[(serving, prompts, 1, task)]
    assert {r["seed_offset"] for r in rows if r["prompts"] == "selection"} == {kt.SELECT_SEED_OFFSET}
    import kvlearn

    model = kvlearn.load(str(out / "final"), dtype=torch.float32)
    validated = kt.validate(config, model, torch.device("cpu"))["per_task"]
    assert {t: cells[("train_copy", "selection", 2, t)] for t in ("vt", "niah")} == {
        t: validated[t] for t in ("vt", "niah")}
    assert sum(validated.values()) > 0  # the teacher answers some: the comparison is not of zeros
    assert all(v["spread"] == 0 for v in data["summary"]["per_family"].values())


@pytest.mark.parametrize("args, message", [
    (["--tasks", "trace,bogus"], "--tasks 'trace,bogus': unknown bogus; expected a comma list of trace"),
    (["--batch-sizes", "16,x"], "--batch-sizes='16,x' is invalid: expected a comma list of integers >= 1"),
    (["--servings", "fp8"], "--servings 'fp8': unknown fp8; expected a comma list of train_copy, served"),
    (["--n-eval", "0"], "n_eval=0 is invalid")])
def test_bad_options_are_one_line(student, tmp_path, capsys, args, message):
    out, _ = student
    assert script.main(["--model", str(out / "final"), "--device", "cpu", "--out", str(tmp_path / "x.json")] + args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_the_device_script_on_the_cpu(tmp_path):
    """``benchmarks/device/kaizen_selection_check.sh`` with a one-step training at 512 tokens: it writes the check
    (every serving x prompt set cell), the selection log, the gzipped logs, and the student's final/ without its
    optimizer state as tar parts that join back into a folder ``kvlearn.load`` reads."""
    import os
    import subprocess
    import tarfile

    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "WORK_DIR": str(tmp_path / "work"), "DEVICE": "cpu", "STEPS": "1",
           "TRAIN_ARGS": "--seq-len 512 --batch-size 2 --select-every 1 --select-n 2 --num-workers 0",
           "TASKS": "vt", "N_EVAL": "2", "CHECK_ARGS": "--context 512 --n-select 2 --batch-sizes 2"}
    done = subprocess.run(["bash", "benchmarks/device/kaizen_selection_check.sh"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "kaizen-train rc=0" in done.stdout and "check rc=0" in done.stdout, \
        done.stdout + done.stderr
    check = json.loads((out / "kaizen_selection_check.json").read_text())
    assert {(r["serving"], r["prompts"]) for r in check["rows"]} == {
        (s, p) for s in ("train_copy", "served") for p in ("selection", "table")}
    assert [json.loads(line)["step"] for line in (out / "selection.jsonl").read_text().splitlines()] == [1]
    parts = sorted(out.glob("final.tar.part-*"))
    assert parts and len(list(out.iterdir())) <= 8  # what one device call brings back
    joined = tmp_path / "final.tar"
    joined.write_bytes(b"".join(p.read_bytes() for p in parts))
    with tarfile.open(joined) as tar:
        names = tar.getnames()
        tar.extractall(tmp_path / "unpacked")
    assert "final/model.safetensors" in names and not [n for n in names if n.endswith("trainer_state.pt")]
    import kvlearn

    model = kvlearn.load(str(tmp_path / "unpacked" / "final"), dtype=torch.float32)
    assert model.config.num_hidden_layers == 8
