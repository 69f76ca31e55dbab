"""``kvlearn reproduce kvpop``: the per-budget chain environments (hand-written expectations), the merge of the
tables the chains wrote (a fake runner), a failed budget named in ``not_run``, bad input as one line, and one real
tiny run of the chain on the CPU, through the device script."""

import io
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from kvlearn import KVLearnError
from kvlearn.eval import reproduce as reproduce_module
from kvlearn.eval.reproduce import (CHAIN_PARTS, CONTEXT_PART, STEPS_OF_RECORD, ReproduceConfig, RetrofitProgress,
                                    budget_env, command_of, context_runs_missing, dms_scope_note, finish_parts,
                                    finished, last_step,
                                    missing_runs, reproduce_kvpop, salvage_parts, short_students, student_steps)
from kvlearn.results import make_results, write_results


def test_budget_env_follows_the_measured_recipes(tmp_path):
    config = ReproduceConfig(out=str(tmp_path / "r"), minutes=5.0, n_per_task=100)
    env = budget_env(config, 512)
    assert env["BUDGET"] == "512" and env["RETROFIT_MINUTES"] == "5.0" and env["TOTAL_MINUTES"] == "9.0"
    assert env["STUDENTS"] == "kvpop_mlp=kvpop kvpop=kvpop streaming_plus=streaming_plus dms=dms"
    assert env["RETROFIT_ARGS"] == "--window 256" and env["TABLE_ARGS"] == "--budgets 512"
    assert env["OUT"].endswith("r/budget512") and env["MODEL"].endswith("checkpoints/testbed-teacher")
    assert env["WORK_DIR"].endswith("r/students") and env["TAG"] == "_reproduce512"
    assert budget_env(config, 256)["RETROFIT_ARGS"] == "--window 128"  # Table 1's CR 94% students: half the budget
    assert budget_env(config, 1024)["RETROFIT_ARGS"] == "--window 256"
    assert command_of(config).startswith("kvlearn reproduce kvpop --out ")
    assert "RETROFIT_STEPS" not in env and "--minutes 5.0" in command_of(config)
    assert env["DMS_SCOPE"] == "head" and "--dms-scope" not in command_of(config)  # the default is not spelled out
    model = ReproduceConfig(out=str(tmp_path / "m"), dms_scope="model")
    assert budget_env(model, 512)["DMS_SCOPE"] == "model" and "--dms-scope model" in command_of(model)
    with pytest.raises(KVLearnError, match="dms_scope='layer' is invalid: expected head"):
        ReproduceConfig(out=str(tmp_path / "x"), dms_scope="layer")


def test_the_windows_it_trains_with_are_the_committed_tables():
    """Every windowed student row of the committed Table 1 (KVpop and DMS, any budget) was trained with the window
    ``reproduce`` passes at that budget, so rebuilding the table trains the students it reports (at 1024 the rows
    are the 512 students', whose window 256 is also the one ``reproduce`` gives a 1024 student)."""
    table = json.loads((Path(__file__).resolve().parents[2] / "results" / "kvpop_table.json").read_text())
    config = ReproduceConfig(out="unused")
    windowed = [r for r in table["rows"] if r["method"] in ("kvpop", "kvpop_mlp", "dms")]
    assert {r["budget"] for r in windowed} == {1024, 512, 256}
    for row in windowed:
        passed = budget_env(config, row["budget"])["RETROFIT_ARGS"]
        assert passed == f"--window {row['options']['window']}", (row["method"], row["budget"], passed)


def test_steps_give_every_method_the_same_steps_and_the_table_its_minutes(tmp_path):
    config = ReproduceConfig(out=str(tmp_path / "r"), steps=800)
    env = budget_env(config, 1024)
    assert env["RETROFIT_STEPS"] == "800" and env["TABLE_MINUTES"] == "4.0"
    assert "--steps 800" in command_of(config) and "--minutes" not in command_of(config)


def test_the_default_is_the_table_of_records_steps(tmp_path):
    """Without --steps or --minutes every student trains the steps the committed Table 1's students trained (1,300,
    read off its recipe in ``benchmarks/device/kvpop_table.sh``), not a wall clock that the slower methods' steps
    would lose to (DMS: 481-488 steps in 5 minutes on one H100)."""
    recipe = (Path(__file__).resolve().parents[2] / "benchmarks" / "device" / "kvpop_table.sh").read_text()
    assert f"Table 1 of record (results/kvpop_table.json, CR 75% / 88%, session 22): RETROFIT_STEPS={STEPS_OF_RECORD} " in recipe
    config = ReproduceConfig(out=str(tmp_path / "r"))
    assert config.steps == 1300 and config.minutes is None
    env = budget_env(config, 512)
    assert env["RETROFIT_STEPS"] == "1300" and "RETROFIT_MINUTES" not in env and "TOTAL_MINUTES" not in env
    assert "--steps 1300" in command_of(config)
    with pytest.raises(KVLearnError, match="minutes=5.0 and steps=1300: give one of them"):
        ReproduceConfig(out=str(tmp_path / "r"), minutes=5.0, steps=1300)


def test_short_students_are_those_under_the_steps_of_record():
    steps = {"1024": {"kvpop_mlp": 1164, "dms": 481}, "512": {"streaming_plus": 1376, "dms": 1300, "kvpop": 1299}}
    assert short_students(steps) == [("1024", "kvpop_mlp", 1164), ("1024", "dms", 481), ("512", "kvpop", 1299)]
    assert short_students({}) == []


def fake_chain(tmp_path, fail_budgets=()):
    """A runner that writes what kvpop_table.sh writes (one row per budget) unless the budget is to fail."""
    def run(cmd, cwd, env, stdout, stderr, check):
        budget = int(env["BUDGET"])
        if budget not in fail_budgets:
            rows = [{"method": s.split("=")[0], "protocol": "bounded", "split": "eval", "budget": budget,
                     "task": "niah", "context": 4096, "compression": 1 - budget / 4096, "accuracy": budget / 1024,
                     "n": 1} for s in env["STUDENTS"].split()]
            write_results(Path(env["OUT"]) / "kvpop_table.json",
                          make_results("accuracy", rows, device="cuda", command="x", commit="c", complete=True,
                                       students={"kvpop_mlp": f"kvpop:{env['WORK_DIR']}/table_reproduce{budget}"}))
        return subprocess.CompletedProcess(cmd, 0)
    return run


