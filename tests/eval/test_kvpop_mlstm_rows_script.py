"""``benchmarks/device/kvpop_mlstm_rows.sh`` (issue #10's open Table 1 rows): its dry run names the three
``kvpop_table.sh`` chains, and every student it asks for is one ``kvpop_table.sh`` knows."""

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dry_run_names_three_chains_with_their_budgets_windows_and_students(tmp_path):
    env = {**os.environ, "DRY_RUN": "1", "RUN_DIR": str(tmp_path), "RETROFIT_MINUTES": "2"}
    out = subprocess.run(["bash", "benchmarks/device/kvpop_mlstm_rows.sh"], env=env, capture_output=True, text=True,
                         timeout=60, cwd=ROOT).stdout
    chains = [line for line in out.splitlines() if line.endswith("bash benchmarks/device/kvpop_table.sh")]
    assert len(chains) == 3, out
    found = {}
    for line in chains:
        budget = int(re.search(r"BUDGET=(\d+)", line).group(1))
        window = int(re.search(r"--window (\d+)", line).group(1))
        students = re.search(r"STUDENTS=(.*?) BASELINES", line).group(1).split()
        assert "RETROFIT_MINUTES=2 " in line and "TOTAL_MINUTES=5.5 " in line and "BASELINES=0" in line, line
        found[budget] = (window, students)
    assert found == {1024: (256, ["kvpop=kvpop"]), 256: (64, ["kvpop=kvpop"]),
                     512: (256, ["kvpop=kvpop", "kvpop_immediate=kvpop", "kvpop_mlp=kvpop", "dms=dms"])}
    table = (ROOT / "benchmarks" / "device" / "kvpop_table.sh").read_text()
    for _, students in found.values():
        for s in students:
            assert re.search(rf"^\s+{s.split('=')[0]}\) retrofit ", table, re.M), s


def test_kvpop_table_rejects_an_unknown_student(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "STUDENTS": "kvpop_fast=kvpop", "DEVICE": "cpu"}
    run = subprocess.run(["bash", "benchmarks/device/kvpop_table.sh"], env=env, capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert run.returncode == 2
    assert "unknown student kvpop_fast: expected kvpop_mlp, kvpop, kvpop_noskip, kvpop_skip, kvpop_immediate" in run.stdout


def test_kvpop_table_extra_parts_run_on_the_named_students(tmp_path):
    """``EXTRA_PARTS`` (ablations on the same students): each part is one more kvpop_table.py process, with
    ``{name}`` replaced by that student's checkpoint folder (python3 replaced by a stub that logs its arguments)."""
    students = tmp_path / "students"
    for name in ("kvpop_mlp", "kvpop"):
        (students / name).mkdir(parents=True)
        (students / name / "config.json").write_text("{}")
    stub = tmp_path / "bin" / "python3"
    stub.parent.mkdir()
    stub.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls.log\n')
    stub.chmod(0o755)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "STUDENTS_FROM": str(students), "BASELINES": "0",
           "STUDENTS": "kvpop_mlp=kvpop kvpop=kvpop", "PATH": f"{stub.parent}:{os.environ['PATH']}",
           "EXTRA_PARTS": "mlp494|--student k234=kvpop:{kvpop_mlp} --budgets 494;"
                          "fullk|--student fullk=kvpop:{kvpop} --state-in-budget 0"}
    subprocess.run(["bash", "benchmarks/device/kvpop_table.sh"], env=env, capture_output=True, text=True,
                   timeout=60, cwd=ROOT)
    tables = [line for line in (tmp_path / "calls.log").read_text().splitlines() if "kvpop_table.py" in line]
    assert len(tables) == 4, tables  # the two students' parts and the two extra ones
    mlp494 = next(line for line in tables if "part_mlp494.json" in line)
    assert f"--student k234=kvpop:{students}/kvpop_mlp --budgets 494" in mlp494
    fullk = next(line for line in tables if "part_fullk.json" in line)
    assert f"--student fullk=kvpop:{students}/kvpop --state-in-budget 0" in fullk


