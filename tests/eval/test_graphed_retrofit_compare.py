"""``benchmarks/graphed_retrofit_compare.py`` (a graphed retrofit against an eager one) on hand-made logs, and its
device script as a CPU smoke test (two eager runs of one recipe: the comparison must find them equal)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from graphed_retrofit_compare import compare, main  # noqa: E402


def write_log(path: Path, kd: list[float], step_s: list[float]) -> Path:
    seconds, rows = 0.0, []
    for i, (k, s) in enumerate(zip(kd, step_s)):
        seconds += s
        rows.append({"step": i + 1, "kd": k, "seconds": seconds})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_eval(path: Path, acc: dict[str, float]) -> Path:
    path.write_text(json.dumps({"rows": [{"task": t, "accuracy": a} for t, a in acc.items()]}))
    return path


def test_compare_on_hand_made_logs(tmp_path):
    n = 40
    eager = write_log(tmp_path / "e.jsonl", [1.0] * n, [0.5] * 5 + [0.1] * (n - 5))
    # the graphed run: slow capture at the start, then 0.06 s a step; kd 10% higher in the last tenth only
    graphed = write_log(tmp_path / "g.jsonl", [1.0] * 36 + [1.1] * 4, [2.0] * 5 + [0.06] * (n - 5))
    ee = write_eval(tmp_path / "ee.json", {"niah": 0.9, "vt": 0.5})
    ge = write_eval(tmp_path / "ge.json", {"niah": 0.8, "vt": 0.5})
    result = compare(eager, graphed, skip=5, eager_eval=ee, graphed_eval=ge)
    c = result["comparison"]
    assert result["runs"]["eager"]["step_ms_median"] == pytest.approx(100.0)
    assert c["graphed_over_eager_step_time"] == pytest.approx(0.6)
    assert c["kd_max_tenth_rel_diff"] == pytest.approx(0.1)
    assert c["kd_last_tenth"] == pytest.approx({"eager": 1.0, "graphed": 1.1})
    assert c["mean_accuracy_diff"] == pytest.approx(-0.05)
    assert c["max_family_accuracy_abs_diff"] == pytest.approx(0.1)


def test_bad_input_is_a_one_line_error(tmp_path, capsys):
    eager = write_log(tmp_path / "e.jsonl", [1.0] * 30, [0.1] * 30)
    short = write_log(tmp_path / "g.jsonl", [1.0] * 20, [0.1] * 20)
    out = tmp_path / "c.json"
    assert main(["--eager", str(eager), "--graphed", str(short), "--out", str(out)]) == 2
    assert "logged 30 and 20 steps" in capsys.readouterr().err
    assert main(["--eager", str(eager), "--graphed", str(eager), "--skip", "25", "--out", str(out)]) == 2
    assert "expected more than skip + 10" in capsys.readouterr().err
    assert main(["--eager", str(eager), "--graphed", str(eager), "--eager-eval", str(eager), "--out", str(out)]) == 2
    assert "only one of --eager-eval/--graphed-eval" in capsys.readouterr().err
    assert not out.exists()


def test_device_script_finds_two_runs_of_one_recipe_equal(make_teacher, tmp_path):
    teacher = make_teacher(2, 2)
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "WORK_DIR": str(tmp_path), "DEVICE": "cpu", "CONTEXT": "256",
           "MODEL": teacher, "STEPS": "14", "SKIP": "2", "BUDGET": "40", "N": "2", "SCORER": "mlp", "GRAPH_FLAG": "",
           "EVAL_ARGS": "--sinks 2 --tasks vt,niah --threads 1",
           "EXTRA": "--sinks 2 --window 8 --seq-len 128 --batch-size 2 --num-workers 0"}
    run = subprocess.run(["bash", "benchmarks/device/graphed_retrofit_compare.sh"], env=env, capture_output=True,
                         text=True, timeout=600, cwd=ROOT)
    assert "eager retrofit rc=0" in run.stdout and "graphed retrofit rc=0" in run.stdout, run.stdout + run.stderr
    result = json.loads((out / "graphed_retrofit_compare.json").read_text())
    assert result["schema"] == "kvlearn.results.v1" and result["device"].startswith("cpu")
    assert result["command"].startswith("STEPS=14 SCORER=mlp") and result["commit"]
    c = result["comparison"]
    runs = {r["run"]: r for r in result["rows"]}
    assert runs["eager"]["steps"] == runs["graphed"]["steps"] == 14
    assert c["kd_max_tenth_rel_diff"] < 1e-5 and c["kd_first_step_abs_diff"] < 1e-6  # one recipe, one seed
    assert c["mean_accuracy_diff"] == 0.0
    assert set(runs["eager"]["accuracy"]) == {"vt", "niah", "mean"}
    assert (out / "train_log_graphed.jsonl.gz").is_file() and not list(out.glob("eval_*.log"))