def test_the_tables_of_every_budget_are_merged_and_a_failed_budget_is_named(tmp_path):
    config = ReproduceConfig(out=str(tmp_path / "r"), budgets=(1024, 512, 256))
    path = reproduce_kvpop(config, run=fake_chain(tmp_path, fail_budgets=(512,)))
    merged = json.loads(Path(path).read_text())
    assert [r["budget"] for r in merged["rows"]] == [1024] * 4 + [256] * 4  # the four students of each budget
    assert merged["complete"] is False and any("B=512" in x for x in merged["not_run"])
    work = tmp_path.resolve() / "r" / "students"  # each budget's students by budget, not one label's last path
    assert merged["students"] == {"1024": {"kvpop_mlp": f"kvpop:{work}/table_reproduce1024"},
                                  "256": {"kvpop_mlp": f"kvpop:{work}/table_reproduce256"}}
    assert (tmp_path / "r" / "kvpop_table.png").is_file() and (tmp_path / "r" / "budget512.log").is_file()
    with pytest.raises(KVLearnError, match="already holds files"):
        ReproduceConfig(out=str(tmp_path / "r"))
    with pytest.raises(KVLearnError, match="no budget's chain wrote a table"):
        reproduce_kvpop(ReproduceConfig(out=str(tmp_path / "s"), budgets=(512,)), run=fake_chain(tmp_path, (512,)))


def test_resume_keeps_the_finished_budgets_and_merges_them_all(tmp_path):
    """A run cut after one budget (here: the next budget's chain failed) is resumed in a later session: the finished
    budget is not run again, the failed one is, and the merged table holds both. Changed settings, or --resume with
    --overwrite, are one line."""
    calls = []

    def counting(fail_budgets):
        chain = fake_chain(tmp_path, fail_budgets)

        def run(cmd, cwd, env, stdout, stderr, check):
            calls.append(int(env["BUDGET"]))
            return chain(cmd, cwd, env, stdout, stderr, check)
        return run

    out = str(tmp_path / "r")
    reproduce_kvpop(ReproduceConfig(out=out, budgets=(1024, 512)), run=counting(fail_budgets=(512,)))
    assert calls == [1024, 512]
    # an incomplete table of 512 (a guard cut it) is run again, and when that chain fails its stale rows do not count
    stale = [{"method": "stale", "protocol": "bounded", "split": "eval", "budget": 512, "task": "niah", "accuracy": 0.0,
              "n": 1}]
    write_results(tmp_path / "r" / "budget512" / "kvpop_table.json",
                  make_results("accuracy", stale, device="cuda", command="x", commit="c", complete=False))
    path = reproduce_kvpop(ReproduceConfig(out=out, budgets=(1024, 512), resume=True), run=counting((512,)))
    assert calls == [1024, 512, 512]
    merged = json.loads(Path(path).read_text())
    assert [r["method"] for r in merged["rows"]] == ["kvpop_mlp", "kvpop", "streaming_plus", "dms"]
    assert any("B=512" in x for x in merged["not_run"])
    path = reproduce_kvpop(ReproduceConfig(out=out, budgets=(1024, 512), resume=True), run=counting(()))
    assert calls == [1024, 512, 512, 512]
    merged = json.loads(Path(path).read_text())
    assert [r["budget"] for r in merged["rows"]] == [1024] * 4 + [512] * 4 and merged["complete"] is True
    assert merged["command"].endswith("--resume")
    # a later run of one more budget keeps the folder's others in its table (they are not run again); without
    # --resume a new folder is needed, so nothing else is ever merged
    path = reproduce_kvpop(ReproduceConfig(out=out, budgets=(256,), resume=True), run=counting(()))
    assert calls == [1024, 512, 512, 512, 256]
    merged = json.loads(Path(path).read_text())
    assert [r["budget"] for r in merged["rows"]] == [256] * 4 + [1024] * 4 + [512] * 4
    assert sorted(merged["students"]) == ["1024", "256", "512"] and merged["complete"] is True
    with pytest.raises(KVLearnError, match=r"--resume: n_per_task=50 differ from the earlier run's n_per_task=100"):
        reproduce_kvpop(ReproduceConfig(out=out, budgets=(128,), n_per_task=50, resume=True), run=counting(()))
    assert calls == [1024, 512, 512, 512, 256]
    # a folder begun before the DMS scope was a setting trained its DMS students in the model scope: a resume must
    # say so (the head scope, the default, would mix two DMS recipes in one table)
    settings_file = Path(out) / "reproduce_settings.json"
    old = json.loads(settings_file.read_text())
    assert old.pop("dms_scope") == "head"
    settings_file.write_text(json.dumps(old))
    with pytest.raises(KVLearnError, match=r"--resume: dms_scope='head' differ from the earlier run's "
                                           r"dms_scope='model'"):
        reproduce_kvpop(ReproduceConfig(out=out, budgets=(256,), resume=True), run=counting(()))
    reproduce_kvpop(ReproduceConfig(out=out, budgets=(256,), resume=True, dms_scope="model"), run=counting(()))
    assert calls == [1024, 512, 512, 512, 256]  # budget 256 is finished: nothing runs
    with pytest.raises(KVLearnError, match="--overwrite and --resume exclude each other"):
        ReproduceConfig(out=out, overwrite=True, resume=True)
    # a table a time guard cut is run again: finished only when complete and nothing is listed as not run
    assert finished({"complete": True}) and finished({}) and not finished({"complete": False})
    assert not finished({"complete": True, "not_run": ["kvpop/bounded/eval"]})


def row(method, split, task, budget=1024, n=100, **extra):
    return {"method": method, "protocol": "bounded", "split": split, "budget": budget, "task": task,
            "context": 4096, "compression": 0.75, "accuracy": 0.5, "n": n, "model": "teacher", **extra}


