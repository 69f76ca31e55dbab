"""``benchmarks/device/dms_budget_check.sh`` (issue #10's DMS budget check) as a CPU smoke test on a tiny GQA Qwen3: two
DMS students trained one after another (two budgets, one in each scope), each one's head load at two
budgets, each student served at its own budget and at context - 1 (or, with EVAL_BUDGETS, the first budget's students
at those; with HELDOUT=1 also at its own budget on the held-out split); every file is written and each student was trained for its own budget and scope; everything but the JSON
results is packed in one archive, and the JSON results too when they would make more than the 8 files a device call
returns; with KEEP_STUDENTS=1 each student's final/ comes back in gzipped parts without its optimizer state and loads
with the trained weights."""

import io
import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_check(tmp_path, teacher, **extra):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "WORK_DIR": str(tmp_path), "DEVICE": "cpu", "CONTEXT": "256",
           "MODEL": teacher, "STEPS": "2", "STUDENTS": "48 64:head", "LOAD_BUDGETS": "64,128",
           "N": "1", "N_LOAD": "1", "EVAL_ARGS": "--tasks vt --threads 1",
           "RETROFIT_ARGS": "--seq-len 128 --batch-size 2 --num-workers 0", **extra}
    run = subprocess.run(["bash", "benchmarks/device/dms_budget_check.sh"], env=env, capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert run.returncode == 0 and "done" in run.stdout, run.stdout + run.stderr
    assert "rc=0" in run.stdout and "rc=1" not in run.stdout and "rc=2" not in run.stdout
    return out, run


def archive(path):
    """``{name: bytes}`` of a .tar.gz's files."""
    with tarfile.open(path) as tar:
        return {Path(m.name).name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def test_every_file_is_written_and_each_student_has_its_budget(make_teacher, tmp_path):
    teacher = make_teacher(2, 0)
    out, _ = run_check(tmp_path, teacher, KEEP_STUDENTS="1")
    packed = archive(out / "dms_check_logs.tar.gz")  # the device returns at most 8 files: the rest is packed
    logs = {name: data.decode() for name, data in packed.items() if not name.endswith(".png")}
    labels = ("dms_48", "dms_64_head")
    parts = sorted(p.name for p in out.iterdir() if p.name.startswith("student_"))
    # 2 head loads + 4 served budgets + the logs + 2 student parts would be 9 files: the JSON results are packed too
    assert sorted(p.name for p in out.iterdir()) == sorted(["dms_check_logs.tar.gz", "dms_check_results.tar.gz"]
                                                           + parts)
    assert sorted({p.split(".tar.gz.part_")[0] for p in parts}) == sorted(f"student_{lb}" for lb in labels)
    results = archive(out / "dms_check_results.tar.gz")
    assert sorted(results) == sorted([f"dms_load_{lb}.json" for lb in labels]
                                     + [f"{lb}_eval_b{eb}.json" for lb, b in zip(labels, (48, 64)) for eb in (b, 255)])
    assert not any("retrofit:" in text for name, text in logs.items() if name.startswith("retrofit_"))
    for label, b, scope, cr in (("dms_48", 48, "model", 128 / 48),
                                ("dms_64_head", 64, "head", 128 / (64 - 4 - 32))):  # retrofit's window: half of 64
        load = json.loads(results[f"dms_load_{label}.json"])
        alls = {r["budget"]: r for r in load["rows"] if r["family"] == "all"}
        assert sorted(alls) == [64, 128] and all(r["trained_budget"] == b for r in alls.values())
        assert alls[64]["target_cr"] == cr  # kvlearn retrofit's default for the scope
        saved = json.loads((tmp_path / f"check_{label}" / "final" / "config.json").read_text())["dms"]
        assert saved["compression_scope"] == scope
        assert len(packed[f"dms_load_{label}.png"]) > 1000
        assert logs[f"train_log_{label}.jsonl"].count("\n") == 2
        assert f"retrofit_{label}.log" in logs and f"dms_load_{label}.log" in logs
        for eb in (b, 255):  # its own budget, and every key in reach
            (row,) = json.loads(results[f"{label}_eval_b{eb}.json"])["rows"]
            assert row["method"] == "dms" and row["budget"] == eb and row["task"] == "vt"
    # KEEP_STUDENTS=1: a student's final/ without its optimizer state, in parts, which loads as the trained one
    blob = b"".join((out / p).read_bytes() for p in parts if p.startswith("student_dms_64_head."))
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
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


def test_full_context_0_gives_a_table_rows_two_halves_only(make_teacher, tmp_path):
    """HELDOUT=1 with FULL_CONTEXT=0 (and OVERFLOW): the student's own budget on both splits and nothing at context - 1, served with
    the window it trained with, the retrofit's default (Table 1's: half the budget below 512)."""
    out, run = run_check(tmp_path, make_teacher(2, 0), STUDENTS="48:head", HELDOUT="1", FULL_CONTEXT="0",
                         OVERFLOW="oldest", RETROFIT_ARGS="--seq-len 128 --batch-size 2 --num-workers 0")
    label = "dms_48_head"
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["dms_check_logs.tar.gz", f"dms_load_{label}.json", f"{label}_eval_b48.json",
         f"{label}_heldout_b48.json", f"{label}_eval_b48_overflow_oldest.json"])  # no serving at context - 1
    # OVERFLOW: the same budget once more under that order of the full slots, recorded in the row
    (row,) = json.loads((out / f"{label}_eval_b48_overflow_oldest.json").read_text())["rows"]
    assert row["options"]["overflow_evicts"] == "oldest" and row["budget"] == 48 and row["split"] == "eval"
    assert f"{label} served at 48 on eval (overflow evicts oldest) rc=0" in run.stdout
    assert "served at 255" not in run.stdout
    saved = json.loads((tmp_path / f"check_{label}" / "final" / "config.json").read_text())["dms"]
    assert saved["compression_scope"] == "head" and saved["window"] == 24  # 48 // 2
    rows = [json.loads((out / f"{label}_{split}_b48.json").read_text())["rows"][0] for split in ("eval", "heldout")]
    assert [r["split"] for r in rows] == ["eval", "heldout"] and all(r["options"]["window"] == 24 for r in rows)
    assert all(r["budget"] == 48 and r["method"] == "dms" for r in rows)
    assert f"{label} served at 48 on heldout rc=0" in run.stdout and f"{label} served at 48 on eval rc=0" in run.stdout


@pytest.mark.parametrize("entry", ["48:heads", "48:head:w16", "x48", ":head"])
def test_a_bad_students_entry_is_refused_before_training(tmp_path, entry):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "WORK_DIR": str(tmp_path), "DEVICE": "cpu", "STUDENTS": entry}
    run = subprocess.run(["bash", "benchmarks/device/dms_budget_check.sh"], env=env, capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert run.returncode == 2 and f"STUDENTS entry '{entry}' is invalid: expected B[:head|:model]" in run.stdout
    assert not any(p.name.startswith("check_") for p in tmp_path.iterdir())


def test_eval_budgets_serve_the_first_budgets_students_only(make_teacher, tmp_path):
    out, _ = run_check(tmp_path, make_teacher(2, 0), STUDENTS="64 48", EVAL_BUDGETS="64 128")
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["dms_check_logs.tar.gz", "dms_load_dms_64.json", "dms_load_dms_48.json", "dms_64_eval_b64.json",
         "dms_64_eval_b128.json"])  # 5 files: nothing more to pack; the 48 student is not served
