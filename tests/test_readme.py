"""The README's Python example runs as written, and the README says only what the checkout has."""

import re
from pathlib import Path

import pytest

from kvlearn.methods import method_names

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


@pytest.mark.skipif(not all((ROOT / "checkpoints" / name / "model.safetensors").exists()
                        for name in ("testbed-teacher", "testbed-kvpop")),
                    reason="no embedded teacher or KVpop student in this checkout")
def test_python_example_runs(monkeypatch, capsys):
    (code,) = blocks("python")
    monkeypatch.chdir(ROOT)
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    printed = capsys.readouterr().out.split()
    assert printed[0] in ("True", "False") and int(printed[1]) > 1000 and int(printed[2]) > 0
    assert printed[3] in ("True", "False") and int(printed[4]) > 0  # the KVpop student
    assert printed[5] in ("True", "False") and 0 < int(printed[6]) < int(printed[4])  # composed: 4-bit stores


def test_two_setup_commands_and_every_registered_method_named():
    setup = blocks("bash")
    assert len(setup) == 2 and all(len(b.strip().splitlines()) == 1 for b in setup)
    for name in method_names():
        assert f"`{name}`" in README
    assert "gpu_session" not in README


def test_ci_runs_the_readme_test_command():
    """``.ci/run`` runs the README's test command: the same pytest arguments (``-q`` aside)."""
    (tests_block,) = [b for b in blocks("bash") if "pytest" in b]
    readme_args = tests_block.split("python -m pytest", 1)[1].split()
    ci_line = next(line for line in (ROOT / ".ci" / "run").read_text().splitlines()
                   if line.startswith("python3 -m pytest"))
    ci_args = [a for a in ci_line.split("python3 -m pytest", 1)[1].split() if a != "-q"]
    assert ci_args == readme_args, (ci_args, readme_args)
