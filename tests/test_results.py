"""kvlearn.results: the recorded command carries no absolute machine path; parts of a split run merge into one file."""

import sys
import tempfile

import pytest

from kvlearn.errors import KVLearnError
from kvlearn.results import command_line, portable_path, repo_root


def test_paths_inside_the_repository_are_relative_to_its_root(monkeypatch):
    root = repo_root()
    assert (root / "pyproject.toml").is_file()
    monkeypatch.setattr(sys, "argv", [str(root / "src/kvlearn/testbed/stats.py"), "--length", "4096",
                                      "--out", str(root / "results/testbed_stats.json")])
    # `python -m kvlearn.testbed.stats` puts the module's file in argv[0]: recorded as the -m command that ran
    assert command_line() == "python -m kvlearn.testbed.stats --length 4096 --out results/testbed_stats.json"


def test_output_and_temporary_folders_become_variables(monkeypatch, tmp_path):
    out = tmp_path / "device-out"
    monkeypatch.setenv("OUT", str(out))
    monkeypatch.setattr(sys, "argv", ["benchmarks/kvpop_ops.py", "--quick", f"--out={out}/kvpop_ops.json",
                                      "--model", tempfile.gettempdir() + "/testbed-teacher"])
    assert command_line() == ("python benchmarks/kvpop_ops.py --quick --out=$OUT/kvpop_ops.json "
                              "--model $TMPDIR/testbed-teacher")
    assert portable_path(str(out)) == "$OUT"
    assert portable_path(f"kaizen8_s1={out}/kaizen-t8_s1/final") == "kaizen8_s1=$OUT/kaizen-t8_s1/final"  # LABEL=PATH
    # the model folder an accuracy file records goes through the same rewrite as its command
    from kvlearn.cli import display_path

    assert display_path(tempfile.gettempdir() + "/retrofit/final") == "$TMPDIR/retrofit/final"
    assert display_path(str(repo_root() / "checkpoints/testbed-teacher")) == "checkpoints/testbed-teacher"


