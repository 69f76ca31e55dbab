"""``benchmarks/kaizen_family_swap.py`` on hand-made rows (the dominant configuration per family, the comparison
against the others) and ``benchmarks/device/kaizen_family_swap.sh`` as a CPU smoke test on a tiny GQA Qwen3: a
selector trained for seconds, every family served under every listed configuration on its own folder, the summary,
and the results back as one file."""

import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest
from benchmark_loader import load_benchmark

from kvlearn import KVLearnError

ROOT = Path(__file__).resolve().parents[2]
A, B = "b4 b4 b2 b2 share b4 share share", "b4 b2 b2 b4 share b4 share share"


def kaizen(split, task, acc, counts):
    return {"method": "kaizen", "split": split, "task": task, "accuracy": acc, "configurations": counts}


def static(split, task, acc, config):
    return {"method": "kaizen_static", "split": split, "task": task, "accuracy": acc, "configurations": {config: 100}}


def test_summary_sets_each_family_under_its_own_configuration_against_the_others():
    swap = load_benchmark("kaizen_family_swap")
    rows = [kaizen("eval", "trace", 0.76, {A: 99, B: 1}), kaizen("eval", "niah", 0.88, {B: 100})]
    assert swap.dominant_configurations(rows) == {("eval", "trace"): A, ("eval", "niah"): B}
    assert swap.configurations(rows) == [A, B]
    assert swap.configurations([rows[1]], extra=[A, B]) == [B, A]
    served = [static("eval", "trace", 0.75, A), static("eval", "trace", 0.60, B),
              static("eval", "niah", 0.70, A), static("eval", "niah", 0.88, B)]
    out = {(r["split"], r["task"]): r for r in swap.summary(rows, served)}
    assert out[("eval", "trace")]["own_minus_best_other"] == pytest.approx(0.15)  # 0.75 - 0.60: the choice paid
    assert out[("eval", "niah")]["own_minus_best_other"] == pytest.approx(0.18)
    assert out[("eval", "trace")]["under"] == {A: 0.75, B: 0.60} and out[("eval", "trace")]["selector_accuracy"] == 0.76
    with pytest.raises(KVLearnError, match="no static row under its own configuration"):
        swap.summary(rows, served[1:])  # trace never served its own configuration
    with pytest.raises(KVLearnError, match="no kaizen rows"):
        swap.dominant_configurations(served)


def test_family_swap_chain_on_the_cpu(make_teacher, tmp_path):
    teacher = make_teacher(3, 0)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "DEVICE": "cpu", "MODEL": teacher, "N_PER_TASK": "1", "SEQ_LEN": "128",
           "BATCH": "2", "TRAIN_MINUTES": "0.05", "TOTAL_MINUTES": "3", "TRAIN_ARGS": "--lr 1e-3",
           "SELECTOR_TABLE_ARGS": "--context 256 --tasks vt,niah", "EVAL_ARGS": "--context 256 --tasks vt,niah",
           "EXTRA_CONFIGS": "b4 share b2;b2 b4 b4"}
    run = subprocess.run(["bash", "benchmarks/device/kaizen_family_swap.sh"], env=env, capture_output=True, text=True,
                         timeout=900, cwd=ROOT)
    assert "selector rc=0" in run.stdout and "summary rc=0" in run.stdout, run.stdout + run.stderr
    assert [p.name for p in out.rglob("*") if p.is_file()] == ["kaizen_family_swap.tar"]
    with tarfile.open(out / "kaizen_family_swap.tar") as tar:
        names = set(tar.getnames())
        assert not any(n.endswith((".safetensors", ".pt")) for n in names)
        rows = json.load(tar.extractfile("./kaizen_family_swap.json"))["rows"]
    assert {(r["split"], r["task"]) for r in rows} == {(s, t) for s in ("eval", "heldout") for t in ("vt", "niah")}
    for r in rows:  # every family served under its own configuration and the two extra ones
        assert {"b4 share b2", "b2 b4 b4", r["own_configuration"]} == set(r["under"])
