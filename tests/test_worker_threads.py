"""The suite's own hygiene (``tests/conftest.py``): under pytest-xdist every test starts on one torch thread, even after
a test whose code changed the count (a benchmark's ``main`` called in-process with ``--threads N``), so that the two
workers on CI's two cores never run two threads each; and the ``--threads`` option the CLI and the benchmark scripts
share (``kvlearn.threads.thread_count`` / ``set_threads``): 0 leaves torch's default, a bad count is one line."""

from pathlib import Path

pytest_plugins = ["pytester"]

CONFTEST = Path(__file__).resolve().parent / "conftest.py"


def test_a_test_that_sets_two_threads_leaves_the_next_one_on_one(pytester):
    pytester.makeconftest(CONFTEST.read_text())
    pytester.makepyfile(test_order="""
        import torch

        def test_a_sets_two():
            assert torch.get_num_threads() == 1
            torch.set_num_threads(2)

        def test_b_starts_on_one():
            assert torch.get_num_threads() == 1
        """)
    result = pytester.runpytest_subprocess("-n", "1", "-p", "no:cacheprovider", "-p", "no:randomly")
    result.assert_outcomes(passed=2)


SCRIPTS_WITH_THREADS = ("dms_cap_lift", "dms_head_load", "kvpop_retention", "kvpop_scorer_fit", "kvpop_scorer_kd_check",
                        "kvpop_target_oracle", "kaizen_layer_sensitivity")


def test_set_threads_leaves_the_default_at_zero_and_sets_a_count():
    import pytest
    import torch

    from kvlearn import KVLearnError
    from kvlearn.threads import set_threads, thread_count

    before = torch.get_num_threads()
    try:
        set_threads(0)
        assert torch.get_num_threads() == before
        set_threads(before + 1)
        assert torch.get_num_threads() == before + 1
        with pytest.raises(KVLearnError, match="--threads=-1 is invalid"):
            set_threads(-1)
    finally:
        torch.set_num_threads(before)
    assert [thread_count(t) for t in ("0", "3")] == [0, 3]


def test_every_benchmark_threads_option_refuses_a_bad_count_in_one_line(capsys):
    """The scripts' ``--threads`` (default 0: torch's default, so a test that calls their ``main`` leaves its worker's
    one thread alone) is checked by argparse: a negative or non-numeric count is one line, not torch's RuntimeError."""
    import pytest
    import torch

    from benchmark_loader import load_benchmark

    before = torch.get_num_threads()
    for name in SCRIPTS_WITH_THREADS:
        script = load_benchmark(name)
        for bad in ("-1", "two"):
            with pytest.raises(SystemExit) as exit_:
                script.main(["--threads", bad])
            err = capsys.readouterr().err.strip().splitlines()[-1]
            assert exit_.value.code == 2, name
            assert f"argument --threads: '{bad}' is invalid: expected 0 (torch's default) or a positive number" in err
    assert torch.get_num_threads() == before


def test_the_thread_option_lives_outside_the_cli():
    """The benchmark scripts take ``--threads`` from ``kvlearn.threads``, which loads neither the CLI nor torch until a
    count is set (before session 58 they imported it from ``kvlearn.cli``, the command line's module)."""
    import subprocess
    import sys

    code = ("import sys, kvlearn.threads; "
            "print(sorted(m for m in ('kvlearn.cli', 'torch') if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "[]"
    benchmarks = Path(__file__).resolve().parents[1] / "benchmarks"
    for name in SCRIPTS_WITH_THREADS:
        text = (benchmarks / f"{name}.py").read_text()
        assert "from kvlearn.threads import" in text and "from kvlearn.cli import" not in text, name
