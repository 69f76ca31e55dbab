"""Run a script under ``torchrun`` with 2 CPU processes (gloo) for the FSDP / DDP tests.

The rendezvous port is picked free just before the launch, so another process may take it in between; when torchrun
fails on that (its stderr says the address is in use), the launch is retried on a new port, at most ``attempts``
times. Any other failure is returned as it is, for the test to assert on."""

import os
import socket
import subprocess
import sys
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")
PORT_TAKEN = ("address already in use", "eaddrinuse")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict:
    """This checkout's ``src`` first on the path, one thread per process."""
    return {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}


def run_two_processes(*args: str, timeout: float = 600, attempts: int = 3,
                      launch=subprocess.run) -> subprocess.CompletedProcess:
    """``python -m torch.distributed.run --nproc_per_node 2 ... *args`` (``args``: the script and its arguments),
    retried on a new port while the port was taken. ``launch`` is ``subprocess.run`` (a test replaces it)."""
    for attempt in range(attempts):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), *args]
        run = launch(cmd, env=env(), capture_output=True, text=True, timeout=timeout)
        if run.returncode == 0 or not any(s in run.stderr.lower() for s in PORT_TAKEN) or attempt == attempts - 1:
            return run
    raise AssertionError("unreachable")
