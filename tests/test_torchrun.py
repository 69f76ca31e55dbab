"""``tests/torchrun.py``: a launch whose port was taken is retried on a new port; any other result comes back as is."""

import subprocess

from torchrun import run_two_processes


def _fake(results):
    """A ``subprocess.run`` stand-in returning ``results`` in order and recording each command's port."""
    ports = []

    def launch(cmd, **kw):
        ports.append(cmd[cmd.index("--master_port") + 1])
        code, err = results[len(ports) - 1]
        return subprocess.CompletedProcess(cmd, code, "", err)

    return launch, ports


def test_a_taken_port_is_retried_and_other_failures_are_not():
    taken = (1, "torch.distributed.DistNetworkError: ... errno: 98 - Address already in use")
    launch, ports = _fake([taken, (0, "")])
    assert run_two_processes("driver.py", launch=launch).returncode == 0 and len(ports) == 2
    launch, ports = _fake([(1, "AssertionError: loss differs")])
    run = run_two_processes("driver.py", launch=launch)
    assert run.returncode == 1 and "loss differs" in run.stderr and len(ports) == 1
    launch, ports = _fake([taken] * 3)
    assert run_two_processes("driver.py", launch=launch, attempts=3).returncode == 1 and len(ports) == 3