def test_resume_measures_only_the_runs_a_guard_cut_and_needs_the_chain_only_without_the_student(tmp_path):
    """Session 40's first device run of budget 1024: the chain's table stage stopped at its time guard with three
    baselines' held-out runs not started and h2o's eval run stopped inside niah (64 of 100). The resume runs
    ``kvpop_table.py`` for exactly those runs (grouped per split, never the chain), each part merged as it is
    written: the whole niah row replaces the cut one, the table is complete, and the earlier runs stay listed. A
    missing student run is measured from the student's checkpoint when it is there, else the whole chain reruns."""
    out = tmp_path / "r"
    config = ReproduceConfig(out=str(out), budgets=(1024,), resume=True)
    (out / "budget1024").mkdir(parents=True)
    rows = [row("teacher", s, t, budget=None) for s in ("eval", "heldout") for t in ("trace", "niah")]
    rows += [row(student, s, t) for student in ("kvpop_mlp", "kvpop", "streaming_plus", "dms")
             for s in ("eval", "heldout") for t in ("trace", "niah")]  # the chain measured every student
    rows += [row("h2o", "eval", "trace"), row("h2o", "eval", "niah", n=64, incomplete=True)]
    not_run = ["streaming/bounded/heldout/B=1024", "h2o/bounded/heldout/B=1024"]
    write_results(out / "budget1024" / "kvpop_table.json",
                  make_results("accuracy", rows, device="cuda", command="chain", commit="c1", not_run=not_run,
                               complete=False))
    table = json.loads((out / "budget1024" / "kvpop_table.json").read_text())
    assert missing_runs(table) == [("streaming", "bounded", "heldout"), ("h2o", "bounded", "heldout"),
                                   ("h2o", "bounded", "eval")]
    calls = []

    def table_script(cmd, cwd, env, stdout, stderr, check):
        assert cmd[0] != "bash", "the chain ran although only baseline runs were missing"
        opts = {a: b for a, b in zip(cmd[2:], cmd[3:]) if a.startswith("--") and not b.startswith("--")}
        calls.append((opts["--baselines"], opts["--splits"], "--no-teacher" in cmd))
        new = [row(m, opts["--splits"], t, commit=None) for m in opts["--baselines"].split(",")
               for t in ("trace", "niah")]
        write_results(opts["--out"], make_results("accuracy", [{k: v for k, v in r.items() if k != "commit"}
                                                               for r in new], device="cuda", command="part",
                                                  commit="c2", complete=True))
        return subprocess.CompletedProcess(cmd, 0)

    path = reproduce_kvpop(config, run=table_script)
    assert calls == [("streaming,h2o", "heldout", True), ("h2o", "eval", True)]
    budget = json.loads((out / "budget1024" / "kvpop_table.json").read_text())
    assert budget["complete"] is True and budget["not_run"] == []
    niah = [r for r in budget["rows"] if (r["method"], r["split"], r["task"]) == ("h2o", "eval", "niah")]
    assert len(niah) == 1 and niah[0]["n"] == 100 and not niah[0].get("incomplete")
    assert len(budget["rows"]) == len(rows) + 4 and [r["command"] for r in budget["runs"]] == [
        "chain", "part", "part"]
    assert not list((out / "budget1024").glob("finish_*.json"))  # each part is merged, then removed
    assert json.loads(Path(path).read_text())["complete"] is True
    # a missing student run: from its checkpoint when it is there (the chain's WORK_DIR), else only the chain helps
    runs = [("kvpop", "bounded", "heldout"), ("teacher", "bounded", "eval")]
    assert finish_parts(config, 1024, runs) is None
    final = out / "students" / "table_reproduce1024_kvpop" / "final"
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")
    assert finish_parts(config, 1024, runs) == [
        ["--student", f"kvpop=kvpop:{final}", "--baselines", "none", "--no-teacher", "--protocols", "bounded",
         "--splits", "heldout"],
        ["--baselines", "none", "--protocols", "bounded", "--splits", "eval"]]
    assert missing_runs({"rows": [], "not_run": ["every run at B=512 (its chain failed: see its log)"]}) is None
    # a run its deadline cut between families (results.settle_run) is measured again whole
    assert missing_runs({"rows": [], "not_run": ["teacher/bounded/eval:vt,recall", "tova/bounded/heldout/B=512:vt"]}) \
        == [("teacher", "bounded", "eval"), ("tova", "bounded", "heldout")]


@pytest.mark.parametrize("bad, message", [
    (dict(budgets=()), "budgets is empty"), (dict(budgets=(3,)), "budget=3 is invalid"),
    (dict(minutes=-1), "minutes=-1 is invalid"), (dict(n_per_task=0), "n_per_task=0 is invalid"),
    (dict(steps=0), "steps=0 is invalid"),
    (dict(device="tpu"), "device='tpu' is invalid: expected cuda or cpu"),
    (dict(model="/nonexistent/teacher"), "model path '/nonexistent/teacher' does not exist or is not a directory"),
    (dict(model=__file__), "does not exist or is not a directory: expected a checkpoint folder")])
def test_bad_input_is_one_line(bad, message, tmp_path):
    with pytest.raises(KVLearnError, match=message):
        ReproduceConfig(out=str(tmp_path / "x"), **bad)


