"""A training step's device part replayed as one CUDA graph: the mechanism behind ``kvlearn retrofit
--cuda-graph-step`` (``RetrofitConfig.cuda_graph_step``; the retrofit's own wiring is
:class:`kvlearn.train.distill.GraphedRetrofitStep`).

On the testbed teacher the retrofit step is launch-bound: the GPU idles between thousands of small kernels while the
host issues them (docs/DESIGN.md section 5, "Launch overhead"). A CUDA graph records the step's device part once
(teacher forward, student forward and backward, clipping, the AdamW update, gradients zeroed in place) and replays it
with one launch. The step function reads everything that changes between steps from static buffers, which the caller
fills before each call; the learning rates are such buffers too (:func:`prepare_capturable`).

The first ``eager_steps`` calls run the step eagerly on a side stream: they are real steps, and the compiles,
autotuning and allocations happen there, outside the capture. The next call is captured (which runs nothing) and
replayed; every later call is a replay (:class:`CudaGraphStep`). Checkpoints hold plain optimizer groups
(:func:`plain_optimizer_groups`). Memory: the graph keeps the step's intermediates in its own pool, besides the
allocator's cache of the eager steps.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from ..errors import check

# the eager steps before the capture: the compiled scorer's first calls compile and autotune, and a capture must
# not see a first call
EAGER_STEPS = 3


def check_graph_step(device: torch.device, world: int = 1) -> None:
    """One-line errors where a run's ``cuda_graph_step`` cannot apply: not CUDA, or several processes (the config's
    own fields are checked by ``RetrofitConfig``, the batch's size by :class:`~kvlearn.train.distill.GraphedRetrofitStep`)."""
    check(device.type == "cuda", f"cuda_graph_step=True on device {str(device)!r}: a CUDA graph needs a CUDA device "
                                 "(--device cuda); the CPU runs the eager step")
    check(world == 1, f"cuda_graph_step=True with {world} processes (FSDP) is not supported: the graph of a sharded "
                      "step (its all-gathers and reduce-scatters) was never run; expected one process")


def prepare_capturable(optimizer: torch.optim.Optimizer, device: torch.device) -> list[torch.Tensor]:
    """Make ``optimizer`` (AdamW) read its learning rates on the device, so that a captured update follows the
    schedule: each group's ``lr`` becomes a 0-d tensor on ``device`` (float32 on CUDA, as the fused kernel reads it;
    float64 elsewhere, the Python float's value; returned, one per group, to be
    ``fill_``-ed before each step) and, on CUDA, ``capturable=True`` with every ``step`` counter on the device (a
    state loaded from a checkpoint keeps them on the CPU)."""
    lrs = []
    for group in optimizer.param_groups:
        lr = torch.tensor(float(group["lr"]), dtype=torch.float32 if device.type == "cuda" else torch.float64,
                          device=device)
        group["lr"] = lr
        lrs.append(lr)
        if device.type == "cuda":
            group["capturable"] = True
            for p in group["params"]:
                state = optimizer.state.get(p)
                if state and "step" in state and state["step"].device != p.device:
                    state["step"] = state["step"].to(device=p.device, dtype=torch.float32)
    return lrs


def plain_optimizer_groups(state: dict) -> dict:
    """An optimizer state dict (``state_dict()`` form) with every group's ``lr`` a float and ``capturable`` False, as
    an eager run writes it, so that a checkpoint of a graphed run resumes on any device, graphed or not."""
    for group in state.get("param_groups", []):
        if isinstance(group.get("lr"), torch.Tensor):
            group["lr"] = float(group["lr"])
        if group.get("capturable"):
            group["capturable"] = False
    return state


def cuda_graph_capture(device_part: Callable[[], object]) -> Callable[[], object]:
    """Record ``device_part`` in a CUDA graph (nothing runs) and return its replay: a call that launches the graph and
    returns the captured outputs (the same tensors every replay, overwritten in place)."""
    graph = torch.cuda.CUDAGraph()
    # thread_local: the data loader's pin-memory thread may allocate pinned memory while this thread captures
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        outputs = device_part()

    def replay():
        graph.replay()
        return outputs

    return replay


class CudaGraphStep:
    """``device_part`` (a function of no arguments reading its inputs from static buffers) run eagerly for the first
    ``eager_steps`` calls (on a side stream on CUDA), then captured by ``capture`` (default
    :func:`cuda_graph_capture`) and replayed on every later call. Returns ``device_part``'s outputs each call.

    ``capture`` is a parameter so that the buffer protocol can be checked where CUDA graphs do not exist: a capture
    that returns ``device_part`` itself replays by running it again (the CPU tests)."""

    def __init__(self, device_part: Callable[[], object], device: torch.device, eager_steps: int = EAGER_STEPS,
                 capture: Callable | None = None):
        self.device_part, self.device, self.eager_steps = device_part, device, eager_steps
        self.capture = cuda_graph_capture if capture is None else capture
        self.calls = 0
        self.replay: Callable[[], object] | None = None

    @property
    def captured(self) -> bool:
        return self.replay is not None

    def _side_stream(self):
        if self.device.type != "cuda":
            return contextlib.nullcontext(), lambda: None
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))

        def join():
            torch.cuda.current_stream(self.device).wait_stream(side)

        return torch.cuda.stream(side), join

    def __call__(self):
        self.calls += 1
        if self.replay is None and self.calls <= self.eager_steps:
            context, join = self._side_stream()
            with context:
                outputs = self.device_part()
            join()
            return outputs
        if self.replay is None:
            self.replay = self.capture(self.device_part)
        return self.replay()
