"""benchmarks/kaizen_8x_seeds.py: the 8x recipe's runs per seed and stage against the bar, checked on a hand-made
table, and on the committed table of record."""

import json

import pytest

from benchmark_loader import load_benchmark

TASKS = ("trace", "niah", "vt", "recall")


def rows_of(method, split, accs, selector=None, factor=None, device=None):
    out = []
    for task, acc in zip(TASKS, accs):
        r = {"method": method, "protocol": "bounded", "split": split, "task": task, "accuracy": acc, "n": 100}
        if selector:
            r.update(selector=selector, factor=factor)
        if device:
            r["device"] = device
        out.append(r)
    return out


@pytest.fixture
def table(tmp_path):
    rows = rows_of("control", "eval", (1.0, 0.9, 1.0, 1.0)) + rows_of("control", "heldout", (1.0, 1.0, 1.0, 1.0))
    # seed 5: a first stage, a second draw and a refinement; seed 6: a first stage only, over the bar on held out
    for split, accs in (("eval", (1.0, 0.8, 1.0, 0.9)), ("heldout", (1.0, 0.9, 1.0, 0.9))):
        rows += rows_of("kaizen", split, accs, "a5", 8.0, "GPU B")
    for split, accs in (("eval", (1.0, 0.7, 1.0, 0.9)), ("heldout", (1.0, 0.9, 1.0, 0.9))):
        rows += rows_of("kaizen", split, accs, "a5_again", 8.0, "GPU B")
    for split, accs in (("eval", (1.0, 0.9, 1.0, 1.0)), ("heldout", (1.0, 0.95, 1.0, 0.97))):
        rows += rows_of("kaizen", split, accs, "a5_refined", 8.0, "GPU B")
    for split, accs in (("eval", (1.0, 0.8, 1.0, 0.95)), ("heldout", (0.9, 0.8, 1.0, 0.9))):
        rows += rows_of("kaizen", split, accs, "a6", 8.0, "GPU B")
    rows += rows_of("kaizen", "eval", (0.0, 0.0, 0.0, 0.0), "a5", 4.0, "GPU B")  # another factor: not read
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"schema": "kvlearn.results.v1", "kind": "accuracy", "device": "GPU A",
                                "commit": "abc", "rows": rows}))
    return path


RUNS = ["5:first=a5", "5:first=a5_again", "5:refined=a5_refined", "6:first=a6"]


def test_rows_and_summary_against_hand_computed_values(table, tmp_path):
    script = load_benchmark("kaizen_8x_seeds")
    out, png = tmp_path / "seeds.json", tmp_path / "seeds.png"
    args = ["--table", str(table), "--out", str(out), "--plot", str(png)]
    assert script.main(args + [a for run in RUNS for a in ("--run", run)]) == 0
    data = json.loads(out.read_text())
    assert data["kind"] == "comparison" and data["table_commit"] == "abc" and png.stat().st_size > 0
    got = {(r["label"], r["split"]): r for r in data["rows"]}
    assert len(got) == 8
    r = got[("a5", "eval")]  # control 3.9 / 4, run 3.7 / 4
    assert r["mean"] == pytest.approx(0.925) and r["control_mean"] == pytest.approx(0.975)
    assert r["of_control"] == pytest.approx(3.7 / 3.9) and r["under_control"] == pytest.approx(0.05)
    assert r["within_bar"] is True and r["device"] == "GPU B" and r["stage"] == "first" and r["seed"] == 5
    # its standard error by hand: control p(1-p)/n = 0.09/100 (niah); run 0.16/100 + 0.09/100; each / 16
    assert r["under_control_se"] == pytest.approx(((0.0009 + 0.0016 + 0.0009) / 16) ** 0.5)
    assert got[("a5_again", "eval")]["under_control"] == pytest.approx(0.075)  # over the bar
    assert got[("a5_again", "eval")]["within_bar"] is False
    assert got[("a5_refined", "heldout")]["mean"] == pytest.approx(3.92 / 4)
    assert got[("a6", "heldout")]["under_control"] == pytest.approx(0.1) and not got[("a6", "heldout")]["within_bar"]
    s = data["summary"]
    assert s["first/eval"] == {"runs": 3, "seeds": 2, "within_bar": 2,
                               "of_control_min": pytest.approx(3.6 / 3.9), "of_control_max": pytest.approx(3.75 / 3.9)}
    assert s["refined/heldout"]["within_bar"] == 1 and s["refined/heldout"]["seeds"] == 1
    assert s["first/heldout"]["within_bar"] == 2  # a5 0.05 under (at the bar), a5_again 0.05, a6 0.1


@pytest.mark.parametrize("run, message", [
    ("5=a5", "expected SEED:STAGE=LABEL"),
    ("x:first=a5", "expected SEED:STAGE=LABEL"),
    ("5:second=a5", "STAGE one of first, refined"),
    ("5:first=nobody", "selector 'nobody' has no rows"),
])
def test_bad_runs_are_one_line_errors(table, tmp_path, run, message, capsys):
    script = load_benchmark("kaizen_8x_seeds")
    with pytest.raises(SystemExit) as exit_info:
        script.main(["--table", str(table), "--out", str(tmp_path / "o.json"), "--run", run])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()


def test_a_run_missing_a_family_is_refused(table, tmp_path, capsys):
    data = json.loads(table.read_text())
    data["rows"] = [r for r in data["rows"] if not (r.get("selector") == "a6" and r["split"] == "heldout"
                                                     and r["task"] == "recall")]
    table.write_text(json.dumps(data))
    script = load_benchmark("kaizen_8x_seeds")
    with pytest.raises(SystemExit):
        script.main(["--table", str(table), "--out", str(tmp_path / "o.json"), "--run", "6:first=a6"])
    assert "a6 on heldout has families ['niah', 'trace', 'vt']" in capsys.readouterr().err


def test_the_record_runs_exist_in_the_committed_table_and_match_its_verdicts(tmp_path):
    """Every default run is in results/kaizen_table.json, and each (run, split) agrees with the acceptance file's
    selector_within_control verdict (computed there by other code)."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    script = load_benchmark("kaizen_8x_seeds")
    out = tmp_path / "seeds.json"
    assert script.main(["--table", str(repo / "results/kaizen_table.json"), "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2 * len(script.RECORD_RUNS)
    verdicts = {(r["label"], r["split"]): r for r in
                json.loads((repo / "results/kaizen_acceptance.json").read_text())["rows"]
                if r["criterion"] == "selector_within_control"}
    for r in rows:
        v = verdicts[(r["label"], r["split"])]
        assert r["within_bar"] == v["met"] and r["under_control"] == pytest.approx(v["value"])
        assert r["of_control"] == pytest.approx(v["of_control"])