def _retrofit_calls(tmp_path, **extra_env) -> dict[str, list[str]]:
    """Each student's ``kvlearn retrofit`` arguments as ``kvpop_table.sh`` issues them (python3 stubbed)."""
    stub = tmp_path / "bin" / "python3"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/calls.log\n')
    stub.chmod(0o755)
    (tmp_path / "calls.log").unlink(missing_ok=True)
    env = {**os.environ, "OUT": str(tmp_path / "out"), "WORK_DIR": str(tmp_path / "work"), "BASELINES": "0",
           "STUDENTS": "kvpop_mlp=kvpop kvpop=kvpop kvpop_noskip=kvpop kvpop_immediate=kvpop",
           "PATH": f"{stub.parent}:{os.environ['PATH']}", **extra_env}
    subprocess.run(["bash", "benchmarks/device/kvpop_table.sh"], env=env, capture_output=True, text=True, timeout=60,
                   cwd=ROOT)
    calls = {}
    for line in (tmp_path / "calls.log").read_text().splitlines():
        if " retrofit " in f" {line} ":
            args = line.split()
            calls[Path(args[args.index("--out") + 1]).name.removeprefix("table_")] = args[args.index("retrofit") + 1:]
    return calls


def test_kvpop_table_mlstm_students_train_under_the_readout_penalty(tmp_path):
    """Table 1's mLSTM recipe since session 28: every mLSTM student with a skip path gets ``--readout-penalty 30``
    (MLSTM_READOUT_PENALTY overrides it, and a --readout-penalty in KVPOP_EXTRA comes later, so argparse takes it);
    the MLP student and the mLSTM without a skip path get none. The arguments are read back by kvlearn's own parser."""
    from kvlearn.cli import build_parser

    def penalty(args):
        return build_parser().parse_args(["retrofit", *args]).readout_penalty

    calls = _retrofit_calls(tmp_path)
    assert set(calls) == {"kvpop_mlp", "kvpop", "kvpop_noskip", "kvpop_immediate"}, calls
    assert {name: penalty(args) for name, args in calls.items()} == \
        {"kvpop_mlp": None, "kvpop": 30.0, "kvpop_noskip": None, "kvpop_immediate": 30.0}
    assert penalty(_retrofit_calls(tmp_path, MLSTM_READOUT_PENALTY="0")["kvpop"]) == 0.0
    extra = "--decay-init 0.99999 --target-reduction peak --readout-penalty 3"
    assert penalty(_retrofit_calls(tmp_path, KVPOP_EXTRA=extra)["kvpop"]) == 3.0


def test_kvpop_table_mlstm_students_train_their_scorers_through_the_distillation_loss(tmp_path):
    """Table 1's mLSTM recipe since session 30: every mLSTM student with a skip path gets ``--scorer-kd 1``
    (MLSTM_SCORER_KD overrides it, and a --scorer-kd in KVPOP_EXTRA comes later, so argparse takes it); the MLP
    student and the mLSTM without a skip path keep the boundary loss alone (0, the trainer's default)."""
    from kvlearn.cli import build_parser

    def weight(args):
        return build_parser().parse_args(["retrofit", *args]).scorer_kd

    calls = _retrofit_calls(tmp_path)
    assert {name: weight(args) or 0.0 for name, args in calls.items()} == \
        {"kvpop_mlp": 0.0, "kvpop": 1.0, "kvpop_noskip": 0.0, "kvpop_immediate": 1.0}
    assert weight(_retrofit_calls(tmp_path, MLSTM_SCORER_KD="0")["kvpop"]) == 0.0
    extra = "--decay-init 0.99999 --target-reduction peak --scorer-kd 0.1"
    assert weight(_retrofit_calls(tmp_path, KVPOP_EXTRA=extra)["kvpop"]) == 0.1
