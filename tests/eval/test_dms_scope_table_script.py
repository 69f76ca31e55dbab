"""benchmarks/dms_scope_table.py: the two DMS scopes side by side, checked on hand-made result files."""

import json

import pytest

from benchmark_loader import load_benchmark

TASKS = ("trace", "niah", "vt", "recall")


def row(method, split, budget, task, accuracy):
    return {"method": method, "protocol": "bounded", "split": split, "budget": budget, "task": task,
            "accuracy": accuracy, "n": 100}


def write(path, rows, device="GPU X"):
    path.write_text(json.dumps({"schema": "kvlearn.results.v1", "kind": "accuracy", "device": device, "rows": rows}))
    return str(path)


@pytest.fixture
def files(tmp_path):
    teacher = {"eval": (1.0, 0.9, 1.0, 1.0), "heldout": (1.0, 1.0, 1.0, 1.0)}
    model = {"eval": (1.0, 0.3, 0.4, 0.0), "heldout": (0.9, 0.1, 0.3, 0.0)}
    rows = [row("teacher", s, 4096, t, a) for s, accs in teacher.items() for t, a in zip(TASKS, accs)]
    rows += [row("dms", s, 512, t, a) for s, accs in model.items() for t, a in zip(TASKS, accs)]
    rows += [row("kvpop", "eval", 512, t, 0.5) for t in TASKS]  # another method's rows are not read
    table = write(tmp_path / "table.json", rows)
    head_eval = write(tmp_path / "h_eval.json", [row("dms", "eval", 512, t, a) for t, a in zip(TASKS, (1.0, 0.9, 1.0, 0.7))])
    head_held = write(tmp_path / "h_held.json", [row("dms", "heldout", 512, t, 0.5) for t in TASKS])
    return tmp_path, table, head_eval, head_held


def test_rows_against_hand_computed_means(files):
    tmp, table, head_eval, head_held = files
    script = load_benchmark("dms_scope_table")
    out = tmp / "cmp.json"
    assert script.main(["--table", table, "--head", head_eval, head_held, "--out", str(out),
                        "--plot", str(tmp / "cmp.png")]) == 0
    data = json.loads(out.read_text())
    assert data["device"] == "GPU X" and data["kind"] == "comparison" and (tmp / "cmp.png").stat().st_size > 0
    got = {(r["split"], r["scope"]): r for r in data["rows"]}
    assert got[("eval", "model")]["mean"] == pytest.approx(1.7 / 4)
    assert got[("eval", "model")]["relative"] == pytest.approx((1.7 / 4) / (3.9 / 4), abs=1e-4)
    assert got[("eval", "head")]["mean"] == pytest.approx(3.6 / 4)
    assert got[("eval", "head")]["gain_over_model"] == pytest.approx((3.6 - 1.7) / 4)
    assert got[("heldout", "head")]["relative"] == pytest.approx(0.5)
    assert got[("heldout", "model")]["tasks"] == {"niah": 0.1, "recall": 0.0, "trace": 0.9, "vt": 0.3}
    # the gain's binomial standard error, by hand: sum p(1-p)/n over each side's families, / 16, both sides added
    var_model = (0 + 0.3 * 0.7 + 0.4 * 0.6 + 0) / 100 / 16
    var_head = (0 + 0.9 * 0.1 + 0 + 0.7 * 0.3) / 100 / 16
    assert got[("eval", "head")]["gain_se"] == pytest.approx((var_model + var_head) ** 0.5, abs=1e-4)
    assert "gain_se" not in got[("eval", "model")]


def test_another_device_a_missing_budget_and_a_repeated_run_are_one_line_errors(files, capsys):
    tmp, table, head_eval, _ = files
    script = load_benchmark("dms_scope_table")
    other = write(tmp / "other.json", [row("dms", "eval", 512, t, 1.0) for t in TASKS], device="GPU Y")
    assert script.main(["--table", table, "--head", other, "--out", str(tmp / "o.json")]) == 2
    assert "measured on 'GPU Y'" in capsys.readouterr().err
    b256 = write(tmp / "b256.json", [row("dms", "eval", 256, t, 1.0) for t in TASKS])
    assert script.main(["--table", table, "--head", b256, "--out", str(tmp / "o.json")]) == 2
    assert "no DMS rows at budget 256" in capsys.readouterr().err
    assert script.main(["--table", table, "--head", head_eval, head_eval, "--out", str(tmp / "o.json")]) == 2
    assert "given twice" in capsys.readouterr().err
    assert not (tmp / "o.json").exists()
