"""kvlearn.results.command_line: the recorded command carries no absolute machine path."""

import sys
import tempfile

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


def test_kvlearn_entry_point_and_paths_elsewhere(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/usr/local/bin/kvlearn", "eval", "--model", "checkpoints/testbed-teacher"])
    assert command_line() == "kvlearn eval --model checkpoints/testbed-teacher"
    assert portable_path("/opt/models/x") == "/opt/models/x"  # outside the repository, $OUT and the temp folder
    assert portable_path("relative/path") == "relative/path"
