"""``benchmarks/device/kvpop_mlstm_scorer_refit.sh`` (the mLSTM student, then two scorer-only refits of it on its
frozen backbone) as a CPU smoke test on a tiny GQA Qwen3: every step writes its rows, the refits start from the step-1
student and leave its backbone untouched, and the results come back as the few files the device returns."""

import json
import os
import subprocess
import tarfile
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]


def test_scorer_refit_chain_writes_every_part_and_keeps_the_backbone(make_teacher, tmp_path):
    teacher = make_teacher(2, 0)
    out, work = tmp_path / "out", tmp_path / "work"
    work.mkdir()
    small = "--sinks 2 --window 8 --seq-len 128 --batch-size 2 --num-workers 0"
    env = {**os.environ, "OUT": str(out), "WORK_DIR": str(work), "DEVICE": "cpu", "CONTEXT": "256", "MODEL": teacher,
           "BUDGET": "40", "STUDENT_STEPS": "2", "REFIT_STEPS": "2", "N": "1", "N_PER_TASK": "1",
           "STUDENT_ARGS": small, "REFIT_ARGS": small, "EVAL_ARGS": "--sinks 2 --tasks vt --threads 1",
           "TABLE_ARGS": "--context 256 --tasks vt --sinks 2"}
    run = subprocess.run(["bash", "benchmarks/device/kvpop_mlstm_scorer_refit.sh"], env=env, capture_output=True,
                         text=True, timeout=900, cwd=ROOT)
    log = run.stdout + run.stderr
    assert "step 1 rc=0" in run.stdout and "refit rc=0" in run.stdout and "refit_lr rc=0" in run.stdout, log
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == ["kvpop_mlstm_scorer_refit.tar", "refit/kvpop_mlstm_40_refit.tar"], files  # <= 8 files come back
    with tarfile.open(out / "kvpop_mlstm_scorer_refit.tar") as tar:
        names = set(tar.getnames())
        rows = {}
        for name in ("./student/kvpop_table.json", "./refit/kvpop_mlstm_40_refit_eval.json",
                     "./refit_lr/kvpop_mlstm_40_refit_lr_heldout.json"):
            assert name in names, sorted(names)
            rows[name] = json.load(tar.extractfile(name))["rows"]
    assert {r["split"] for r in rows["./student/kvpop_table.json"] if r["method"] == "kvpop"} == {"eval", "heldout"}
    for name in ("./train_log_table_m40_kvpop.jsonl.gz", "./train_log_retrofit_mlstm_40_refit.jsonl.gz",
                 "./train_log_retrofit_mlstm_40_refit_lr.jsonl.gz"):
        assert name in names
    # the refits started from the step-1 student and trained its scorers only: the backbone is the student's
    student = load_file(str(work / "table_m40_kvpop" / "final" / "model.safetensors"))
    refit = load_file(str(work / "retrofit_mlstm_40_refit" / "final" / "model.safetensors"))
    backbone = [k for k in student if "kvpop" not in k]
    scorers = [k for k in student if "kvpop" in k]
    assert backbone and scorers
    assert all(torch.equal(student[k], refit[k]) for k in backbone)
    assert any(not torch.equal(student[k], refit[k]) for k in scorers)
    lr = json.loads((work / "retrofit_mlstm_40_refit_lr" / "train_log.jsonl").read_text().splitlines()[0])
    assert 0 < lr["lr_new"] <= 3e-4  # the second refit ran at the lower peak
    # step 1 is the mLSTM student as it was studied (session 27): no readout penalty, whatever kvpop_table.sh's default
    trainer = torch.load(work / "table_m40_kvpop" / "final" / "trainer_state.pt", weights_only=False)
    assert trainer["config"]["readout_penalty"] == 0.0
