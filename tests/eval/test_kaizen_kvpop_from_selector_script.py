"""``benchmarks/device/kaizen_kvpop_from_selector.sh`` as a CPU smoke test on a tiny GQA Qwen3 (3 layers, 2 KV heads,
2 query heads per KV head): the selector trains, its most frequent configuration is read from its choices, the KVpop
student starts from the selector's backbone under that configuration and is served at the matching total factor, and
the results come back as two files."""

import json
import os
import subprocess
import tarfile
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[2]


def test_selector_then_student_from_its_backbone(make_teacher, tmp_path):
    teacher = make_teacher(3, 0)
    out, work = tmp_path / "out", tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "OUT": str(out), "WORK_DIR": str(work), "DEVICE": "cpu", "MODEL": teacher, "CONTEXT": "256",
           "BUDGET": "40", "N": "1", "N_CHOICE": "1", "STEPS": "2", "SELECTOR_LENGTH": "--steps 2",
           "SELECTOR_ARGS": "--seq-len 256 --batch-size 2 --num-workers 0 --lr 1e-2",
           "RETROFIT_ARGS": "--sinks 2 --window 8 --seq-len 128 --batch-size 2 --num-workers 0",
           "EVAL_ARGS": "--sinks 2 --tasks vt --threads 1"}
    run = subprocess.run(["bash", "benchmarks/device/kaizen_kvpop_from_selector.sh"], env=env, capture_output=True,
                         text=True, timeout=900, cwd=ROOT)
    log = run.stdout + run.stderr
    assert "selector rc=0" in run.stdout and "step 3 rc=0" in run.stdout and "retrofit rc=0" in log, log
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == ["kaizen_kvpop_from_selector.tar", "student/kvpop_mlp_40_fromsel.tar"], files
    with tarfile.open(out / "kaizen_kvpop_from_selector.tar") as tar:
        choices = json.load(tar.extractfile("./selector_choices.json"))["rows"]
        composed = json.load(tar.extractfile("./student/kaizen_kvpop_mlp_40_fromsel_eval.json"))["rows"]
        names = set(tar.getnames())
    assert "./student/kaizen_kvpop_mlp_40_fromsel_heldout.json" in names
    assert "./student/decompose_mlp_40_fromsel_kaizen_static.json" in names
    counts = Counter()
    for row in choices:
        counts.update(row["configurations"])
    chosen = counts.most_common(1)[0][0]
    student = work / "retrofit_mlp_40_fromsel" / "final"
    config = json.loads((student / "config.json").read_text())
    assert config["kvpop_kv_configuration"] == chosen  # the student trained under the selector's configuration
    trainer = torch.load(student / "trainer_state.pt", weights_only=False)
    assert trainer["config"]["init_backbone"] == str(work / "k64_selector" / "final")
    assert composed and all(r["method"] == "kaizen+kvpop" for r in composed)
    # the student started from the selector's backbone: after 2 steps at lr 1e-4 it is closer to it than to the teacher
    selector = load_file(str(work / "k64_selector" / "final" / "model.safetensors"))
    teacher_w = load_file(str(Path(teacher) / "model.safetensors"))
    final = load_file(str(student / "model.safetensors"))
    key = "model.layers.1.self_attn.k_proj.weight"
    assert (final[key] - selector[key]).norm() < (final[key] - teacher_w[key]).norm()