def test_kvlearn_entry_point_and_paths_elsewhere(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/kvlearn", "eval", "--model", "checkpoints/testbed-teacher"])
    assert command_line() == "kvlearn eval --model checkpoints/testbed-teacher"
    assert portable_path("/opt/models/x") == "/opt/models/x"  # outside the repository, $OUT and the temp folder
    assert portable_path("relative/path") == "relative/path"


def test_merge_results_of_a_run_split_over_gpus(tmp_path):
    from kvlearn.results import main as results_main
    from kvlearn.results import make_results, merge_results, read_results, write_results

    def row(method, task):
        return {"method": method, "protocol": "bounded", "split": "eval", "budget": 1024, "task": task, "accuracy": 1.0}

    a = make_results("accuracy", [row("dense", "niah"), row("tova", "niah")], device="cpu", command="a", commit="c1",
                     not_run=[], complete=True, wall_seconds=3.0)
    b = make_results("accuracy", [row("dense", "niah"), row("h2o", "niah")], device="cpu", command="b", commit="c1",
                     not_run=["h2o/context/eval/B=512"], complete=False, wall_seconds=5.0)
    m = merge_results([a, b], "a && b")
    assert [r["method"] for r in m["rows"]] == ["dense", "tova", "h2o"]  # the repeated full-cache row once
    assert m["not_run"] == ["h2o/context/eval/B=512"] and m["complete"] is False and m["wall_seconds"] == 5.0
    with pytest.raises(KVLearnError, match="differ in commit"):
        merge_results([a, {**b, "commit": "c2"}], "x")
    pa, pb = write_results(tmp_path / "a.json", a), write_results(tmp_path / "b.json", b)
    assert results_main(["merge", str(tmp_path / "m.json"), str(pa), str(pb)]) == 0
    assert read_results(tmp_path / "m.json")["command"] == "a && b"
    assert results_main(["merge", str(tmp_path / "m.json"), str(pa), str(tmp_path / "missing.json")]) == 2


def test_merge_across_runs_keeps_each_rows_run(tmp_path):
    """Parts of different runs merge only when asked; each row then carries its own run's commit, date and
    n_per_task, the file lists the runs, and a repeated row keeps the first part's."""
    from kvlearn.results import main as results_main
    from kvlearn.results import make_results, merge_results, read_results, write_results

    def row(method, acc):
        return {"method": method, "protocol": "bounded", "split": "eval", "budget": 512, "task": "niah",
                "accuracy": acc}

    a = make_results("accuracy", [row("teacher", 1.0), row("streaming", 0.2)], device="cuda", command="a",
                     commit="c1", n_per_task=100)
    b = make_results("accuracy", [row("teacher", 0.9), row("kvpop", 0.98)], device="cuda", command="b", commit="c2",
                     n_per_task=50)
    m = merge_results([a, b], "a; b", across_runs=True)
    assert [(r["method"], r["accuracy"], r["commit"], r["n_per_task"]) for r in m["rows"]] == [
        ("teacher", 1.0, "c1", 100), ("streaming", 0.2, "c1", 100), ("kvpop", 0.98, "c2", 50)]
    assert m["commit"] == "c1,c2" and [r["commit"] for r in m["runs"]] == ["c1", "c2"]
    assert "commit" not in a["rows"][0]  # the inputs are not modified
    with pytest.raises(KVLearnError, match="differ in device"):
        merge_results([a, {**b, "device": "cpu"}], "x", across_runs=True)
    pa, pb = write_results(tmp_path / "a.json", a), write_results(tmp_path / "b.json", b)
    assert results_main(["merge", str(tmp_path / "m.json"), str(pa), str(pb)]) == 2  # different commits
    assert results_main(["merge", "--across-runs", str(tmp_path / "m.json"), str(pa), str(pb)]) == 0
    assert read_results(tmp_path / "m.json")["commit"] == "c1,c2"
    c = make_results("accuracy", [row("h2o", 0.3)], device="cuda", command="c", commit="c2")
    assert merge_results([m, c], "m; c", across_runs=True)["commit"] == "c1,c2"  # a merged part's list, once each


def test_merge_keeps_kaizen_rows_of_other_selectors_and_factors():
    """KV-Kaizen rows share method, protocol, split, budget (the context) and task across selectors and factors:
    merging a baselines-only part with a selectors-only part keeps every selector's and every factor's row and drops
    only the control both parts measured (hand-built rows)."""
    from kvlearn.results import make_results, merge_results

    def row(method, factor, selector=None, model="teacher"):
        r = {"method": method, "protocol": "bounded", "split": "eval", "budget": 4096, "task": "niah",
             "factor": factor, "model": model, "accuracy": 0.5}
        return {**r, "selector": selector} if selector else r

    control = row("control", 1.0)
    baselines = make_results("accuracy", [control, row("static", 2.0), row("static", 4.0)], device="cuda",
                             command="b", commit="c1")
    selectors = make_results("accuracy", [control, row("kaizen", 4.571429, "kaizen4", "$OUT/kaizen-t4/final"),
                                          row("kaizen", 8.0, "kaizen8", "$OUT/kaizen-t8/final"),
                                          row("untrained_backbone", 4.571429, "kaizen4")], device="cuda",
                             command="s", commit="c1")
    m = merge_results([baselines, selectors], "b && s")
    assert [(r["method"], r["factor"], r.get("selector")) for r in m["rows"]] == [
        ("control", 1.0, None), ("static", 2.0, None), ("static", 4.0, None), ("kaizen", 4.571429, "kaizen4"),
        ("kaizen", 8.0, "kaizen8"), ("untrained_backbone", 4.571429, "kaizen4")]


def test_merge_keeps_rows_of_two_series_that_share_a_model_path():
    """Two runs of one chain write their students to the same temporary path and differ only in their ``series``
    label (results/kaizen_table.json's fromsel_1300 and fromsel_2600): merging the table again keeps both series'
    rows, and a repeated row of one series is still dropped (hand-built rows)."""
    from kvlearn.results import make_results, merge_results

    def row(series, acc):
        return {"method": "kaizen+kvpop", "protocol": "bounded", "split": "eval", "budget": 512, "task": "trace",
                "factor": 64.0, "model": "$TMPDIR/retrofit_mlp_512_fromsel/final", "series": series, "accuracy": acc}

    table = make_results("accuracy", [row("fromsel_1300", 0.92), row("fromsel_2600", 0.97)], device="cuda",
                         command="t", commit="c1")
    again = make_results("accuracy", [row("fromsel_2600", 0.97)], device="cuda", command="t2", commit="c2")
    m = merge_results([table, again], "t && t2", across_runs=True)
    assert [(r["series"], r["accuracy"], r["commit"]) for r in m["rows"]] == [
        ("fromsel_1300", 0.92, "c1"), ("fromsel_2600", 0.97, "c1")]


def test_merge_keeps_a_measured_row_over_a_failed_one():
    """A row that failed in one part (``error``) and was measured in another is kept as measured, in the failed
    row's place; a later failure never replaces a measured row."""
    from kvlearn.results import make_results, merge_results

    ok = {"method": "int4", "budget": 131072, "cache_bytes": 1}
    failed = {"method": "int4", "budget": 131072, "error": "OutOfMemoryError"}
    other = {"method": "bf16", "budget": 131072, "cache_bytes": 4}
    a = make_results("kaizen_memory", [failed, other], device="cpu", command="a", commit="c1")
    b = make_results("kaizen_memory", [ok], device="cpu", command="b", commit="c1")
    assert merge_results([a, b], "m")["rows"] == [ok, other]
    assert merge_results([b, a], "m")["rows"] == [ok, other]


def test_merge_across_runs_clears_the_not_run_that_a_later_run_measured():
    """An earlier run's ``not_run`` entry that a later run measured is dropped, and the merged file is complete
    once nothing is left unmeasured; an entry no run measured stays, and the file stays incomplete."""
    from kvlearn.results import make_results, merge_results, row_run_key

    def row(method, budget, task="niah"):
        return {"method": method, "protocol": "bounded", "split": "eval", "budget": budget, "task": task,
                "accuracy": 0.5}

    assert row_run_key(row("random", 512)) == "random/bounded/eval/B=512"
    assert row_run_key(row("dense", 4096)) == "dense/bounded/eval"
    first = make_results("accuracy", [row("dense", 4096), row("streaming", 1024)], device="cuda", command="a",
                         commit="c1", not_run=["random/bounded/eval/B=512", "snapkv/context/eval/B=512"],
                         complete=False)
    second = make_results("accuracy", [row("random", 512), row("random", 512, "vt")], device="cuda", command="b",
                          commit="c2", not_run=[], complete=True)
    m = merge_results([first, second], "a; b", across_runs=True)
    assert m["not_run"] == ["snapkv/context/eval/B=512"] and m["complete"] is False
    third = make_results("accuracy", [{**row("snapkv", 512), "protocol": "context"}], device="cuda", command="c",
                         commit="c3", complete=True)
    m = merge_results([first, second, third], "a; b; c", across_runs=True)
    assert m["not_run"] == [] and m["complete"] is True
    failed = make_results("accuracy", [{**row("snapkv", 512), "protocol": "context", "error": "boom"}],
                          device="cuda", command="c", commit="c3", complete=True)
    m = merge_results([first, second, failed], "a; b; c", across_runs=True)
    assert m["not_run"] == ["snapkv/context/eval/B=512"] and m["complete"] is False


def test_merge_across_runs_clears_the_skipped_that_another_run_measured():
    """A student skipped at a budget its window cannot take in one run, and measured there by another run (trained
    with a smaller window), is not listed as skipped in the merged file; a skip no run measured stays. Within one
    run (``across_runs=False``) the skips are only united."""
    from kvlearn.results import make_results, merge_results

    def row(method, budget):
        return {"method": method, "protocol": "bounded", "split": "eval", "budget": budget, "task": "niah",
                "accuracy": 0.5}

    reason = "budget=256 is invalid: expected an integer >= 261"
    wide = make_results("accuracy", [row("kvpop", 512)], device="cuda", command="a", commit="c1",
                        skipped={"kvpop/bounded/eval/B=256": reason, "dms/bounded/eval/B=256": reason})
    narrow = make_results("accuracy", [row("kvpop", 256)], device="cuda", command="b", commit="c2", skipped={})
    m = merge_results([wide, narrow], "a; b", across_runs=True)
    assert m["skipped"] == {"dms/bounded/eval/B=256": reason}
    assert [r["budget"] for r in m["rows"]] == [512, 256]
    same = make_results("accuracy", [row("kvpop", 256)], device="cuda", command="b", commit="c1", skipped={})
    assert set(merge_results([wide, same], "a; b")["skipped"]) == {"kvpop/bounded/eval/B=256", "dms/bounded/eval/B=256"}


def test_merge_across_runs_replaces_a_family_a_guard_cut_and_keeps_every_run():
    """A row a time guard stopped inside its family (``incomplete``, n=64 of 100) is replaced by a later run's whole
    row, never the reverse; the merged file is complete only with no incomplete row left; merging a merge again
    keeps the runs it already lists."""
    from kvlearn.results import make_results, merge_results

    cut = {"method": "h2o", "protocol": "bounded", "split": "eval", "budget": 1024, "task": "niah", "accuracy": 0.28,
           "n": 64, "incomplete": True}
    whole = {**{k: v for k, v in cut.items() if k != "incomplete"}, "accuracy": 0.3, "n": 100}
    first = make_results("accuracy", [cut], device="cuda", command="a", commit="c1", not_run=[], complete=False)
    second = make_results("accuracy", [whole], device="cuda", command="b", commit="c2", complete=True)
    m = merge_results([first, second], "a; b", across_runs=True)
    assert [(r["n"], r.get("incomplete")) for r in m["rows"]] == [(100, None)] and m["complete"] is True
    m = merge_results([second, first], "b; a", across_runs=True)
    assert [r["n"] for r in m["rows"]] == [100] and m["complete"] is True
    alone = merge_results([first, first], "a; a", across_runs=True)
    assert alone["complete"] is False
    third = make_results("accuracy", [], device="cuda", command="c", commit="c3", complete=True)
    again = merge_results([merge_results([first, second], "a; b", across_runs=True), third], "x", across_runs=True)
    assert [r["command"] for r in again["runs"]] == ["a", "b", "c"]


def test_merge_unites_the_students_of_every_part():
    """The Table 1 chain evaluates each student in its own part: the merged file names every part's students, not
    only the first part's (session 40's reproduce table named one student of four)."""
    from kvlearn.results import make_results, merge_results

    parts = [make_results("accuracy", [], device="cuda", command=c, commit="c1", students=s)
             for c, s in (("a", {"kvpop_mlp": "kvpop:a"}), ("b", {"kvpop": "kvpop:b"}), ("c", {}))]
    assert merge_results(parts, "m")["students"] == {"kvpop_mlp": "kvpop:a", "kvpop": "kvpop:b"}
    assert "students" not in merge_results([make_results("accuracy", [], device="cuda", command="a", commit="c")], "m")


def test_a_run_cut_between_families_stays_until_a_later_run_measures_those_families():
    """``settle_run``: a run whose every family was measured leaves ``not_run``; one cut between families stays as
    ``run:task,task``. Merged across runs, that entry goes only when every family it names is measured whole."""
    from kvlearn.results import make_results, merge_results, settle_run, split_not_run

    plan = ["teacher/bounded/eval", "tova/bounded/heldout/B=512"]
    assert settle_run(plan, "teacher/bounded/eval", []) == ["tova/bounded/heldout/B=512"]
    cut = settle_run(plan, "tova/bounded/heldout/B=512", ["vt", "recall"])
    assert cut == ["teacher/bounded/eval", "tova/bounded/heldout/B=512:vt,recall"]
    assert split_not_run(cut[1]) == ("tova/bounded/heldout/B=512", ("vt", "recall"))
    assert split_not_run("teacher/bounded/eval") == ("teacher/bounded/eval", ())

    def row(task, **extra):
        return {"method": "tova", "protocol": "bounded", "split": "heldout", "budget": 512, "task": task,
                "accuracy": 0.5, "n": 100, **extra}

    first = make_results("accuracy", [row("niah")], device="cuda", command="a", commit="c1",
                         not_run=["tova/bounded/heldout/B=512:vt,recall"], complete=False)
    only_vt = make_results("accuracy", [row("vt"), row("recall", n=40, incomplete=True)], device="cuda",
                           command="b", commit="c2", not_run=[], complete=False)
    merged = merge_results([first, only_vt], "m", across_runs=True)
    assert merged["not_run"] == ["tova/bounded/heldout/B=512:vt,recall"] and merged["complete"] is False
    whole = make_results("accuracy", [row("vt"), row("recall")], device="cuda", command="b", commit="c2",
                         not_run=[], complete=True)
    merged = merge_results([first, whole], "m", across_runs=True)
    assert merged["not_run"] == [] and merged["complete"] is True
    assert [r["task"] for r in merged["rows"]] == ["niah", "vt", "recall"]


def test_replace_lets_a_retrained_students_rows_take_the_old_ones_places(tmp_path):
    """``--replace dms``: an earlier part's dms rows replace a later part's at the same (protocol, split, budget,
    task) though the two name different models; the old rows of a measurement the new parts lack stay, other methods
    still merge by their model, and ``--set`` writes a top-level field. Without ``--replace`` both students' rows
    stay; a bad ``--set`` is a one-line error."""
    from kvlearn.results import main as results_main
    from kvlearn.results import make_results, merge_results, read_results, write_results

    def row(method, model, task, acc, budget=512):
        return {"method": method, "protocol": "bounded", "split": "eval", "budget": budget, "task": task,
                "accuracy": acc, "model": model}

    record = make_results("accuracy", [row("dms", "old", "niah", 0.5), row("dms", "old", "vt", 0.6),
                                       row("dms", "old", "niah", 0.7, budget=256),
                                       row("kvpop", "k", "niah", 0.9)], device="cuda", command="record", commit="c1")
    new = make_results("accuracy", [row("dms", "new", "niah", 0.95), row("kvpop", "k2", "niah", 0.8)],
                       device="cuda", command="new", commit="c2")
    m = merge_results([new, record], "x", across_runs=True, replace=("dms",), settings={"dms_scope": "head"})
    got = {(r["method"], r["model"], r["budget"], r["task"]): r["accuracy"] for r in m["rows"]}
    assert got == {("dms", "new", 512, "niah"): 0.95, ("kvpop", "k2", 512, "niah"): 0.8,  # the new student's
                   ("dms", "old", 512, "vt"): 0.6, ("dms", "old", 256, "niah"): 0.7,  # not measured again: kept
                   ("kvpop", "k", 512, "niah"): 0.9}  # kvpop not replaced: both models' rows stay
    assert m["dms_scope"] == "head"
    # a kvlearn eval part names its student at the top: its replacing rows take that model
    top = make_results("accuracy", [{k: v for k, v in row("dms", None, "vt", 0.99).items() if k != "model"}],
                       device="cuda", command="eval", commit="c3", model="$TMPDIR/student")
    filled = merge_results([top, record], "x", across_runs=True, replace=("dms",))
    assert [(r["model"], r["accuracy"]) for r in filled["rows"] if r["task"] == "vt"] == [("$TMPDIR/student", 0.99)]
    assert "model" not in top["rows"][0]  # the input is not modified
    plain = merge_results([new, record], "x", across_runs=True)
    assert len(plain["rows"]) == 6 and "dms_scope" not in plain
    pn, pr = write_results(tmp_path / "n.json", new), write_results(tmp_path / "r.json", record)
    out = tmp_path / "m.json"
    assert results_main(["merge", "--across-runs", "--replace", "dms", "--set", "dms_scope=head", "--set", "n=3",
                         str(out), str(pn), str(pr)]) == 0
    merged = read_results(out)
    assert len(merged["rows"]) == 5 and merged["dms_scope"] == "head" and merged["n"] == 3
    # across runs the file's command is the merge itself; each part's own command is in runs
    assert merged["command"].startswith("python -m kvlearn.results merge --across-runs --replace dms --set ")
    assert [r["command"] for r in merged["runs"]] == ["new", "record"]


def test_a_bad_set_is_a_one_line_error(tmp_path, capsys):
    from kvlearn.results import main as results_main
    from kvlearn.results import make_results, write_results

    p = write_results(tmp_path / "a.json", make_results("accuracy", [], device="cuda", command="a", commit="c"))
    assert results_main(["merge", "--set", "dms_scope", str(tmp_path / "m.json"), str(p)]) == 2
    err = capsys.readouterr().err
    assert "--set 'dms_scope' is invalid: expected KEY=VALUE" in err and "Traceback" not in err
    assert not (tmp_path / "m.json").exists()
    assert results_main(["merge", "--set", "device=cpu", str(tmp_path / "m.json"), str(p)]) == 2
    assert "'device' is the merge's own (reserved: schema, kind, device, commit, runs, rows)" in capsys.readouterr().err


def test_device_per_row_joins_a_run_on_another_device_and_each_of_its_rows_names_it(tmp_path, capsys):
    """A table of record measured on one device and a run on another: refused without ``--device-per-row`` (a one-line
    error that names the option), joined with it; the joining part's rows name its device, the first part's rows
    and the file's device are left as they were, and a row that already names a device keeps it."""
    from kvlearn.results import main as results_main
    from kvlearn.results import make_results, merge_results, read_results, write_results

    def row(selector, acc, **extra):
        return {"method": "kaizen", "protocol": "bounded", "split": "eval", "budget": 4096, "task": "niah",
                "accuracy": acc, "selector": selector, "factor": 8.0, **extra}

    record = {**make_results("accuracy", [row("a", 0.9), row("b", 0.8, device="H100 (earlier)")], command="record",
                             commit="c1"), "device": "H200"}  # as the GPU names itself
    run = {**make_results("accuracy", [row("c", 0.95)], command="run", commit="c2"), "device": "H100"}
    with pytest.raises(KVLearnError, match="differ in device.*pass device_per_row"):
        merge_results([record, run], "x", across_runs=True)
    with pytest.raises(KVLearnError, match=r"pass across_runs \(--across-runs\) too"):
        merge_results([record, run], "x", device_per_row=True)
    m = merge_results([record, run], "x", across_runs=True, device_per_row=True)
    assert m["device"] == "H200"
    assert [(r["selector"], r.get("device")) for r in m["rows"]] == [("a", None), ("b", "H100 (earlier)"),
                                                                     ("c", "H100")]
    assert "device" not in run["rows"][0]  # the input is not modified
    pr, pn = write_results(tmp_path / "r.json", record), write_results(tmp_path / "n.json", run)
    out = tmp_path / "m.json"
    assert results_main(["merge", "--across-runs", str(out), str(pr), str(pn)]) == 2
    err = capsys.readouterr().err
    assert "differ in device" in err and "--device-per-row" in err and "Traceback" not in err
    assert results_main(["merge", "--across-runs", "--device-per-row", str(out), str(pr), str(pn)]) == 0
    assert [r.get("device") for r in read_results(out)["rows"]] == [None, "H100 (earlier)", "H100"]



def test_relabel_renames_a_device_runs_selector_and_output_folder(tmp_path, capsys):
    """``relabel``: the selector label in every row, the ``selectors`` keys and the command's ``--selector OLD=``
    become NEW (a label that merely starts with OLD is left alone), a path prefix is rewritten in every string, and
    the file records the renames; the input object is not modified. Unknown labels or paths, a taken or malformed
    new label and a malformed option are one-line errors that leave the file as it was."""
    from kvlearn.results import main as results_main
    from kvlearn.results import make_results, read_results, relabel_results, write_results

    def row(selector, acc):
        return {"method": "kaizen", "protocol": "bounded", "split": "eval", "budget": 4096, "task": "niah",
                "accuracy": acc, "selector": selector, "model": f"/root/out/kz/{selector}/final"}

    run = make_results("accuracy", [row("k8_s2", 0.9), row("k8_s22", 0.8)], device="cuda", commit="c1",
                       command="python benchmarks/kaizen_table.py --selector k8_s2=/root/out/kz/k8_s2/final "
                               "--selector k8_s22=/root/out/kz/k8_s22/final --out /root/out/kz/t.json",
                       selectors={"k8_s2": {"path": "/root/out/kz/k8_s2/final"}, "k8_s22": {"path": "x"}})
    out = relabel_results(run, {"k8_s2": "alone_s2"}, {"/root/out/kz": "$OUT"})
    assert [r["selector"] for r in out["rows"]] == ["alone_s2", "k8_s22"]
    assert [r["model"] for r in out["rows"]] == ["$OUT/k8_s2/final", "$OUT/k8_s22/final"]
    assert out["selectors"] == {"alone_s2": {"path": "$OUT/k8_s2/final"}, "k8_s22": {"path": "x"}}
    assert out["command"] == ("python benchmarks/kaizen_table.py --selector alone_s2=$OUT/k8_s2/final "
                              "--selector k8_s22=$OUT/k8_s22/final --out $OUT/t.json")
    assert out["relabelled"] == {"selectors": {"k8_s2": "alone_s2"}, "paths": {"/root/out/kz": "$OUT"}}
    assert run["rows"][0]["selector"] == "k8_s2" and "relabelled" not in run  # the input is not modified
    again = relabel_results(out, {"k8_s22": "alone_s2_refined"})  # a second relabelling adds to the record
    assert again["relabelled"]["selectors"] == {"k8_s2": "alone_s2", "k8_s22": "alone_s2_refined"}
    for selectors, paths, needle in (({"k8_s3": "x"}, {}, "selector 'k8_s3' is not in the file (its selectors: "
                                      "k8_s2, k8_s22)"),
                                     ({"k8_s2": "k8_s22"}, {}, "'k8_s22' is already in the file"),
                                     ({"k8_s2": "a b"}, {}, "new selector label 'a b' is invalid"),
                                     ({}, {"/tmp/elsewhere": "$OUT"}, "path '/tmp/elsewhere' occurs nowhere"),
                                     ({}, {}, "nothing to rename")):
        with pytest.raises(KVLearnError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            relabel_results(run, selectors, paths)
    path = write_results(tmp_path / "run.json", run)
    assert results_main(["relabel", str(path), "--selector", "k8_s2=alone_s2", "--path", "/root/out/kz=$OUT"]) == 0
    assert read_results(path)["rows"][0]["selector"] == "alone_s2"  # in place without --out
    before = path.read_text()
    for args, needle in ((["--selector", "k8_s2"], "--selector 'k8_s2' is invalid: expected OLD=NEW"),
                         (["--selector", "nope=x"], "selector 'nope' is not in the file")):
        assert results_main(["relabel", str(path), *args]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert path.read_text() == before


def test_merging_a_table_in_place_keeps_its_command_history_and_records_origin_and_note(tmp_path, capsys):
    """``merge --across-runs OUT OUT NEW``: the table read before it is written, so the update is in place; the file's
    command is the table's previous command, `` && ``, then this merge with ``--origin``'s text in parentheses after
    it and the long texts elided from the typed options; ``--add-note`` ends the note. Merged into another file the
    command is this merge alone (as before). Empty texts and ``--origin`` without ``--across-runs`` are one-line
    errors."""
    from kvlearn.results import main as results_main
    from kvlearn.results import make_results, read_results, write_results

    def row(selector, acc):
        return {"method": "kaizen", "protocol": "bounded", "split": "eval", "budget": 4096, "task": "niah",
                "accuracy": acc, "selector": selector}

    table = write_results(tmp_path / "table.json", make_results(
        "accuracy", [row("a", 0.9)], device="cuda", commit="c1", command="python -m kvlearn.results merge A B",
        note="Session 1: a."))
    new = write_results(tmp_path / "new.json", make_results("accuracy", [row("b", 0.8)], device="cuda", commit="c2",
                                                            command="python benchmarks/kaizen_table.py"))
    elsewhere = tmp_path / "other.json"
    assert results_main(["merge", "--across-runs", str(elsewhere), str(table), str(new)]) == 0
    assert read_results(elsewhere)["command"].startswith("python -m kvlearn.results merge --across-runs ")
    assert results_main(["merge", "--across-runs", "--origin", "session 2, one H100: bash run.sh",
                         "--add-note=Session 2: b.", str(table), str(table), str(new)]) == 0
    merged = read_results(table)
    assert [r["selector"] for r in merged["rows"]] == ["a", "b"] and merged["commit"] == "c1,c2"
    head, sep, this = merged["command"].partition(" && ")
    assert head == "python -m kvlearn.results merge A B" and sep
    assert this.startswith("python -m kvlearn.results merge --across-runs --origin '<in parentheses after this "
                           "merge>' '--add-note=<the end of the note>' ")
    assert this.endswith(" (session 2, one H100: bash run.sh)") and "Session 2: b." not in this
    assert merged["note"] == "Session 1: a. Session 2: b."
    assert [r["command"] for r in merged["runs"]] == ["python -m kvlearn.results merge A B",
                                                      "python benchmarks/kaizen_table.py"]
    before = table.read_text()
    for args, needle in ((["--across-runs", "--origin", " "], "--origin is empty"),
                         (["--across-runs", "--add-note", ""], "--add-note is empty"),
                         (["--origin", "x"], "--origin records where the inputs of a merge across runs came from: "
                                             "pass --across-runs too")):
        assert results_main(["merge", *args, str(table), str(table), str(new)]) == 2
        err = capsys.readouterr().err
        assert needle in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert table.read_text() == before