def test_cli_bad_input_is_one_line_before_any_chain_runs(tmp_path, capsys, monkeypatch):
    """``kvlearn reproduce``: a budget out of range names its range, and ``--device cuda`` on a machine without CUDA
    is refused before the first retrofit starts (nothing is written to ``--out``)."""
    import torch

    from kvlearn.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "r"
    for argv, needle in ((["--budgets", "512,-1", "--device", "cpu"], "budget=-1 is invalid: expected an integer in [9, 4095]"),
                         (["--budgets", "512,8", "--device", "cpu"], "budget=8 is invalid: expected an integer in [9, 4095]"),
                         (["--budgets", "512,x", "--device", "cpu"], "--budgets '512,x' is invalid: expected a comma list of integers"),
                         (["--students", "dms,h2o", "--device", "cpu"], "students='dms,h2o' is invalid: expected one or more of"),
                         (["--minutes", "5", "--device", "cpu"], "minutes=5.0 and steps=1: give one of them"),
                         (["--device", "cuda"], "device='cuda' requested but CUDA is not available: use --device cpu"),
                         ([], "device='cuda' requested but CUDA is not available")):  # cuda is the default
        assert main(["reproduce", "kvpop", "--out", str(out), "--steps", "1", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err
    assert not out.exists()


def test_a_budget_every_student_can_train_at_is_checked_before_any_chain_runs(tmp_path):
    """The bound is the retrofit's own (``kvlearn retrofit``: sinks + window + 1 <= budget < seq_len), found by brute
    force over every budget with the window the chain passes (and with ``--window`` / ``--sinks`` / ``--seq-len`` in
    ``retrofit_args``, which the chain passes after its own ``--window``, so theirs win). Before, budgets 6-8 passed
    and started four retrofits, three of which failed at once while StreamingLLM+ trained on."""
    from kvlearn.cli import build_parser
    from kvlearn.config import retrofit_window
    from kvlearn.eval.reproduce import RETROFIT_SEQ_LEN, RETROFIT_SINKS

    defaults = build_parser().parse_args(["retrofit", "--model", "m", "--out", "o", "--method", "kvpop"])
    assert (defaults.sinks, defaults.seq_len) == (RETROFIT_SINKS, RETROFIT_SEQ_LEN)  # what the students get

    def trainable(budget, sinks=4, window=None, seq_len=4096):
        window = retrofit_window(budget) if window is None else window
        return sinks + window + 1 <= budget < seq_len

    for args, kw in (("", {}), ("--window 16", dict(window=16)), ("--sinks 6 --window=40", dict(sinks=6, window=40)),
                     ("--seq-len 256 --batch-size 2", dict(seq_len=256)), ("--window 16 --window 8", dict(window=8))):
        accepted = []
        for budget in range(1, 4200):
            try:
                ReproduceConfig(out=str(tmp_path / "x"), budgets=(budget,), retrofit_args=args)
                accepted.append(budget)
            except KVLearnError as error:
                assert str(error).startswith(f"budget={budget} is invalid: expected an integer in [") \
                    and "\n" not in str(error), (args, str(error))
        assert accepted == [b for b in range(1, 4200) if trainable(b, **kw)], args
    calls = []
    with pytest.raises(KVLearnError, match="budget=7 is invalid"):
        reproduce_kvpop(ReproduceConfig(out=str(tmp_path / "r"), budgets=(512, 7)), run=lambda *a, **k: calls.append(a))
    assert calls == [] and not (tmp_path / "r").exists()


@pytest.mark.slow
def test_a_tiny_real_run_through_the_device_script_on_the_cpu(tmp_path):
    """The real chain, tiny, through ``benchmarks/device/reproduce_kvpop.sh`` (how the device runs it, a budget or
    more per call): the shipped teacher, budget 64 (window 16), retrofits of 2 steps, context 256, one niah example on
    the eval split, no bf16 export of the students. Every student and the teacher have rows in the merged table;
    the packed folder keeps each student's training log (every student trained exactly the 2 steps asked for) and no
    checkpoint; unpacked into a new folder, as the next call gets it, a resume keeps the budget without running its
    chain again."""
    import os
    import tarfile

    rep, out = tmp_path / "rep", tmp_path / "out"
    settings = dict(steps=2, n_per_task=1, device="cpu", retrofit_args="--seq-len 256 --batch-size 2 --window 16 "
                    "--num-workers 0", table_args="--context 256 --tasks niah --baselines streaming --splits eval")
    env = {**os.environ, "OUT": str(out), "REP": str(rep), "BUDGETS": "64", "STEPS": "2", "N_PER_TASK": "1",
           "DEVICE": "cpu", "RETROFIT_ARGS": settings["retrofit_args"], "TABLE_ARGS": settings["table_args"],
           "EXPORT_STUDENTS": "0", "CONTEXT_ROWS": "1"}
    root = Path(__file__).resolve().parents[2]
    done = subprocess.run(["bash", "benchmarks/device/reproduce_kvpop.sh"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0 and "reproduce rc=0" in done.stdout, done.stdout + done.stderr
    with tarfile.open(out / "reproduce-kvpop.tar") as tar:
        names = sorted(n.removeprefix("./") for n in tar.getnames())
        unpacked = tmp_path / "unpacked"
        tar.extractall(unpacked)
    assert "kvpop_table.json" in names and "budget64/kvpop_table.json" in names, names
    assert not [n for n in names if n.endswith((".safetensors", ".pt", ".bin"))], names
    merged = json.loads((unpacked / "kvpop_table.json").read_text())
    methods = {r["method"] for r in merged["rows"]}
    assert {"teacher", "kvpop_mlp", "kvpop", "streaming_plus", "dms", "streaming"} <= methods, methods
    assert all(r["budget"] == 64 for r in merged["rows"] if r["method"] != "teacher")
    # CONTEXT_ROWS=1: the context part too (TABLE_ARGS' --baselines streaming narrows it to that baseline here)
    assert {(r["method"], r["split"]) for r in merged["rows"] if r["protocol"] == "context"} == {("streaming", "eval")}
    assert "--context-rows" in merged["command"]
    logs = sorted(n for n in names if n.endswith("train_log.jsonl"))
    assert [n.split("/")[1] for n in logs] == ["table_reproduce64_dms", "table_reproduce64_kvpop",
                                                "table_reproduce64_kvpop_mlp", "table_reproduce64_streaming_plus"], logs
    for name in logs:  # the same steps for every method
        steps = [json.loads(line)["step"] for line in (unpacked / name).read_text().splitlines()]
        assert steps == [1, 2], name
    assert merged["student_steps"] == {"64": {"kvpop_mlp": 2, "kvpop": 2, "streaming_plus": 2, "dms": 2}}

    def no_chain(*args, **kwargs):
        raise AssertionError("the finished budget's chain ran again")

    path = reproduce_kvpop(ReproduceConfig(out=str(unpacked), budgets=(64,), resume=True, **settings), run=no_chain)
    assert json.loads(Path(path).read_text())["rows"] == merged["rows"]


def test_resume_merges_the_parts_of_a_chain_killed_in_its_table_stage_only_when_every_part_is_there(tmp_path):
    """A device call's timeout killed the chain inside its table stage: every part had written its file (rows so
    far, the rest under ``not_run``) but nothing merged them. The resume merges them as the chain would and measures
    only what the parts list as not run. With one part's file missing (it never started, so its runs are listed
    nowhere) nothing is merged and the chain runs again."""
    out = tmp_path / "r"
    folder = out / "budget1024"
    folder.mkdir(parents=True)

    def write_parts(names):
        for name in names:
            label = name if name in ("kvpop_mlp", "kvpop", "streaming_plus", "dms") else "streaming"
            not_run = ["streaming/bounded/heldout/B=1024"] if name == "baselines_a" else []
            write_results(folder / f"part_{name}.json",
                          make_results("accuracy", [row(label, "eval", "niah")], device="cuda", command=name,
                                       commit="c1", not_run=not_run, complete=not not_run))
            (folder / f"part_{name}.png").write_text("png")

    write_parts(CHAIN_PARTS)
    assert CHAIN_PARTS == ("kvpop_mlp", "kvpop", "streaming_plus", "dms", "baselines_a", "baselines_b")
    calls = []

    def runner(cmd, cwd, env, stdout, stderr, check):
        calls.append("chain" if cmd[0] == "bash" else "table")
        if cmd[0] == "bash":
            write_results(Path(env["OUT"]) / "kvpop_table.json",
                          make_results("accuracy", [row("kvpop", "eval", "vt")], device="cuda", command="chain",
                                       commit="c3", complete=True))
            return subprocess.CompletedProcess(cmd, 0)
        opts = {a: b for a, b in zip(cmd[2:], cmd[3:]) if a.startswith("--") and not b.startswith("--")}
        write_results(opts["--out"], make_results("accuracy", [row("streaming", "heldout", "niah")], device="cuda",
                                                  command="finish", commit="c2", complete=True))
        return subprocess.CompletedProcess(cmd, 0)

    config = ReproduceConfig(out=str(out), budgets=(1024,), resume=True)
    reproduce_kvpop(config, run=runner)
    assert calls == ["table"]
    table = json.loads((folder / "kvpop_table.json").read_text())
    assert table["complete"] is True and table["not_run"] == []
    assert sorted((r["method"], r["split"]) for r in table["rows"]) == [
        ("dms", "eval"), ("kvpop", "eval"), ("kvpop_mlp", "eval"), ("streaming", "eval"), ("streaming", "heldout"),
        ("streaming_plus", "eval")]
    assert not list(folder.glob("part_*"))
    # one part never started: no merge, the whole chain runs again
    (folder / "kvpop_table.json").unlink()
    write_parts(CHAIN_PARTS[:-1])
    reproduce_kvpop(config, run=runner)
    assert calls == ["table", "chain"]
    assert [r["task"] for r in json.loads((folder / "kvpop_table.json").read_text())["rows"]] == ["vt"]
    assert not list(folder.glob("part_*"))  # the earlier chain's parts went before the chain ran again
    # with --context-rows the chain has one more part: the six without it are not enough to merge
    assert salvage_parts(folder, CHAIN_PARTS) is False  # (no parts now)
    write_parts(CHAIN_PARTS)
    assert salvage_parts(folder, (*CHAIN_PARTS, CONTEXT_PART)) is False and len(list(folder.glob("part_*.json"))) == 6
    write_parts((CONTEXT_PART,))
    assert salvage_parts(folder, (*CHAIN_PARTS, CONTEXT_PART)) is True and not list(folder.glob("part_*"))


def test_a_reproduction_is_compared_with_the_table_of_record_over_the_families_both_measured():
    """Hand-computed: the teacher labelled ``teacher`` here and ``dense`` there (budget 4096 there) is one method;
    the means cover only the families both have; a run only one side has, and an incomplete row, are left out; a
    student row names each side's checkpoint, a baseline row none. RESULTS.md renders the comparison under the
    reproduction's table."""
    from kvlearn.eval.report import reproduction_section
    from kvlearn.eval.reproduce import compare_tables, comparison_text

    mine = [row("teacher", "eval", "niah", budget=None), row("teacher", "eval", "vt", budget=None),
            {**row("kvpop", "eval", "niah"), "accuracy": 0.9, "model": "runs/a"},
            {**row("kvpop", "eval", "vt"), "accuracy": 0.7, "model": "runs/a"},
            {**row("kvpop", "eval", "trace"), "accuracy": 0.1, "model": "runs/a"},
            row("tova", "eval", "niah"), {**row("h2o", "eval", "niah"), "incomplete": True}]
    theirs = [{**row("dense", "eval", "niah", budget=4096), "model": None, "accuracy": 0.5},
              {**row("dense", "eval", "vt", budget=4096), "model": None, "accuracy": 0.5},
              {**row("kvpop", "eval", "niah"), "accuracy": 1.0, "model": "runs/b"},
              {**row("kvpop", "eval", "vt"), "accuracy": 1.0, "model": "runs/b"},
              row("h2o", "eval", "niah"), row("snapkv", "eval", "niah")]
    compared = compare_tables(mine, theirs)
    assert [(c["method"], c["budget"], c["tasks"], c["accuracy"], c["reference_accuracy"], c["difference"],
             c["model"], c["reference_model"]) for c in compared] == [
        ("teacher", None, ["niah", "vt"], 0.5, 0.5, 0.0, None, None),
        ("kvpop", 1024, ["niah", "vt"], 0.8, 1.0, -0.2, "runs/a", "runs/b")]
    assert "kvpop           bounded  eval        1024     0.800      1.000  -0.200\n" in comparison_text(compared, "x") + "\n"
    assert compared[1]["shared_budgets"] is None and compared[1]["reference_shared_budgets"] is None
    # the table of record serves its 512 student at 1024 too, this run trains one per budget: the row says so
    theirs_shared = theirs + [{**row("kvpop", "eval", "niah", budget=512), "model": "runs/b"}]
    mine_own = mine + [{**row("kvpop", "eval", "niah", budget=512), "model": "runs/c"}]
    compared = compare_tables(mine_own, theirs_shared)
    assert [(c["budget"], c["shared_budgets"], c["reference_shared_budgets"]) for c in compared
            if c["method"] == "kvpop"] == [(1024, None, [1024, 512]), (512, None, [1024, 512])]
    assert ("kvpop           bounded  eval        1024     0.800      1.000  -0.200  (of record: one student serves "
            "budgets 1024, 512)") in comparison_text(compared, "x")
    both = compare_tables(theirs_shared, theirs_shared)  # like with like: no note
    assert "(" not in comparison_text(both, "x").split("\n", 2)[2]
    # the committed reproduction: the record's DMS, KVpop-MLP and StreamingLLM+ students serve 1024 and 512, the
    # mLSTM students are one per budget, and RESULTS.md says which
    root = Path(__file__).resolve().parents[2]
    data = json.loads((root / "results" / "reproduce_kvpop_1300_h100.json").read_text())
    section = reproduction_section(data, root)
    assert "dms at 1024 (eval): of record: one student serves budgets 1024, 512" in section
    assert "kvpop at 1024" not in section and "streaming_plus at 1024 (heldout)" in section
    root = Path(__file__).resolve().parents[2]
    section = reproduction_section({"reproduces": "results/kvpop_table.json", "rows": mine}, root)
    assert "Against `results/kvpop_table.json`" in section
    assert reproduction_section({"rows": mine}, root) == ""
    steps = reproduction_section({"reproduces": "results/kvpop_table.json", "rows": mine,
                                  "student_steps": {"1024": {"kvpop": 701, "dms": 481}}}, root)
    assert steps.endswith("Students' optimizer steps at budget 1024 (this run): kvpop 701, dms 481.\n\n"
                          "Not like for like: the students of record trained 1,300 steps each, and here kvpop at 1024 "
                          "trained 701, dms at 1024 trained 481.")
    with_dms = [*mine, {**row("dms", "eval", "niah"), "model": "runs/d"}]
    for scope, said in (("head", True), ("model", False)):
        section = reproduction_section({"reproduces": "results/kvpop_table.json", "rows": with_dms,
                                        "dms_scope": scope}, root)
        assert section.endswith("the record's in the model scope (--dms-scope model rebuilds the record's "
                                "recipe).") is said


def test_the_students_steps_are_read_from_their_train_logs(tmp_path, capsys):
    """In minutes the device decides each student's steps: the merged table records them per budget (the last line
    of each ``train_log.jsonl``; a student without a log is left out) and the run prints them."""
    out = tmp_path / "r"
    for label, steps in (("kvpop", 3), ("dms", 1)):
        log = out / "students" / f"table_reproduce1024_{label}" / "train_log.jsonl"
        log.parent.mkdir(parents=True)
        log.write_text("".join(json.dumps({"step": i + 1, "kd": 0.1}) + "\n" for i in range(steps)))
    config = ReproduceConfig(out=str(out), budgets=(1024,), resume=True)
    assert student_steps(config) == {"1024": {"kvpop": 3, "dms": 1}}
    path = reproduce_kvpop(config, run=fake_chain(tmp_path))
    assert json.loads(Path(path).read_text())["student_steps"] == {"1024": {"kvpop": 3, "dms": 1}}
    printed = capsys.readouterr().out
    assert "students' optimizer steps at budget 1024: kvpop 3, dms 1" in printed
    assert ("not like for like with results/kvpop_table.json, whose students trained 1,300 steps each: kvpop at 1024 "
            "(3 steps); dms at 1024 (1 steps)") in printed
    merged = json.loads(Path(path).read_text())
    assert merged["dms_scope"] == "head"  # the default, which the record's DMS students did not use: said once
    assert any(r["method"] == "dms" for r in merged["rows"])  # the fake chain writes every student's row
    assert printed.count("DMS not like for like with results/kvpop_table.json: this run's DMS students trained "
                         "in the head scope, the record's in the model scope") == 1
    assert dms_scope_note({**merged, "dms_scope": "model"}) == ""
    assert dms_scope_note({"rows": [{"method": "dms"}]}) == ""  # a file from before the setting: the record's scope
    assert dms_scope_note({"dms_scope": "head", "rows": [{"method": "kvpop"}]}) == ""  # no DMS rows: nothing to say
    assert "in the head scope" in dms_scope_note({"dms_scope": "head", "rows": [{"method": "dms"}]})


def test_the_records_dms_scope_is_read_from_the_committed_table(tmp_path, monkeypatch):
    """The record's scope is its file's ``dms_scope`` (model for a file without one, or none at all), so replacing its
    DMS rows with ``merge --set dms_scope=head`` turns the note around without a code change."""
    import kvlearn.results as results
    from kvlearn.eval.reproduce import record_dms_scope

    monkeypatch.setattr(results, "repo_root", lambda: tmp_path)
    assert record_dms_scope() == "model"  # no committed table
    table = tmp_path / "results" / "kvpop_table.json"
    results.write_results(table, results.make_results("accuracy", [], device="cuda", command="t", commit="c"))
    assert record_dms_scope() == "model"  # a record from before the field
    results.write_results(table, results.make_results("accuracy", [], device="cuda", command="t", commit="c",
                                                      dms_scope="head"))
    assert record_dms_scope() == "head"
    dms = [{"method": "dms"}]
    assert dms_scope_note({"dms_scope": "head", "rows": dms}) == ""
    note = dms_scope_note({"rows": dms})  # an old reproduction (model scope) against a head-scope record
    assert "this run's DMS students trained in the model scope, the record's in the head scope" in note
    assert "--dms-scope head rebuilds" in note


def students_chain(calls):
    """A runner that writes what kvpop_table.sh writes for the students in ``STUDENTS`` (one row each) and, unless
    ``BASELINES=0``, the teacher's and a baseline's rows; records each call's (students, baselines, OUT)."""
    def run(cmd, cwd, env, stdout, stderr, check):
        budget, labels = int(env["BUDGET"]), [s.split("=")[0] for s in env["STUDENTS"].split()]
        calls.append((labels, env["BASELINES"], Path(env["OUT"]).name))
        rows = [{"method": label, "protocol": "bounded", "split": "eval", "budget": budget, "task": "niah",
                 "context": 4096, "compression": 0.5, "accuracy": 0.9, "n": 1} for label in labels]
        if env["BASELINES"] != "0":
            rows += [{"method": m, "protocol": "bounded", "split": "eval", "budget": b, "task": "niah",
                      "context": 4096, "compression": c, "accuracy": 0.5, "n": 1}
                     for m, b, c in (("teacher", 4096, 0.0), ("tova", budget, 0.5))]
        write_results(Path(env["OUT"]) / "kvpop_table.json",
                      make_results("accuracy", rows, device="cuda", command="x", commit="c", complete=True))
        return subprocess.CompletedProcess(cmd, 0)
    return run


def test_students_trained_over_several_runs_are_added_to_each_budgets_table(tmp_path):
    """``--students``: a machine whose runs are too short for four retrofits trains some students per run. The first
    run trains DMS with the teacher and the baselines, and the merged file names the three others under ``not_run``;
    a ``--resume`` run with the others trains them alone (no teacher, no baselines, their own folder) and adds their
    rows to the budget's table; a third run has nothing left to do."""
    calls = []
    out = str(tmp_path / "r")
    path = reproduce_kvpop(ReproduceConfig(out=out, budgets=(512,), students=("dms",)), run=students_chain(calls))
    merged = json.loads(Path(path).read_text())
    assert calls == [(["dms"], "1", "budget512")]
    assert {r["method"] for r in merged["rows"]} == {"dms", "teacher", "tova"} and merged["complete"] is False
    assert [x.split(" (")[0] for x in merged["not_run"]] == [
        f"every run of student {label} at B=512" for label in ("kvpop_mlp", "kvpop", "streaming_plus")]
    others = ("kvpop_mlp", "kvpop", "streaming_plus")
    config = ReproduceConfig(out=out, budgets=(512,), students=others, resume=True)
    assert "--students kvpop_mlp,kvpop,streaming_plus" in command_of(config)
    merged = json.loads(Path(reproduce_kvpop(config, run=students_chain(calls))).read_text())
    assert calls[1] == (list(others), "0", "add_kvpop_mlp_kvpop_streaming_plus")
    assert sorted(r["method"] for r in merged["rows"]) == sorted(["dms", "teacher", "tova", *others])
    assert merged["complete"] is True and merged.get("not_run", []) == []
    reproduce_kvpop(ReproduceConfig(out=out, budgets=(512,), resume=True), run=students_chain(calls))
    assert len(calls) == 2  # every student is in the table: kept


def test_students_must_be_table_1_labels(tmp_path):
    for bad in ((), ("dms", "dms"), ("h2o",)):
        with pytest.raises(KVLearnError, match="students=.* is invalid: expected one or more of "
                                               "kvpop_mlp,kvpop,streaming_plus,dms, each once"):
            ReproduceConfig(out=str(tmp_path / "x"), students=bad)


def write_log(path, steps, partial=""):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"step": i + 1, "kd": 0.1, "pad": "x" * 90}) + "\n" for i in range(steps))
                    + partial)


