"""``benchmarks/device/retrofit.sh`` (the device script of the KV-Kaizen composition runs) as a CPU smoke test on a tiny
GQA Qwen3: a retrofit under a per-layer configuration (``--kv-bits 4,share,2``), its composed evaluation on both
splits, the three single-part evaluations of ``DECOMPOSE=1`` (side by side with ``PARALLEL_EVALS=1``) and the exported
bf16 student. The representation-alone part must serve the configuration the student trained under (recorded in its
config.json), not the uniform choice at the same factor."""

import json
import os
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def rows_of(path: Path) -> list[dict]:
    return json.loads(path.read_text())["rows"]


def test_decompose_serves_the_trained_configuration_and_every_file_is_written(make_teacher, tmp_path):
    teacher = make_teacher(3, 2)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "WORK_DIR": str(tmp_path), "DEVICE": "cpu", "CONTEXT": "256",
           "MODEL": teacher, "STEPS": "2", "BUDGET": "40", "N": "1", "TAG": "smoke", "COMPOSE_TARGET": "51.2",
           "DECOMPOSE": "1", "PARALLEL_EVALS": "1", "EVAL_ARGS": "--sinks 2 --tasks vt --threads 1",
           "EXTRA": "--kv-bits 4,share,2 --sinks 2 --window 8 --seq-len 128 --batch-size 2 --num-workers 0"}
    run = subprocess.run(["bash", "benchmarks/device/retrofit.sh"], env=env, capture_output=True, text=True,
                         timeout=600, cwd=ROOT)
    assert "retrofit rc=0" in run.stdout, run.stdout + run.stderr
    tag = "mlp_40_smoke"
    for split in ("eval", "heldout"):
        (row,) = rows_of(out / f"kaizen_kvpop_{tag}_{split}.json")
        assert row["method"] == "kaizen+kvpop" and row["configurations"] == {"b4 share b2": 1}
        assert abs(row["factor"] - 8 * 256 / 40) < 1e-6  # 8x representation x keep 40 of 256
    (rep,) = rows_of(out / f"decompose_{tag}_kaizen_static.json")
    assert rep["configurations"] == {"b4 share b2": 1} and abs(rep["factor"] - 8.0) < 1e-6  # not the uniform b2
    (evict,) = rows_of(out / f"decompose_{tag}_kvpop.json")
    assert evict["method"] == "kvpop" and evict["budget"] == 40
    (dense,) = rows_of(out / f"decompose_{tag}_dense.json")
    assert dense["method"] == "dense"
    with tarfile.open(out / f"kvpop_{tag}.tar") as tar:
        names = tar.getnames()
    assert f"kvpop-{tag}/config.json" in names and f"kvpop-{tag}/model.safetensors" in names
    assert not list(out.glob("eval_*.log"))  # the parallel evaluations' logs were appended to the run's log
