"""``benchmarks/device/kvpop_mlstm_readout_penalty.sh`` as a CPU smoke test on a tiny GQA Qwen3: one mLSTM student per
run of RUNS (a weight at the default budget, and a weight at its own budget and seed), each tabled on both splits at
its budget, the weight, budget and seed reaching the trainer (the penalty logged per step), and the results coming
back as one file."""

import gzip
import json
import os
import subprocess
import tarfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_readout_penalty_chains_train_and_table_each_run(make_teacher, tmp_path):
    teacher = make_teacher(2, 0)
    out, work = tmp_path / "out", tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "OUT": str(out), "WORK_DIR": str(work), "DEVICE": "cpu", "MODEL": teacher, "BUDGET": "40",
           "STEPS": "2", "RUNS": "0.5 7:48::1", "N_PER_TASK": "1",
           "RETROFIT_ARGS": "--sinks 2 --window 8 --seq-len 128 --batch-size 2",
           "TABLE_ARGS": "--context 256 --tasks vt --sinks 2"}
    run = subprocess.run(["bash", "benchmarks/device/kvpop_mlstm_readout_penalty.sh"], env=env, capture_output=True,
                         text=True, timeout=900, cwd=ROOT)
    assert "== p0.5: 1 runs ended well" in run.stdout and "== p7_b48_s1: 1 runs ended well" in run.stdout, \
        run.stdout + run.stderr
    assert [p.name for p in out.rglob("*") if p.is_file()] == ["kvpop_mlstm_readout_penalty.tar"]
    with tarfile.open(out / "kvpop_mlstm_readout_penalty.tar") as tar:
        names = set(tar.getnames())
        for tag, budget in (("p0.5", 40), ("p7_b48_s1", 48)):
            rows = json.load(tar.extractfile(f"./{tag}/kvpop_table.json"))["rows"]
            assert {(r["method"], r["split"]) for r in rows} == {("kvpop", "eval"), ("kvpop", "heldout")}, names
            assert rows[0]["options"]["scorer"] == "mlstm" and {r["budget"] for r in rows} == {budget}
            log = [json.loads(line) for line in gzip.open(tar.extractfile(f"./train_log_{tag}.jsonl.gz"), "rt")]
            assert len(log) == 2 and "readout_penalty" in log[-1]
    for tag, weight, budget, seed in (("p0.5", 0.5, 40, 0), ("p7_b48_s1", 7.0, 48, 1)):
        state = json.loads((work / f"table_{tag}_kvpop" / "final" / "config.json").read_text())
        assert state["kvpop"]["scorer"] == "mlstm"
        trainer = torch.load(work / f"table_{tag}_kvpop" / "final" / "trainer_state.pt", weights_only=False)
        # the weight, the budget and the seed reached the trainer
        config = trainer["config"]
        kvpop = config["kvpop"]
        assert (config["readout_penalty"], kvpop["sinks"] + kvpop["window"] + kvpop["topk"], config["seed"]) == \
            (weight, budget, seed)
        assert config["scorer_kd"] == 0.0  # the sweep as session 28 ran it, without Table 1's later scorer KD