def test_last_step_reads_the_last_whole_line_of_a_log_being_written(tmp_path):
    log = tmp_path / "train_log.jsonl"
    assert last_step(log) is None  # no log yet
    write_log(log, 0)
    assert last_step(log) is None  # no line yet
    write_log(log, 300, partial='{"step": 301, "kd"')  # 300 lines of ~120 bytes: past the 8 KiB read from the end
    lines = log.read_text().splitlines()
    assert last_step(log) == json.loads(lines[-2])["step"] == 300  # the line being written is not read
    write_log(log, 300)
    assert last_step(log) == 300 and last_step(log, since=time.time() - 60) == 300
    old = time.time() - 3600
    os.utime(log, (old, old))
    assert last_step(log, since=time.time() - 60) is None  # an earlier run's log


def test_the_progress_bar_counts_the_students_steps_as_their_logs_grow(tmp_path):
    """While the chain runs, the bar shows the sum of its students' last logged steps, of steps x students; a
    log an earlier run left (older than the chain) counts nothing."""
    logs = [tmp_path / name / "train_log.jsonl" for name in ("a", "b", "stale")]
    write_log(logs[2], 40)
    old = time.time() - 3600
    os.utime(logs[2], (old, old))
    shown = io.StringIO()
    with RetrofitProgress(logs, total=30, desc="budget 512: 3 retrofit(s)", interval=0.01, disable=False,
                          file=shown) as progress:
        assert progress.steps() == 0
        write_log(logs[0], 4)
        time.sleep(0.2)
        assert progress.bar.n == 4  # the thread picked it up
        write_log(logs[1], 7)
        write_log(logs[2], 2)  # the third student's retrofit starts over its old log
    assert progress.bar.n == 4 + 7 + 2
    text = shown.getvalue()
    assert "budget 512: 3 retrofit(s)" in text and "13/30" in text
    assert not progress._thread.is_alive()


