"""The retrofit step replayed as one CUDA graph (``RetrofitConfig.cuda_graph_step``, ``kvlearn retrofit
--cuda-graph-step``).

On the testbed teacher the retrofit step is launch-bound: the GPU idles between thousands of small kernels while the
host issues them (docs/DESIGN.md section 5, "Launch overhead"). A CUDA graph records the step's device part once
(:func:`~kvlearn.train.distill.step_tensors`: teacher forward, student forward and backward, clipping, the AdamW
update, gradients zeroed in place) and replays it with one launch.

What changes from one step to the next is written into the graph's static inputs before each replay:

- the batch (``input_ids``, ``labels``, int64 ``[B, T]``), copied into device buffers of the first batch's shape;
- the boundary loss's query positions (int64 ``[queries_per_step]``), drawn on the host by
  :func:`~kvlearn.train.distill.step_draws` exactly as the eager step draws them;
- the three learning rates, as 0-d float32 device tensors that the (fused, ``capturable``) AdamW reads on the device.

The first ``eager_steps`` steps of the run (or of a resumed run) run eagerly on a side stream, reading the same
buffers: they are real steps, and the compiles, autotuning and allocations happen there, outside the capture. The
next step is captured (which runs nothing) and replayed; every later step is a replay. Each step reads its values
back once, as the eager step does (:func:`~kvlearn.train.distill.read_back`).

Where it applies (:func:`check_graph_step`, one-line errors otherwise): one CUDA process, methods ``kvpop`` and
``streaming_plus`` (DMS draws its Gumbel noise and its target on the host every step), the scorer distillation off,
the mLSTM scorer compiled in its default mode (its own CUDA graphs would be nested), and a batch whose KD loss keeps
every position (``kd_loss`` selects the supervised positions of larger batches with a data-dependent shape).
Memory: the graph keeps the step's intermediates in its own pool, besides the allocator's cache of the eager steps.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from ..errors import check
from . import distill

# the eager steps before the capture: the compiled scorer's first calls compile and autotune, and a capture must
# not see a first call
EAGER_STEPS = 3


def check_graph_step(device: torch.device, world: int = 1) -> None:
    """One-line errors where a run's ``cuda_graph_step`` cannot apply: not CUDA, or several processes (the config's
    own fields are checked by ``RetrofitConfig``, the batch's size by :class:`GraphedRetrofitStep`)."""
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


class GraphedRetrofitStep:
    """:func:`~kvlearn.train.distill.train_step` for one CUDA process, its device part replayed as one CUDA graph
    after ``eager_steps`` eager steps (module docstring). Call it as ``train_step`` is called, without ``kv`` and
    ``d``: ``step(input_ids, labels, step, fraction) -> dict`` of the same logged values.

    Builds on the run's ``optimizer`` (made with ``capturable=True``; its learning rates become device tensors,
    :func:`prepare_capturable`). ``capture``: see :class:`CudaGraphStep`."""

    def __init__(self, config, teacher, student, optimizer, kv, device: torch.device,
                 eager_steps: int = EAGER_STEPS, capture: Callable | None = None):
        check(config.method in GRAPHED_METHODS,
              f"cuda_graph_step=True is for methods {', '.join(GRAPHED_METHODS)}, not {config.method!r} (DMS draws its "
              "Gumbel noise and its compression target on the host every step)")
        vocab = student.config.vocab_size
        elements = config.batch_size * (config.seq_len - 1) * vocab
        check(elements <= distill.KD_DENSE_ELEMENTS,
              f"cuda_graph_step=True with batch_size x (seq_len - 1) x vocab = {config.batch_size} x "
              f"{config.seq_len - 1} x {vocab} = {elements} logits: expected <= {distill.KD_DENSE_ELEMENTS} (above it "
              "the KD loss selects the supervised positions, a shape a CUDA graph cannot replay); lower batch_size")
        self.config, self.teacher, self.student, self.optimizer, self.kv = config, teacher, student, optimizer, kv
        self.device = device
        self.lrs = prepare_capturable(optimizer, device)
        self.input_ids: torch.Tensor | None = None  # [B, T] int64, allocated on the first call
        self.labels: torch.Tensor | None = None
        self.queries = torch.zeros(config.queries_per_step, dtype=torch.int64, device=device)  # [n]
        self.graph = CudaGraphStep(self._device_part, device, eager_steps, capture)

    def _device_part(self):
        draws = distill.StepDraws(self.queries, None) if self.config.method == "kvpop" else None
        return distill.step_tensors(self.config, self.teacher, self.student, self.optimizer, self.input_ids,
                                    self.labels, self.kv, draws, 0, 0.0, set_to_none=False)

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor, step: int, fraction: float) -> dict:
        if self.input_ids is None:
            self.input_ids = torch.empty_like(input_ids, device=self.device)
            self.labels = torch.empty_like(labels, device=self.device)
        check(input_ids.shape == self.input_ids.shape and labels.shape == self.labels.shape,
              f"cuda_graph_step: a batch of shape {tuple(input_ids.shape)} after batches of "
              f"{tuple(self.input_ids.shape)}: a CUDA graph replays one shape; expected every batch alike")
        self.input_ids.copy_(input_ids, non_blocking=True)
        self.labels.copy_(labels, non_blocking=True)
        config = self.config
        if config.method == "kvpop":
            self.queries.copy_(distill.step_draws(config, self.kv, step, self.device).queries, non_blocking=True)
        lr_new, lr_decay = distill.new_lr_at(config, step, fraction), distill.decay_lr_at(config, step, fraction)
        for lr, value in zip(self.lrs, (config.lr, lr_new, lr_decay)):
            lr.fill_(value)
        summed, means, grad_norm = self.graph()
        return {**distill.read_back(summed, means, self.device, grad_norm=grad_norm), "lr": config.lr,
                "lr_new": lr_new, "lr_decay": lr_decay}


GRAPHED_METHODS = ("kvpop", "streaming_plus")
