"""benchmarks/kvpop_table.py --smoke: the Table 1 analog's rows, labels, priority order and bad --student values."""

import importlib.util
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def load_script():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("kvpop_table", BENCH / "kvpop_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    import argparse

    script = load_script()
    (tmp_path / "config.json").write_text(json.dumps({"kvpop": {"sinks": 4, "window": 256, "topk": 764,
                                                                 "scorer": "linear", "delayed_readout": True}}))
    args = argparse.Namespace(protocols="bounded", splits="eval", baselines="none", budgets="1024,512", tasks="vt",
                              n_per_task=1, context=4096, batch_size=1, chunk_size=256, sinks=4)
    runs = script.plan_runs(args, [("kvpop", "kvpop", str(tmp_path))])
    student = [(c.budget, c.method_config) for label, _, _, c in runs if label == "kvpop"]
    assert [(b, cfg.window, cfg.topk, cfg.scorer) for b, cfg in student] == [(512, 256, 252, "linear"),
                                                                            (1024, 256, 764, "linear")]


def test_no_teacher_leaves_out_only_the_teacher_rows(tmp_path):
    """``--no-teacher`` (parallel parts of one table): the plan without the teacher's runs, the rest unchanged."""
    import argparse

    script = load_script()
    args = argparse.Namespace(protocols="bounded", splits="all", baselines="streaming", budgets="512", tasks="vt",
                              n_per_task=1, context=4096, batch_size=1, chunk_size=256, sinks=4)
    full = script.plan_runs(args, [])
    args.no_teacher = True
    part = script.plan_runs(args, [])
    assert [r[0] for r in full if r[0] == "teacher"] == ["teacher", "teacher"]  # one per split
    assert [r[:3] for r in part] == [r[:3] for r in full if r[0] != "teacher"] and part