def test_each_chain_runs_under_a_bar_over_its_own_students(tmp_path, monkeypatch):
    """The first run of a budget counts every student it trains; a resumed run that adds students counts those."""
    seen = []

    class Recording(RetrofitProgress):
        def __init__(self, logs, total, desc, **kwargs):
            seen.append(([Path(p).parent.name for p in logs], total, desc))
            super().__init__(logs, total, desc, **kwargs)

    monkeypatch.setattr(reproduce_module, "RetrofitProgress", Recording)
    calls, out = [], str(tmp_path / "r")
    reproduce_kvpop(ReproduceConfig(out=out, budgets=(512,), students=("dms",)), run=students_chain(calls))
    reproduce_kvpop(ReproduceConfig(out=out, budgets=(512,), students=("kvpop_mlp", "kvpop"), resume=True),
                    run=students_chain(calls))
    assert seen == [(["table_reproduce512_dms"], STEPS_OF_RECORD, "budget 512: 1 retrofit(s)"),
                    (["table_reproduce512_kvpop_mlp", "table_reproduce512_kvpop"], 2 * STEPS_OF_RECORD,
                     "budget 512: 2 retrofit(s)")]
    reproduce_kvpop(ReproduceConfig(out=str(tmp_path / "m"), budgets=(256,), minutes=1.0, students=("dms",)),
                    run=students_chain(calls))
    assert seen[-1][1] is None  # in minutes the steps are not known in advance


