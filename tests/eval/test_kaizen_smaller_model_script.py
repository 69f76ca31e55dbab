"""``benchmarks/device/kaizen_smaller_model.sh`` as a CPU smoke test: a 2-layer model pretrained on a step budget
(exactly those steps), then its ``smaller_model`` rows at the factor of its cache against the shipped 8-layer
teacher's (4.0, by hand: 8 layers over 2, same KV heads and head dim), and the files the device returns."""

import json
import os
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_smaller_model_chain_trains_on_a_step_budget_and_writes_its_rows(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "OUT": str(out), "WORK_DIR": str(work), "DEVICE": "cpu", "STEPS": "3", "STAGE_FRACTIONS": "1",
           "N_PER_TASK": "1", "PRETRAIN_ARGS": "--stages 256 --tokens-per-step 512 --eval-n 1 --num-workers 0",
           "TABLE_ARGS": "--context 256 --tasks vt --splits eval,heldout"}
    run = subprocess.run(["bash", "benchmarks/device/kaizen_smaller_model.sh"], env=env, capture_output=True,
                         text=True, timeout=600, cwd=ROOT)
    assert "pretrain rc=0" in run.stdout and "table rc=0" in run.stdout, run.stdout + run.stderr
    log = json.loads((out / "pretrain_log_smaller-2l.json").read_text())
    assert log["steps"] == 3 and log["config"]["steps"] == 3 and log["config"]["num_layers"] == 2
    rows = json.loads((out / "kaizen_table_smaller_model.json").read_text())["rows"]
    assert {(r["method"], r["split"]) for r in rows} == {("smaller_model", "eval"), ("smaller_model", "heldout")}
    assert all(abs(r["factor"] - 4.0) < 1e-9 for r in rows)
    with tarfile.open(out / "smaller_model.tar") as tar:
        assert "smaller-2l/config.json" in tar.getnames() and "smaller-2l/model.safetensors" in tar.getnames()
    assert len([p for p in out.iterdir() if p.is_file()]) <= 8
