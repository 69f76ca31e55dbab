"""The device jobs (``benchmarks/device/*.sh``) name only files the checkout has: a renamed test or script would
otherwise surface as a failed call on the GPU, where every minute counts."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATH = re.compile(r"(?<![\w/$.-])((?:tests|benchmarks|src/kvlearn)/[\w/.-]+?\.(?:py|sh))\b")


def named_paths(text: str) -> set[str]:
    """The repository-relative ``tests/``, ``benchmarks/`` and ``src/kvlearn/`` paths of ``.py``/``.sh`` files that a
    script's text names (a path under a variable, ``$OUT/tests/x.py``, is not the checkout's and is left out)."""
    return set(PATH.findall(text))


def test_path_pattern_by_hand():
    text = ("python3 -m pytest tests/ops/test_quant.py tests/kvpop/x_y.py && python benchmarks/kvpop_table.py "
            "--out $OUT/tests/not_ours.py; bash benchmarks/device/retrofit.sh # src/kvlearn/hf.py")
    assert named_paths(text) == {"tests/ops/test_quant.py", "tests/kvpop/x_y.py", "benchmarks/kvpop_table.py",
                                 "benchmarks/device/retrofit.sh", "src/kvlearn/hf.py"}


def test_device_scripts_name_only_existing_files():
    scripts = sorted((ROOT / "benchmarks" / "device").glob("*.sh"))
    assert scripts
    named = {(s.name, p) for s in scripts for p in named_paths(s.read_text())}
    assert ("kernel_checks.sh", "tests/ops/test_retention_attention.py") in named  # the pattern reads the scripts
    missing = sorted(f"{script}: {path}" for script, path in named if not (ROOT / path).is_file())
    assert not missing, missing
