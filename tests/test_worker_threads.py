"""The suite's own hygiene (``tests/conftest.py``): under pytest-xdist every test starts on one torch thread, even after
a test whose code changed the count (a benchmark's ``main`` called in-process sets its ``--threads``, 2 by default),
so that the two workers on CI's two cores never run two threads each."""

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
