"""``benchmarks/device/kvpop_mlstm_readout_penalty.sh`` as a CPU smoke test on a tiny GQA Qwen3: one mLSTM student per
penalty weight, each tabled on both splits, the weight reaching the trainer (logged per step), and the results
coming back as one file."""

import gzip
import json
import os
import subprocess
import tarfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_readout_penalty_chains_train_and_table_each_weight(make_teacher, tmp_path):
    teacher = make_teacher(2, 0)
    out, work = tmp_path / "out", tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "OUT": str(out), "WORK_DIR": str(work), "DEVICE": "cpu", "MODEL": teacher, "BUDGET": "40",
           "STEPS": "2", "WEIGHTS": "0.5 7", "N_PER_TASK": "1",
           "RETROFIT_ARGS": "--sinks 2 --window 8 --seq-len 128 --batch-size 2",
           "TABLE_ARGS": "--context 256 --tasks vt --sinks 2"}
    run = subprocess.run(["bash", "benchmarks/device/kvpop_mlstm_readout_penalty.sh"], env=env, capture_output=True,
                         text=True, timeout=900, cwd=ROOT)
    assert "== weight 0.5" in run.stdout and "== weight 7" in run.stdout, run.stdout + run.stderr
    assert [p.name for p in out.rglob("*") if p.is_file()] == ["kvpop_mlstm_readout_penalty.tar"]
    with tarfile.open(out / "kvpop_mlstm_readout_penalty.tar") as tar:
        names = set(tar.getnames())
        for w in ("0.5", "7"):
            rows = json.load(tar.extractfile(f"./p{w}/kvpop_table.json"))["rows"]
            assert {(r["method"], r["split"]) for r in rows} == {("kvpop", "eval"), ("kvpop", "heldout")}, names
            assert rows[0]["options"]["scorer"] == "mlstm"
            log = [json.loads(line) for line in gzip.open(tar.extractfile(f"./train_log_p{w}.jsonl.gz"), "rt")]
            assert len(log) == 2 and "readout_penalty" in log[-1]
        state = json.loads((work / "table_p7_kvpop" / "final" / "config.json").read_text())
    assert state["kvpop"]["scorer"] == "mlstm"
    trainer = torch.load(work / "table_p7_kvpop" / "final" / "trainer_state.pt", weights_only=False)
    assert trainer["config"]["readout_penalty"] == 7.0  # the weight reached the trainer
