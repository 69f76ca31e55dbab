"""benchmarks/kvpop_table.py --smoke: the Table 1 analog's rows, labels, priority order and bad --student values."""

import argparse
import json
from pathlib import Path

import pytest

from kvlearn.errors import KVLearnError
from benchmark_loader import load_benchmark



def load_script():
    return load_benchmark("kvpop_table")


def test_smoke_rows_carry_the_label_and_the_registry_method(tmp_path):
    script = load_script()
    out = tmp_path / "table.json"
    assert script.main(["--smoke", "--splits", "eval", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["complete"] is True and data["command"].startswith("python benchmarks/kvpop_table.py --smoke")
    keys = {(r["method"], r["registry_method"], r["budget"]) for r in data["rows"]}
    assert keys == ({("teacher", "dense", 256)} | {("kvpop_untrained", "kvpop", b) for b in (96, 48)}
                    | {(m, m, b) for m in ("streaming", "tova") for b in (96, 48)})
    assert all(r["protocol"] == "bounded" and r["n"] == 2 for r in data["rows"])
    assert (tmp_path / "kvpop_table.png").stat().st_size > 1000


def test_time_guard_order_and_bad_students(tmp_path):
    script = load_script()
    out = tmp_path / "t.json"
    assert script.main(["--smoke", "--minutes", "0", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    # the teacher first, then the tightest budget with the students before the baselines
    assert data["not_run"][:4] == ["teacher/bounded/eval", "teacher/bounded/heldout",
                                   "kvpop_untrained/bounded/eval/B=48", "streaming/bounded/eval/B=48"]
    assert script.main(["--smoke", "--student", "x=kvpop", "--out", str(out)]) == 2
    assert script.main(["--smoke", "--student", "x=bogus:p", "--out", str(out)]) == 2


def test_students_are_evaluated_under_their_trained_window_and_scorer(tmp_path):
    """A student's rows use the fields its checkpoint records (window, scorer, ...), not the harness defaults
    (window 32, MLP): a retrofit at window 256 is measured at window 256, with the budget from --budgets."""
    script = load_script()
    (tmp_path / "config.json").write_text(json.dumps({"kvpop": {"sinks": 4, "window": 256, "topk": 764,
                                                                 "scorer": "linear", "delayed_readout": True}}))
    args = argparse.Namespace(protocols="bounded", splits="eval", baselines="none", budgets="1024,512", tasks="vt",
                              n_per_task=1, context=4096, batch_size=1, chunk_size=256, sinks=4)
    runs, skipped = script.plan_runs(args, [("kvpop", "kvpop", str(tmp_path))])
    assert skipped == {}
    student = [(c.budget, c.method_config) for label, _, _, c in runs if label == "kvpop"]
    assert [(b, cfg.window, cfg.topk, cfg.scorer) for b, cfg in student] == [(512, 256, 252, "linear"),
                                                                            (1024, 256, 764, "linear")]


def test_state_in_budget_is_the_table_rule_and_0_is_the_ablation(tmp_path):
    """A KVpop student's runs carry ``state_in_budget=True`` by default (Table 1's rule: an mLSTM student's cache
    gives its state's bytes back from the top-k) and False under ``--state-in-budget 0``; other methods carry none."""
    script = load_script()
    (tmp_path / "config.json").write_text(json.dumps({"kvpop": {"sinks": 4, "window": 256, "scorer": "mlstm"}}))
    args = argparse.Namespace(protocols="bounded", splits="eval", baselines="streaming", budgets="512", tasks="vt",
                              n_per_task=1, context=4096, batch_size=1, chunk_size=256, sinks=4, no_teacher=True)
    for flag, expected in (("1", True), ("0", False)):
        args.state_in_budget = flag
        runs, _ = script.plan_runs(args, [("kvpop", "kvpop", str(tmp_path))])
        kvpop = [c for label, _, _, c in runs if label == "kvpop"]
        assert [c.method_config.state_in_budget for c in kvpop] == [expected]
        assert [c.options for label, _, _, c in runs if label == "streaming"] == [None]


def test_no_teacher_leaves_out_only_the_teacher_rows(tmp_path):
    """``--no-teacher`` (parallel parts of one table): the plan without the teacher's runs, the rest unchanged."""
    script = load_script()
    args = argparse.Namespace(protocols="bounded", splits="all", baselines="streaming", budgets="512", tasks="vt",
                              n_per_task=1, context=4096, batch_size=1, chunk_size=256, sinks=4)
    full, _ = script.plan_runs(args, [])
    args.no_teacher = True
    part, _ = script.plan_runs(args, [])
    assert [r[0] for r in full if r[0] == "teacher"] == ["teacher", "teacher"]  # one per split
    assert [r[:3] for r in part] == [r[:3] for r in full if r[0] != "teacher"] and part


def student_folder(path: Path, window: int) -> str:
    """A KVpop checkpoint folder whose ``config.json`` records ``window`` (its minimum budget: sinks + window + 1)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"kvpop": {"sinks": 4, "window": window, "scorer": "linear"}}))
    return str(path)


def test_budgets_below_a_students_trained_window_are_skipped_not_fatal(tmp_path):
    """Window 256 + 4 sinks needs a budget >= 261: at the default budgets 1024,512,256 the student's 256 runs are
    skipped with the reason (the baselines still run there); a student with no valid budget at all is an error."""
    script = load_script()
    args = argparse.Namespace(protocols="bounded", splits="all", baselines="streaming", budgets="1024,512,256",
                              tasks="vt", n_per_task=1, context=4096, batch_size=1, chunk_size=256, sinks=4)
    students = [("kvpop", "kvpop", student_folder(tmp_path / "w256", 256))]
    runs, skipped = script.plan_runs(args, students)
    assert set(skipped) == {"kvpop/bounded/eval/B=256", "kvpop/bounded/heldout/B=256"}
    assert all(why.startswith("budget=256 is invalid") and ">= 261" in why for why in skipped.values())
    assert [(r[0], r[3].split, r[3].budget) for r in runs if r[0] != "teacher"] == [
        ("streaming", "eval", 256), ("streaming", "heldout", 256),
        ("kvpop", "eval", 512), ("streaming", "eval", 512), ("kvpop", "heldout", 512), ("streaming", "heldout", 512),
        ("kvpop", "eval", 1024), ("streaming", "eval", 1024), ("kvpop", "heldout", 1024), ("streaming", "heldout", 1024)]
    # a KVpop student's state counts toward its budget (the paper's Table 1 rule); the baselines take no such option
    assert all(r[3].options["state_in_budget"] is True for r in runs if r[0] == "kvpop")
    assert all(not r[3].options for r in runs if r[0] == "streaming")
    args.budgets = "256,128"
    with pytest.raises(KVLearnError, match=r"--student kvpop=kvpop: no budget of --budgets 256,128 is valid"):
        script.plan_runs(args, students)


def test_smoke_records_a_skipped_student_budget_and_runs_the_rest(tmp_path, capsys):
    """Window 64 + 4 sinks: the smoke budget 48 is below the minimum 69, 96 is not; the process carries on."""
    script = load_script()
    out = tmp_path / "t.json"
    student = f"w64=kvpop:{student_folder(tmp_path / 'w64', 64)}"
    assert script.main(["--smoke", "--splits", "eval", "--baselines", "none", "--no-teacher", "--student", student,
                        "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert list(data["skipped"]) == ["w64/bounded/eval/B=48"] and ">= 69" in data["skipped"]["w64/bounded/eval/B=48"]
    assert {(r["method"], r["budget"]) for r in data["rows"]} == {("w64", 96)}
    assert data["complete"] is True and data["not_run"] == []
    assert [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("skipped ")] == [
        f"skipped w64/bounded/eval/B=48: {data['skipped']['w64/bounded/eval/B=48']}"]
    too_wide = f"w128=kvpop:{student_folder(tmp_path / 'w128', 128)}"  # minimum 133: neither 96 nor 48
    assert script.main(["--smoke", "--student", too_wide, "--out", str(tmp_path / "none.json")]) == 2
    assert "kvpop_table: error: --student w128=kvpop: no budget of --budgets 96,48 is valid" in capsys.readouterr().err
    assert not (tmp_path / "none.json").exists()


@pytest.mark.parametrize("done", [0, 1])
def test_a_process_killed_mid_table_leaves_a_file_listing_the_runs_not_done(done, tmp_path, monkeypatch,
                                                                          crashing_evaluate):
    """Every save lists the runs not done yet: a crash after ``done`` runs (a CUDA OOM, a kill) leaves a file that
    is not complete (it used to say ``complete: true, not_run: []``, and ``kvlearn.results merge`` believed it)."""
    script = load_script()
    monkeypatch.setattr(script, "evaluate", crashing_evaluate(script.evaluate, done))
    out = tmp_path / "t.json"
    with pytest.raises(RuntimeError, match="out of memory"):
        script.main(["--smoke", "--splits", "eval", "--out", str(out)])
    data = json.loads(out.read_text())
    plan = ["teacher/bounded/eval"] + [f"{m}/bounded/eval/B={b}" for b in (48, 96)
                                       for m in ("kvpop_untrained", "streaming", "tova")]
    assert data["complete"] is False and data["not_run"] == plan[done:]
    assert {r["method"] for r in data["rows"]} == ({"teacher"} if done else set())


def test_a_run_its_deadline_cut_between_families_stays_under_not_run(tmp_path, monkeypatch, deadline_between_families):
    """A run whose deadline came after its first family returns no row for the others (``evaluate`` leaves out the
    families it never started): the run stays under ``not_run`` and the file is not complete (it used to count as
    done, and a file missing whole families said ``complete: true``)."""
    script = load_script()
    monkeypatch.setattr(script, "evaluate", deadline_between_families(script.evaluate, 1))
    out = tmp_path / "t.json"
    assert script.main(["--smoke", "--splits", "eval", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    cut = [r for r in data["rows"] if r["method"] == "kvpop_untrained" and r["budget"] == 48]
    assert len(cut) == 1 and len({r["task"] for r in data["rows"] if r["method"] == "teacher"}) > 1
    later = [r["task"] for r in data["rows"] if r["method"] == "teacher"][1:]  # the families after the first
    assert data["complete"] is False and data["not_run"] == ["kvpop_untrained/bounded/eval/B=48:" + ",".join(later)]