def test_context_rows_are_a_part_of_the_chain_and_added_to_a_budget_left_without_them(tmp_path):
    """``--context-rows``: the first chain of a budget gets the context part (``CONTEXT_BASELINES=1``; a chain that
    adds students does not); a resumed budget whose table has no context rows gets exactly those runs measured, every
    training-free baseline under ``context`` on the eval split, in one ``kvpop_table.py`` part (never the chain); a
    second resume has nothing left to do."""
    from kvlearn.methods import EVICTION_METHODS

    out = tmp_path / "r"
    config = ReproduceConfig(out=str(out), budgets=(512,), resume=True, context_rows=True)
    assert budget_env(config, 512)["CONTEXT_BASELINES"] == "1"
    assert budget_env(config, 512, ("dms",), out=tmp_path / "add")["CONTEXT_BASELINES"] == "0"
    assert budget_env(ReproduceConfig(out=str(tmp_path / "p")), 512)["CONTEXT_BASELINES"] == "0"
    assert command_of(config).endswith("--context-rows --resume")
    (out / "budget512").mkdir(parents=True)
    rows = [row("teacher", s, "niah", budget=None) for s in ("eval", "heldout")]
    rows += [row(m, s, "niah", budget=512) for m in ("kvpop_mlp", "kvpop", "streaming_plus", "dms", "tova")
             for s in ("eval", "heldout")]
    rows += [row("tova", "eval", "niah", budget=512, protocol="context")]  # one context run already there
    write_results(out / "budget512" / "kvpop_table.json",
                  make_results("accuracy", rows, device="cuda", command="chain", commit="c1", complete=True))
    table = json.loads((out / "budget512" / "kvpop_table.json").read_text())
    assert finished(table) and missing_runs(table) == []
    assert context_runs_missing(table) == [(m, "context", "eval") for m in EVICTION_METHODS if m != "tova"]
    calls = []

    def table_script(cmd, cwd, env, stdout, stderr, check):
        assert cmd[0] != "bash", "the chain ran although only the context rows were missing"
        opts = {a: b for a, b in zip(cmd[2:], cmd[3:]) if a.startswith("--") and not b.startswith("--")}
        calls.append((opts["--baselines"], opts["--protocols"], opts["--splits"], "--no-teacher" in cmd))
        new = [{k: v for k, v in row(m, "eval", "niah", budget=512, protocol="context").items() if k != "commit"}
               for m in opts["--baselines"].split(",")]
        write_results(opts["--out"], make_results("accuracy", new, device="cuda", command="part", commit="c2",
                                                  complete=True))
        return subprocess.CompletedProcess(cmd, 0)

    path = reproduce_kvpop(config, run=table_script)
    assert calls == [(",".join(m for m in EVICTION_METHODS if m != "tova"), "context", "eval", True)]
    budget = json.loads((out / "budget512" / "kvpop_table.json").read_text())
    assert context_runs_missing(budget) == [] and finished(budget) and len(budget["rows"]) == len(rows) + 6
    assert json.loads(Path(path).read_text())["complete"] is True
    reproduce_kvpop(config, run=table_script)
    assert len(calls) == 1  # nothing left: kept
    reproduce_kvpop(ReproduceConfig(out=str(out), budgets=(512,), resume=True), run=table_script)
    assert len(calls) == 1  # without --context-rows a resume never asks for them


