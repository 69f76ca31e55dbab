"""The ``--threads`` option the CLI and the benchmark scripts share: torch's CPU thread count, checked before it
reaches ``torch.set_num_threads`` (0 leaves torch's default; a bad count is a one-line error)."""

from __future__ import annotations

import argparse

from .errors import check_int

__all__ = ["THREADS_HELP", "thread_count", "set_threads"]

THREADS_HELP = "CPU threads for torch (0: torch's default, one per core or OMP_NUM_THREADS)"


def thread_count(text: str) -> int:
    """``--threads`` as an argparse ``type``: a whole number >= 0 (0 leaves torch's default), else argparse's one-line
    error. The benchmark scripts use it too, so that a bad value never reaches ``torch.set_num_threads``."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected 0 (torch's default) or a positive number of "
                                         "threads")
    return n


def set_threads(n: int) -> None:
    """Set torch's CPU threads to ``n``; 0 leaves its default (one per core, or ``OMP_NUM_THREADS``, which the test
    suite sets to 1 for the processes a test starts). A one-line error below 0."""
    import torch

    check_int("--threads", n, 0)
    if n:
        torch.set_num_threads(n)
