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
