import os

import pytest
import torch

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one torch thread per pytest-xdist worker (the README's command runs two on CI's two cores): two workers of two
    # threads each would oversubscribe the cores; the subprocesses a test starts inherit the limit through the env
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (run with -m gpu on the device machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def make_teacher(tmp_path_factory):
    """``make(layers, seed) -> folder``: a tiny random GQA Qwen3 saved to a new folder (float32, hidden 64, 4 query
    heads over 2 KV heads of dim 16, the testbed vocabulary, tied embeddings), weights drawn after
    ``torch.manual_seed(seed)``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kvlearn.testbed.tokenizer import VOCAB_SIZE

    def make(layers: int = 2, seed: int = 0) -> str:
        torch.manual_seed(seed)
        cfg = Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                          pad_token_id=0, tie_word_embeddings=True)
        path = tmp_path_factory.mktemp("teacher") / "qwen3"
        Qwen3ForCausalLM(cfg).save_pretrained(path)
        return str(path)

    return make


@pytest.fixture(scope="session")
def teacher_path(make_teacher):
    """A tiny random GQA Qwen3 of 2 layers saved once per session (``make_teacher``): the dense model the trainer tests
    distil from. Read only."""
    return make_teacher(2, 0)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _one_torch_thread_after_each_test():
    """Under pytest-xdist, put torch back to one thread after a test that changed it (a benchmark's ``main`` called
    in the test's process with ``--threads N``): until session 53 ``benchmarks/dms_head_load.py`` and
    ``dms_cap_lift.py`` set 2 by default, and every later test of that worker then ran two threads beside the other
    worker's on CI's two cores (the table script's smoke run took 116 s of CPU there against 20 s on one thread). The
    scripts' default is 0 now: they leave torch's setting as it is (one thread in a worker, and in the processes a test
    starts through ``OMP_NUM_THREADS`` above)."""
    yield
    if os.environ.get("PYTEST_XDIST_WORKER") and torch.get_num_threads() != 1:
        torch.set_num_threads(1)


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


@pytest.fixture(scope="module")
def interpreter_results(request, run_in_triton_interpreter):
    """``{name: run_case(name)}`` for every name of the requesting test module's ``INTERP_CASES``, computed once
    per module in one interpreter subprocess (``run_case`` returns JSON data)."""
    import json
    import os

    tests_dir, module = os.path.split(os.path.abspath(request.module.__file__))
    script = (
        "import json, sys\n"
        f"sys.path.insert(0, {tests_dir!r})\n"
        f"from {module[:-3]} import INTERP_CASES, run_case\n"
        "print('RESULTS ' + json.dumps({name: run_case(name) for name in INTERP_CASES}))\n"
    )
    stdout = run_in_triton_interpreter(script)
    line = next(x for x in stdout.splitlines() if x.startswith("RESULTS "))
    return json.loads(line[len("RESULTS "):])


@pytest.fixture
def crashing_evaluate():
    """``make(real, done) -> evaluate``: a stand-in for a table script's ``evaluate`` that runs ``done`` real runs,
    then raises a CUDA out-of-memory error (a process killed mid-table)."""

    def make(real, done: int):
        calls = []

        def evaluate(*a, **k):
            calls.append(1)
            if len(calls) > done:
                raise RuntimeError("CUDA out of memory")
            return real(*a, **k)

        return evaluate

    return make


@pytest.fixture
def deadline_between_families():
    """``make(real, at) -> evaluate``: a stand-in for a table script's ``evaluate`` whose call number ``at`` (from 0)
    returns only its first family's rows, as :func:`kvlearn.eval.accuracy.evaluate` does when its deadline comes
    between families (the families never started are left out); the other calls are real."""

    def make(real, at: int):
        calls = []

        def evaluate(*a, **k):
            calls.append(1)
            rows = real(*a, **k)
            return [r for r in rows if r["task"] == rows[0]["task"]] if len(calls) == at + 1 else rows

        return evaluate

    return make