def test_merge_only_merges_every_budget_of_a_folder_without_a_device(tmp_path, capsys, monkeypatch):
    """``kvlearn reproduce kvpop --merge-only`` on a folder whose budgets ran in separate runs (each run's own table
    written for its budgets alone) merges every budget table, largest first, on a machine without CUDA and without
    running anything; an empty folder and ``--overwrite`` are one-line errors."""
    import torch

    from kvlearn.cli import main

    out = tmp_path / "r"
    for budget in (512, 1024):  # two runs, one budget each: the folder's own table holds only the last
        reproduce_kvpop(ReproduceConfig(out=str(out), budgets=(budget,), resume=budget == 1024),
                        run=fake_chain(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail(f"ran {a}"))
    (out / "kvpop_table.json").unlink()
    capsys.readouterr()
    assert main(["reproduce", "kvpop", "--out", str(out), "--merge-only"]) == 0
    merged = json.loads((out / "kvpop_table.json").read_text())
    assert [r["budget"] for r in merged["rows"]] == [1024] * 4 + [512] * 4 and merged["complete"] is True
    assert merged["command"] == f"kvlearn reproduce kvpop --out {out} --merge-only"
    assert sorted(merged["students"]) == ["1024", "512"] and (out / "kvpop_table.png").is_file()
    assert "wrote" in capsys.readouterr().out
    (tmp_path / "empty").mkdir()
    for argv, needle in ((["--out", str(tmp_path / "empty")], "holds no budget table"),
                         (["--out", str(tmp_path / "none")], "is not a folder"),
                         (["--out", str(out), "--overwrite"], "--merge-only and --overwrite exclude each other")):
        assert main(["reproduce", "kvpop", "--merge-only", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and needle in err, err


def test_resume_into_a_folder_another_device_measured_is_refused_before_any_chain(tmp_path):
    """Session 47: a call resumed an H200 folder on an H100; its chain trained for 400 s before the merge refused the
    two devices. Now the refusal comes first, naming both devices; a folder of this device resumes as before."""
    out = tmp_path / "r"
    rows = [{"method": "dms", "protocol": "bounded", "split": "eval", "budget": 1024, "task": "niah", "accuracy": 1.0,
             "n": 1}]
    write_results(out / "budget1024" / "kvpop_table.json",
                  {**make_results("accuracy", rows, command="x", commit="c", complete=True), "device": "NVIDIA H200"})
    calls = []

    def run(cmd, cwd, env, stdout, stderr, check):
        calls.append(env["BUDGET"])
        return subprocess.CompletedProcess(cmd, 0)

    with pytest.raises(KVLearnError, match=r"budget1024/kvpop_table.json \(budget 1024\) was measured on 'NVIDIA H200' "
                                           r"and this run is on .*start a new --out"):
        reproduce_kvpop(ReproduceConfig(out=str(out), budgets=(256,), resume=True), run=run)
    assert calls == []
    path = reproduce_kvpop(ReproduceConfig(out=str(tmp_path / "s"), budgets=(256,)), run=fake_chain(tmp_path))
    path = reproduce_kvpop(ReproduceConfig(out=str(tmp_path / "s"), budgets=(512,), resume=True),
                           run=fake_chain(tmp_path))  # the same device's folder: resumed and merged
    assert sorted({r["budget"] for r in json.loads(Path(path).read_text())["rows"]}) == [256, 512]


def test_a_cpu_folder_resumes_whatever_thread_count_measured_it(tmp_path):
    """A CPU device name carries the process's thread count (``cpu (x86_64, 2 threads)``): tables its chains measured
    with other threads than this process has are the same device, so --resume goes on (and the merge, which compares
    the tables with each other, takes them)."""
    from kvlearn.results import device_name

    out = tmp_path / "r"
    here = device_name("cpu")
    other = here.rsplit(", ", 1)[0] + ", 97 threads)"
    assert other != here
    rows = [{"method": "dms", "protocol": "bounded", "split": "eval", "budget": 1024, "task": "niah", "context": 4096,
             "compression": 0.75, "accuracy": 1.0, "n": 1}]
    write_results(out / "budget1024" / "kvpop_table.json",
                  {**make_results("accuracy", rows, command="x", commit="c", complete=True), "device": other})
    chain = fake_chain(tmp_path)

    def chain_with_other_threads(cmd, cwd, env, stdout, stderr, check):
        done = chain(cmd, cwd, env, stdout, stderr, check)
        table = Path(env["OUT"]) / "kvpop_table.json"
        write_results(table, {**json.loads(table.read_text()), "device": other})
        return done

    path = reproduce_kvpop(ReproduceConfig(out=str(out), budgets=(256,), resume=True, device="cpu"),
                           run=chain_with_other_threads)
    assert sorted({r["budget"] for r in json.loads(Path(path).read_text())["rows"]}) == [256, 1024]
