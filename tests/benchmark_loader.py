"""Load a script of ``benchmarks/`` as a module, for the tests of those scripts (the scripts are not a package)."""

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` executed as a fresh module named ``name`` (``benchmarks/`` on ``sys.path`` first:
    some scripts import a sibling, e.g. ``kvpop_table`` imports ``eviction_baselines``)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass defined in the script looks its module up here
    spec.loader.exec_module(module)
    return module
