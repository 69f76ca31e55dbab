import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run with -m gpu on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def run_in_triton_interpreter():
    """``run(script) -> stdout``: a Python script in a subprocess with ``TRITON_INTERPRET=1`` set before triton is
    imported (Triton kernels then run on the CPU); a failing script fails the test with its stderr."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")

    def run(script: str) -> str:
        env = dict(os.environ, TRITON_INTERPRET="1")
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    return run
