"""benchmarks/retrofit_fsdp_compare.py: step times, speed-up, final loss means and accuracy of a one-process and a
sharded retrofit against values computed by hand from two written logs; one-line errors for mismatched runs."""

import json

import pytest

from benchmark_loader import load_benchmark
from kvlearn.results import make_results, write_results


def _run(folder, step_seconds, losses):
    folder.mkdir()
    t, lines = 0.0, []
    for i, (dt, loss) in enumerate(zip(step_seconds, losses)):
        t += dt
        lines.append(json.dumps({"step": i + 1, "loss": loss, "kd": loss / 2, "boundary": loss / 2, "seconds": t}))
    (folder / "train_log.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _eval(path, accuracies):
    rows = [{"method": "kvpop", "task": t, "accuracy": a, "n": 10, "split": "eval", "budget": 512}
            for t, a in accuracies.items()]
    write_results(path, make_results("accuracy", rows, device="cpu", command="test"))
    return str(path)


def test_speedup_and_loss_means_match_hand_computed_values(tmp_path):
    script = load_benchmark("retrofit_fsdp_compare")
    # one process: a 5 s compile step, then 0.2 s steps; sharded: 0.1 s steps (twice as fast)
    one = _run(tmp_path / "one", [5.0] + [0.2] * 9, [1.0] * 10)
    two = _run(tmp_path / "two", [7.0] + [0.1] * 9, [1.1] * 5 + [0.9] * 5)
    out = tmp_path / "r.json"
    assert script.main(["--one", str(one), "--sharded", str(two), "--world", "2", "--skip", "1", "--last", "4",
                        "--eval-one", _eval(tmp_path / "e1.json", {"niah": 1.0, "vt": 0.5}),
                        "--eval-sharded", _eval(tmp_path / "e2.json", {"niah": 0.75, "vt": 0.5}),
                        "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["processes"] for r in rows] == [1, 2]
    assert rows[0]["step_ms_median"] == pytest.approx(200.0) and rows[1]["step_ms_median"] == pytest.approx(100.0)
    assert rows[0]["speedup"] == 1.0 and rows[1]["speedup"] == pytest.approx(2.0)
    assert rows[1]["loss_mean_last"] == pytest.approx(0.9) and rows[1]["kd_mean_last"] == pytest.approx(0.45)
    assert rows[1]["loss_rel_diff_mean"] == pytest.approx(0.1)  # |1.1 - 1| and |0.9 - 1| over 1
    assert rows[0]["mean_accuracy"] == 0.75 and rows[1]["mean_accuracy"] == 0.625
    assert out.with_suffix(".png").stat().st_size > 0


def test_mismatched_runs_are_one_line_errors(tmp_path):
    script = load_benchmark("retrofit_fsdp_compare")
    one = _run(tmp_path / "one", [1.0] * 4, [1.0] * 4)
    two = _run(tmp_path / "two", [1.0] * 3, [1.0] * 3)
    with pytest.raises(SystemExit, match="logged different steps"):
        script.main(["--one", str(one), "--sharded", str(two), "--world", "2", "--out", str(tmp_path / "r.json")])
    with pytest.raises(SystemExit, match="--world 1 is invalid"):
        script.main(["--one", str(one), "--sharded", str(one), "--world", "1", "--out", str(tmp_path / "r.json")])
    with pytest.raises(SystemExit, match="no such file"):
        script.main(["--one", str(tmp_path), "--sharded", str(one), "--world", "2", "--out", str(tmp_path / "r.json")])
