"""Data parallelism for the trainers: process-group set-up, FSDP2 sharding, global reductions, full state dicts.

Both trainers run unchanged in one process; under ``torchrun`` (``WORLD_SIZE > 1``) they call:

* :func:`init_distributed` once: NCCL for a CUDA device (each rank on ``cuda:LOCAL_RANK``), gloo for the CPU.
* :func:`shard_model` (FSDP2 ``fully_shard``): every decoder layer is one unit, then the root (embeddings, final
  norm, head). Modules a method adds inside a layer (KVpop's scorers, DMS's gates) shard with their layer. A module
  the trainer calls outside the model's forward (KV-Kaizen's selector) shards with the root unit, which is then a
  wrapper whose forward runs both (``root=``; :class:`kvlearn.train.kaizen_train.KaizenStep`).
* :func:`all_reduce_sum` for every statistic a loss normalises by (supervised token counts, valid boundary
  decisions, class balance): the losses are then those of the global batch, and with FSDP's gradient averaging
  over ranks a ``world``-process run takes the same optimiser step as one process on the whole batch (tested with
  gloo in ``tests/train/test_distill_fsdp.py``).
* :func:`all_gather_rows` for per-row values every process needs whole (KV-Kaizen's budget multiplier is updated
  from the realised cost of every row of the global batch, the same on every process: tested in
  ``tests/train/test_kaizen_train_fsdp.py``).
* :func:`full_state_dict` / :func:`load_full_state_dict` for checkpoints: rank 0 writes the same files as a
  single-process run, so a checkpoint is loadable and resumable with any number of processes.

No state lives here between calls: the process group is torch's own.
"""

from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["DistInfo", "init_distributed", "close_distributed", "all_reduce_sum", "all_gather_rows", "agreed_fraction",
           "shard_model", "decoder_layers", "full_state_dict", "full_optimizer_state_dict", "load_optimizer_state_dict",
           "world_size"]


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the job: ``rank`` of ``world`` processes, ``local_rank`` on its host."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """True on the process that logs and writes checkpoints."""
        return self.rank == 0


def init_distributed(device: str = "cuda") -> DistInfo:
    """Join the ``torchrun`` job when ``WORLD_SIZE > 1`` (NCCL for ``device`` cuda, gloo for cpu), else a
    one-process :class:`DistInfo`. On CUDA the current device becomes ``cuda:LOCAL_RANK``."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return DistInfo()
    cuda = str(device).startswith("cuda")
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")
    d = DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))
    if cuda:
        torch.cuda.set_device(d.local_rank)
    return d


def close_distributed(d: DistInfo) -> None:
    """Leave the process group (a no-op for one process). Callers drop their sharded modules and optimizer first:
    FSDP2's parameter groups hold the process group, and sharded modules live in reference cycles, so without that a
    module collected only at interpreter exit destroys the gloo group there, where its worker thread can no longer
    take the GIL (a rank aborted with "terminate called without an active exception" in CI). The ``gc.collect()``
    here frees those cycles while the group and the interpreter are both alive."""
    if d.world > 1 and dist.is_initialized():
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()


def world_size() -> int:
    """Processes in the job (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the ranks (a new tensor, gradient-free); ``t`` itself with one process."""
    if world_size() == 1:
        return t
    out = t.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out


def all_gather_rows(t: torch.Tensor) -> torch.Tensor:
    """The ranks' ``t [rows, ...]`` concatenated along dim 0 in rank order (gradient-free; every rank must pass the
    same shape): per-row values of the global batch when each rank holds its :func:`~kvlearn.testbed.data.shard_rows`
    share. ``t`` itself with one process."""
    if world_size() == 1:
        return t
    t = t.detach().contiguous()
    parts = [torch.empty_like(t) for _ in range(world_size())]
    dist.all_gather(parts, t)
    return torch.cat(parts)


def agreed_fraction(fraction: float, d: DistInfo, device: torch.device) -> float:
    """Rank 0's elapsed share of a wall-clock run on every process (a broadcast), so that the run ends at the same
    step everywhere; ``fraction`` itself with one process."""
    if d.world == 1:
        return fraction
    t = torch.tensor([fraction], dtype=torch.float64, device=device)
    dist.broadcast(t, 0)
    return float(t)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The decoder layers of a Hugging Face causal LM (``model.model.layers``); one-line error otherwise."""
    from ..errors import check

    layers = getattr(getattr(model, "model", None), "layers", None)
    check(layers is not None, f"{type(model).__name__} has no model.layers: FSDP sharding supports decoder-only "
                              "Hugging Face causal LMs (Qwen3, Qwen2, Llama, Mistral)")
    return list(layers)


def shard_model(model, root: torch.nn.Module | None = None) -> torch.nn.Module:
    """FSDP2-shard ``model`` in place over the current process group: each decoder layer, then the root. ``root``: a
    module that holds ``model`` and whose forward runs it (KV-Kaizen's training step, which calls the selector
    before the model): it becomes the root unit instead of ``model``, so parameters that its forward uses outside
    ``model.forward`` are gathered for it too."""
    from torch.distributed.fsdp import fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer)
    fully_shard(model if root is None else root)
    return model


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """The whole (unsharded) state dict on the CPU, on every rank (a collective: every process calls it); the plain
    state dict with one process. Tied aliases (``lm_head.weight`` when it is the embedding) are left out, as
    ``save_pretrained`` does: gathered copies no longer share storage, so it could not tell them apart."""
    if world_size() == 1:
        return model.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    aliases = ({n for n, _ in model.named_parameters(remove_duplicate=False)}
               - {n for n, _ in model.named_parameters()})
    return {k: v for k, v in state.items() if k not in aliases}


def full_optimizer_state_dict(model, optimizer) -> dict:
    """The whole optimizer state on the CPU, keyed by parameter name (the same form for any number of processes,
    so a checkpoint resumes with another world size)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state_dict(model, optimizer, state: dict) -> None:
    """Load a state written by :func:`full_optimizer_state_dict` into a (sharded or plain) optimizer."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))

