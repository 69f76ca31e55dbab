"""``benchmarks/device/kvpop_scorer_kd.sh`` as a CPU smoke test on a tiny GQA Qwen3: one KVpop student per run of
RUNS (an MLP at a weight, an mLSTM at its own weight, temperature, seed, budget and window), each tabled on both splits at the
budget, the scorer, weight, temperature, window and seed reaching the trainer, and the results coming back as one
file."""

import gzip
import json
import os
import subprocess
import tarfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def test_scorer_kd_chains_train_and_table_each_run(make_teacher, tmp_path):
    teacher = make_teacher(2, 0)
    out, work = tmp_path / "out", tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "OUT": str(out), "WORK_DIR": str(work), "DEVICE": "cpu", "MODEL": teacher, "BUDGET": "40",
           "WINDOW": "8", "STEPS": "2", "RUNS": "mlp:1 mlstm:0.5:0.3:1:48:12", "KD_QUERIES": "16", "N_PER_TASK": "1",
           "RETROFIT_ARGS": "--sinks 2 --seq-len 128 --batch-size 2",
           "TABLE_ARGS": "--context 256 --tasks vt --sinks 2"}
    run = subprocess.run(["bash", "benchmarks/device/kvpop_scorer_kd.sh"], env=env, capture_output=True,
                         text=True, timeout=900, cwd=ROOT)
    assert "== mlp_kd1: 1 runs ended well" in run.stdout and "== mlstm_kd0.5_t0.3_s1_b48_w12: 1 runs ended well" in \
        run.stdout, run.stdout + run.stderr
    assert [p.name for p in out.rglob("*") if p.is_file()] == ["kvpop_scorer_kd.tar"]
    with tarfile.open(out / "kvpop_scorer_kd.tar") as tar:
        for tag, method, scorer, budget in (("mlp_kd1", "kvpop_mlp", "mlp", 40),
                                            ("mlstm_kd0.5_t0.3_s1_b48_w12", "kvpop", "mlstm", 48)):
            rows = json.load(tar.extractfile(f"./{tag}/kvpop_table.json"))["rows"]
            assert {(r["method"], r["split"]) for r in rows} == {(method, "eval"), (method, "heldout")}
            assert rows[0]["options"]["scorer"] == scorer and {r["budget"] for r in rows} == {budget}
            log = [json.loads(line) for line in gzip.open(tar.extractfile(f"./train_log_{tag}.jsonl.gz"), "rt")]
            assert len(log) == 2
    for tag, student, weight, tau, seed, window in (("mlp_kd1", "kvpop_mlp", 1.0, 1.0, 0, 8),
                                                    ("mlstm_kd0.5_t0.3_s1_b48_w12", "kvpop", 0.5, 0.3, 1, 12)):
        trainer = torch.load(work / f"table_{tag}_{student}" / "final" / "trainer_state.pt", weights_only=False)
        config = trainer["config"]
        kvpop = config["kvpop"]
        assert (config["scorer_kd"], config["scorer_kd_temperature"], config["scorer_kd_queries"], config["seed"]) == \
            (weight, tau, 16, seed)
        assert (kvpop["scorer"], kvpop["window"], kvpop["sinks"]) == (student == "kvpop" and "mlstm" or "mlp", window, 2)
    bad = subprocess.run(["bash", "benchmarks/device/kvpop_scorer_kd.sh"], env={**env, "RUNS": "linear:1"},
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "the scorer must be mlp or mlstm" in bad.stdout
