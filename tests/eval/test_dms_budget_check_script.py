"""``benchmarks/device/dms_budget_check.sh`` (issue #10's DMS budget check) as a CPU smoke test on a tiny GQA Qwen3: three
DMS students trained one after another (two budgets, one of them also with the head scope), each one's head load at two
budgets, the first budget's students served at two budgets; every file is written and each student was trained
for its own budget and scope; everything but the JSON results is packed in one archive; with KEEP_STUDENTS=1 each
student's final/ comes back without its optimizer state and loads with the trained weights."""

import json
import os
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_file_is_written_and_each_student_has_its_budget(make_teacher, tmp_path):
    teacher = make_teacher(2, 0)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "WORK_DIR": str(tmp_path), "DEVICE": "cpu", "CONTEXT": "256",
           "MODEL": teacher, "STEPS": "2", "STUDENTS": "64 48 64:head", "LOAD_BUDGETS": "64,128", "EVAL_BUDGETS": "64 128",
           "N": "1", "N_LOAD": "1", "EVAL_ARGS": "--tasks vt --threads 1",
           "RETROFIT_ARGS": "--seq-len 128 --batch-size 2 --num-workers 0", "KEEP_STUDENTS": "1"}
    run = subprocess.run(["bash", "benchmarks/device/dms_budget_check.sh"], env=env, capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert run.returncode == 0 and "done" in run.stdout, run.stdout + run.stderr
    with tarfile.open(out / "dms_check_logs.tar.gz") as tar:  # the device returns at most 8 files: the rest is packed
        packed = {Path(m.name).name: m for m in tar.getmembers()}
        logs = {name: tar.extractfile(m).read().decode() for name, m in packed.items() if not name.endswith(".png")}
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["dms_check_logs.tar.gz"] + [f"dms_load_{lb}.json" for lb in ("dms_64", "dms_48", "dms_64_head")]
        + [f"{lb}_eval_b{eb}.json" for lb in ("dms_64", "dms_64_head") for eb in (64, 128)]
        + [f"student_{lb}.tar" for lb in ("dms_64", "dms_48", "dms_64_head")])
    assert not any("retrofit:" in text for name, text in logs.items() if name.startswith("retrofit_"))
    for label, b, scope, cr in (("dms_64", 64, "model", 128 / 64), ("dms_48", 48, "model", 128 / 48),
                                ("dms_64_head", 64, "head", 128 / (64 - 4 - 32))):  # retrofit's window: half of 64
        load = json.loads((out / f"dms_load_{label}.json").read_text())
        alls = {r["budget"]: r for r in load["rows"] if r["family"] == "all"}
        assert sorted(alls) == [64, 128] and all(r["trained_budget"] == b for r in alls.values())
        assert alls[64]["target_cr"] == cr  # kvlearn retrofit's default for the scope
        saved = json.loads((tmp_path / f"check_{label}" / "final" / "config.json").read_text())["dms"]
        assert saved["compression_scope"] == scope
        assert packed[f"dms_load_{label}.png"].size > 1000
        assert logs[f"train_log_{label}.jsonl"].count("\n") == 2
        assert f"retrofit_{label}.log" in logs and f"dms_load_{label}.log" in logs
    for label in ("dms_64", "dms_64_head"):
        for eb in (64, 128):
            (row,) = json.loads((out / f"{label}_eval_b{eb}.json").read_text())["rows"]
            assert row["method"] == "dms" and row["budget"] == eb and row["task"] == "vt"
    assert not (out / "dms_48_eval_b64.json").exists()  # only the first entry's budget is served
    assert "rc=0" in run.stdout and "rc=1" not in run.stdout and "rc=2" not in run.stdout
    # KEEP_STUDENTS=1: a student's final/ without its optimizer state, which loads and serves as the trained one
    with tarfile.open(out / "student_dms_64_head.tar") as tar:
        names = sorted(tar.getnames())
        tar.extractall(tmp_path / "kept")
    assert "final/model.safetensors" in names and "final/config.json" in names
    assert not any(n.endswith("trainer_state.pt") for n in names), names
    import torch

    import kvlearn

    kept, trained = (kvlearn.load(str(p), dtype=torch.float32)
                     for p in (tmp_path / "kept" / "final", tmp_path / "check_dms_64_head" / "final"))
    assert kept.config.dms == trained.config.dms and kept.config.dms["compression_scope"] == "head"
    for (name, a), b in zip(kept.state_dict().items(), trained.state_dict().values(), strict=True):
        assert torch.equal(a, b), name

