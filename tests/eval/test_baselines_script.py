"""benchmarks/eviction_baselines.py --smoke: the baselines table and Pareto plot on a tiny random model."""

import json
from pathlib import Path

import pytest

from kvlearn.methods import PROTOCOLS, is_available
from benchmark_loader import load_benchmark



def load_script():
    return load_benchmark("eviction_baselines")


def test_smoke_run_writes_rows_per_method_budget_protocol_and_the_pareto_plot(tmp_path):
    script = load_script()
    out = tmp_path / "table.json"
    assert script.main(["--smoke", "--methods", "streaming", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["schema"] == "kvlearn.results.v1" and data["kind"] == "accuracy" and data["complete"] is True
    assert data["command"].startswith("python benchmarks/eviction_baselines.py --smoke")
    keys = {(r["method"], r["protocol"], r["budget"]) for r in data["rows"]}
    assert keys == {("dense", "bounded", 256)} | {("streaming", p, b) for p in PROTOCOLS for b in (96, 48)}
    assert all(r["split"] == "eval" and r["n"] == 2 for r in data["rows"])
    assert {r["task"] for r in data["rows"]} == {"niah", "vt"}
    assert (tmp_path / "table.png").stat().st_size > 1000  # the plot is named after --out


def test_time_guard_and_unavailable_methods_are_recorded(tmp_path):
    script = load_script()
    out = tmp_path / "t.json"
    assert script.main(["--smoke", "--minutes", "0", "--out", str(out), "--plot", str(tmp_path / "p.png")]) == 0
    data = json.loads(out.read_text())
    assert data["rows"] == [] and data["complete"] is False
    assert data["not_run"][0] == "dense/bounded/eval" and "streaming/context/eval/B=48" in data["not_run"]
    assert set(data["skipped"]) == {m for m in ("tova", "h2o", "snapkv", "pyramidkv", "knorm", "random") if not is_available(m)}
    assert script.main(["--smoke", "--methods", "bogus", "--out", str(out)]) == 2


@pytest.mark.parametrize("done", [0, 1])
def test_a_process_killed_mid_table_leaves_a_file_listing_the_runs_not_done(done, tmp_path, monkeypatch,
                                                                          crashing_evaluate):
    """Every save lists the runs not done yet: a crash after ``done`` runs (a CUDA OOM, a kill) leaves a file that
    is not complete (it used to say ``complete: true, not_run: []``)."""
    script = load_script()
    monkeypatch.setattr(script, "evaluate", crashing_evaluate(script.evaluate, done))
    out = tmp_path / "t.json"
    with pytest.raises(RuntimeError, match="out of memory"):
        script.main(["--smoke", "--methods", "streaming", "--protocols", "bounded", "--out", str(out)])
    data = json.loads(out.read_text())
    plan = ["dense/bounded/eval", "streaming/bounded/eval/B=96", "streaming/bounded/eval/B=48"]
    assert data["complete"] is False and data["not_run"] == plan[done:]
    assert {r["method"] for r in data["rows"]} == ({"dense"} if done else set())


def test_recorded_paths_name_no_machine_folder(tmp_path):
    """Paths the table scripts record (commands, ``model`` fields, ``LABEL=METHOD:PATH`` students) are repository-
    relative or ``$TMPDIR/...``, never this machine's temporary folder."""
    import tempfile

    script = load_script()
    tmp = Path(tempfile.gettempdir())
    assert script.repo_relative(str(tmp / "table_x" / "final")) == "$TMPDIR/table_x/final"
    assert script.repo_relative(f"kvpop=kvpop:{tmp / 's'}") == "kvpop=kvpop:$TMPDIR/s"
    assert script.repo_relative(str(script.REPO / "checkpoints" / "testbed-teacher")) == "checkpoints/testbed-teacher"
    assert script.repo_relative("--budgets") == "--budgets"
    # kaizen_table.py's --selector LABEL=PATH (session 54's device rows recorded /root/out/kz/... here)
    assert script.repo_relative(f"kaizen8_s2={tmp / 'kz' / 'final'}") == "kaizen8_s2=$TMPDIR/kz/final"
    assert script.repo_relative("kaizen8=checkpoints/testbed-teacher") == "kaizen8=checkpoints/testbed-teacher"
    assert script.repo_relative("--minutes=2") == "--minutes=2"
    # the recorded command leaves $TMPDIR expandable (it was quoted: '$TMPDIR/t.json') and still quotes spaces
    command = script.recorded_command(["--selector", f"k8={tmp / 'kz' / 'final'}", "--out", str(tmp / "t.json"),
                                       "--note", "two words"])
    assert command == ("python benchmarks/eviction_baselines.py --selector k8=$TMPDIR/kz/final --out $TMPDIR/t.json "
                       "--note 'two words'")


def test_a_run_its_deadline_cut_between_families_stays_under_not_run(tmp_path, monkeypatch, deadline_between_families):
    """A run whose deadline came after its first family (``evaluate`` leaves out the families it never started)
    stays under ``not_run``, and the file is not complete."""
    script = load_script()
    monkeypatch.setattr(script, "evaluate", deadline_between_families(script.evaluate, 1))
    out = tmp_path / "t.json"
    assert script.main(["--smoke", "--methods", "streaming", "--protocols", "bounded", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert len([r for r in data["rows"] if r["method"] == "streaming" and r["budget"] == 96]) == 1
    assert len([r for r in data["rows"] if r["method"] == "streaming" and r["budget"] == 48]) > 1
    later = [r["task"] for r in data["rows"] if r["method"] == "streaming" and r["budget"] == 48][1:]
    assert data["complete"] is False and data["not_run"] == ["streaming/bounded/eval/B=96:" + ",".join(later)]
