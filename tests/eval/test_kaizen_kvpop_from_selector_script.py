"""``benchmarks/device/kaizen_kvpop_from_selector.sh`` as a CPU smoke test on a tiny GQA Qwen3 (3 layers, 2 KV heads,
2 query heads per KV head), as the device runs it in two calls: the selector trains, its most frequent configuration is
read from its choices and it is exported; then the KVpop student starts from the exported selector's backbone under
that configuration and is served at the matching total factor, and each call's results come back as at most two
files."""

import json
import os
import subprocess
import tarfile
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]


def run_script(env):
    run = subprocess.run(["bash", "benchmarks/device/kaizen_kvpop_from_selector.sh"], env=env, capture_output=True,
                         text=True, timeout=900, cwd=ROOT)
    return run, run.stdout + run.stderr


def test_selector_call_then_student_call_from_its_export(make_teacher, tmp_path):
    """The two device calls: SELECTOR_ONLY=1 trains the selector, counts its choices and exports it (bf16); the second
    call, SELECTOR=<the export>, retrofits an mLSTM student from its backbone with the scorer distillation (the
    default) under its most frequent configuration and serves it at the composed factor."""
    teacher = make_teacher(3, 0)
    out1, out2, work = tmp_path / "out1", tmp_path / "out2", tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "WORK_DIR": str(work), "DEVICE": "cpu", "MODEL": teacher, "CONTEXT": "256",
           "BUDGET": "40", "N": "1", "N_CHOICE": "1", "STEPS": "2", "SELECTOR_LENGTH": "--steps 2",
           "SELECTOR_ARGS": "--seq-len 256 --batch-size 2 --num-workers 0 --lr 1e-2",
           "RETROFIT_ARGS": "--sinks 2 --window 8 --seq-len 128 --batch-size 2 --num-workers 0 --scorer-kd-queries 16",
           "EVAL_ARGS": "--sinks 2 --tasks vt --threads 1"}
    run, log = run_script({**env, "OUT": str(out1), "SELECTOR_ONLY": "1"})
    assert run.returncode == 0 and "selector rc=0" in run.stdout and "selector export rc=0" in run.stdout, log
    assert "step 3" not in run.stdout, log  # stopped after the choice
    files = sorted(str(p.relative_to(out1)) for p in out1.rglob("*") if p.is_file())
    assert files == ["k64_selector.tar", "kaizen_kvpop_from_selector.tar"], files
    with tarfile.open(out1 / "kaizen_kvpop_from_selector.tar") as tar:
        choices = json.load(tar.extractfile("./selector_choices.json"))["rows"]
    counts = Counter()
    for row in choices:
        counts.update(row["configurations"])
    chosen = counts.most_common(1)[0][0]
    carried = tmp_path / "carry"
    with tarfile.open(out1 / "k64_selector.tar") as tar:
        tar.extractall(carried, filter="data")
    selector = carried / "k64-selector"
    exported = load_file(str(selector / "model.safetensors"))
    trained = load_file(str(work / "k64_selector" / "final" / "model.safetensors"))
    assert set(exported) == set(trained) and any(k.startswith("kaizen_selector.") for k in exported)
    for k, v in trained.items():  # the backbone in bf16; the selector stays float32 (kvlearn.kaizen.apply)
        dtype = torch.float32 if k.startswith("kaizen_selector.") else torch.bfloat16
        assert exported[k].dtype == dtype and torch.equal(exported[k], v.to(dtype)), k
    assert (selector / "teacher.json").is_file()

    run, log = run_script({**env, "OUT": str(out2), "SELECTOR": str(selector), "SCORER": "mlstm"})
    assert "step 1: the trained selector" in run.stdout and "selector rc" not in run.stdout, log
    assert "step 3 rc=0" in run.stdout and "retrofit rc=0" in log, log
    files = sorted(str(p.relative_to(out2)) for p in out2.rglob("*") if p.is_file())
    assert files == ["kaizen_kvpop_from_selector.tar", "student/kvpop_mlstm_40_fromsel.tar"], files
    with tarfile.open(out2 / "kaizen_kvpop_from_selector.tar") as tar:
        again = json.load(tar.extractfile("./selector_choices.json"))["rows"]
        composed = json.load(tar.extractfile("./student/kaizen_kvpop_mlstm_40_fromsel_eval.json"))["rows"]
        names = set(tar.getnames())
    assert [r["configurations"] for r in again] == [r["configurations"] for r in choices]  # the same selector
    assert "./student/kaizen_kvpop_mlstm_40_fromsel_heldout.json" in names
    assert "./student/decompose_mlstm_40_fromsel_kaizen_static.json" in names
    student = work / "retrofit_mlstm_40_fromsel" / "final"
    config = json.loads((student / "config.json").read_text())
    assert config["kvpop_kv_configuration"] == chosen  # the student trained under the selector's configuration
    assert config["kvpop"]["scorer"] == "mlstm"
    trainer = torch.load(student / "trainer_state.pt", weights_only=False)
    assert trainer["config"]["init_backbone"] == str(selector)
    assert trainer["config"]["scorer_kd"] == 1.0 and trainer["config"]["scorer_kd_queries"] == 16
    assert composed and all(r["method"] == "kaizen+kvpop" for r in composed)
    # the student started from the selector's backbone: after 2 steps at lr 1e-4 it is closer to it than to the teacher
    teacher_w = load_file(str(Path(teacher) / "model.safetensors"))
    final = load_file(str(student / "model.safetensors"))
    key = "model.layers.1.self_attn.k_proj.weight"
    assert (final[key] - exported[key].float()).norm() < (final[key] - teacher_w[key]).norm()


def test_a_selector_folder_that_is_not_a_model_stops_the_script(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "WORK_DIR": str(tmp_path), "SELECTOR": str(tmp_path / "none")}
    run, log = run_script(env)
    assert run.returncode == 1 and "is not a model folder (no config.json)" in run.stdout, log
