"""``benchmarks/device/kvpop_mlstm_from_mlp.sh`` as a CPU smoke test on a tiny GQA Qwen3: an MLP student retrofitted for
two steps is converted, evaluated as is, and retrofitted on jointly and with a frozen backbone; every part writes its
rows, the frozen run keeps the converted student's backbone, and the results come back as two files."""

import json
import os
import subprocess
import tarfile
from pathlib import Path

import torch
from safetensors.torch import load_file

from kvlearn.train.distill import RetrofitConfig, retrofit
from kvlearn import KVpopConfig

ROOT = Path(__file__).resolve().parents[2]


def test_mlstm_from_mlp_chain_writes_every_part(make_teacher, tmp_path):
    teacher = make_teacher(2, 0)
    work = tmp_path / "work"
    mlp = retrofit(RetrofitConfig(model=teacher, out=str(tmp_path / "mlp"), steps=2, batch_size=2, seq_len=128,
                                  kvpop=KVpopConfig(sinks=2, window=8, topk=30, scorer="mlp"), num_workers=0,
                                  device="cpu"), progress=False)["final"]
    out = tmp_path / "out"
    small = "--sinks 2 --window 8 --seq-len 128 --batch-size 2 --num-workers 0"
    env = {**os.environ, "OUT": str(out), "WORK_DIR": str(work), "DEVICE": "cpu", "CONTEXT": "256", "MODEL": teacher,
           "MLP_STUDENT": mlp, "BUDGET": "40", "STEPS": "2", "REFIT_STEPS": "2", "N": "1", "N_PER_TASK": "1",
           "RETROFIT_ARGS": small, "EVAL_ARGS": "--sinks 2 --tasks vt --threads 1",
           "TABLE_ARGS": "--context 256 --tasks vt --sinks 2"}
    work.mkdir()
    run = subprocess.run(["bash", "benchmarks/device/kvpop_mlstm_from_mlp.sh"], env=env, capture_output=True,
                         text=True, timeout=900, cwd=ROOT)
    log = run.stdout + run.stderr
    assert all(f"{p} rc=0" in run.stdout for p in ("as_is", "frozen", "joint")), log
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == ["joint/kvpop_mlstm_40_joint.tar", "kvpop_mlstm_from_mlp.tar"], files
    with tarfile.open(out / "kvpop_mlstm_from_mlp.tar") as tar:
        names = set(tar.getnames())
        for name in ("./as_is/kvpop_table.json", "./joint/kvpop_mlstm_40_joint_eval.json",
                     "./frozen/kvpop_mlstm_40_frozen_heldout.json", "./train_log_retrofit_mlstm_40_joint.jsonl.gz"):
            assert name in names, sorted(names)
        rows = json.load(tar.extractfile("./as_is/kvpop_table.json"))["rows"]
    assert {(r["method"], r["split"]) for r in rows} == {("kvpop", "eval"), ("kvpop", "heldout")}
    assert rows[0]["options"]["scorer"] == "mlstm" and rows[0]["options"]["state_in_budget"] is True
    converted = load_file(str(work / "mlstm-from-mlp" / "model.safetensors"))
    frozen = load_file(str(work / "retrofit_mlstm_40_frozen" / "final" / "model.safetensors"))
    joint = load_file(str(work / "retrofit_mlstm_40_joint" / "final" / "model.safetensors"))
    backbone = [k for k in converted if "kvpop" not in k]
    assert all(torch.equal(converted[k], frozen[k]) for k in backbone)
    assert any(not torch.equal(converted[k], joint[k]) for k in backbone)
