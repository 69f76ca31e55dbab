"""Accuracy of a model on the testbed under a cache method: greedy decoding through the method's real cache.

Each example's prompt is prefilled through the cache and its answer is generated greedily with
``model.generate(..., past_key_values=cache)``; a family's ``score`` decides exact match. ``kv_bytes`` is the
cache's allocated bytes at the end of the example (a batch's bytes divided by its rows).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from ..config import StreamingConfig
from ..errors import check
from ..eviction.streaming import StreamingCache
from ..hf import attach
from ..testbed import tasks as testbed_tasks

METHODS = ("dense", "streaming")


@dataclass(frozen=True)
class EvalConfig:
    """What to evaluate. ``budget`` and ``sinks`` apply to compressing methods (not ``dense``)."""

    method: str = "dense"
    budget: int | None = None
    sinks: int = 4
    tasks: tuple[str, ...] = testbed_tasks.FAMILIES
    n_per_task: int = 10
    context: int = 4096
    batch_size: int = 8
    seed_offset: int = 0
    split: str = "eval"

    def __post_init__(self) -> None:
        check(self.split in ("eval", "heldout"), f"split={self.split!r} is unknown: expected one of eval, heldout")
        check(self.method in METHODS, f"method={self.method!r} is unknown: expected one of {', '.join(METHODS)}")
        unknown = [t for t in self.tasks if t not in testbed_tasks.FAMILIES]
        check(not unknown, f"task(s) {', '.join(map(repr, unknown))} unknown: expected any of {', '.join(testbed_tasks.FAMILIES)}")
        check(len(self.tasks) > 0, "tasks is empty: expected at least one of " + ", ".join(testbed_tasks.FAMILIES))
        check(isinstance(self.n_per_task, int) and self.n_per_task >= 1, f"n_per_task={self.n_per_task!r} is invalid: expected an integer >= 1")
        check(isinstance(self.context, int) and 256 <= self.context <= 65536, f"context={self.context!r} is invalid: expected an integer in [256, 65536]")
        check(isinstance(self.batch_size, int) and self.batch_size >= 1, f"batch_size={self.batch_size!r} is invalid: expected an integer >= 1")
        if self.method != "dense":
            check(self.budget is not None, f"method {self.method!r} needs a budget: expected sinks + 1 = {self.sinks + 1} <= budget < context = {self.context}")
            StreamingConfig(budget=self.budget, sinks=self.sinks, context=self.context)  # validates the budget

    @property
    def compression(self) -> float:
        """``1 - budget / context`` (0 for dense)."""
        return 0.0 if self.method == "dense" else 1.0 - self.budget / self.context


def make_cache(config: EvalConfig, model):
    """A fresh cache of the configured method for ``model``."""
    if config.method == "dense":
        return DynamicCache(config=model.config)
    return StreamingCache(StreamingConfig(budget=config.budget, sinks=config.sinks), model.config.num_hidden_layers)


def cache_bytes(cache) -> int:
    """Allocated bytes of a kvlearn compact cache or a transformers ``DynamicCache``."""
    if hasattr(cache, "allocated_bytes"):
        return cache.allocated_bytes()
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def _left_pad(seqs: list[list[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s) :] = 1
    return ids.to(device), mask.to(device)


@dataclass
class TaskResult:
    task: str
    correct: int = 0
    n: int = 0
    kv_bytes: list[int] = field(default_factory=list)
    by_variant: dict = field(default_factory=dict)

    @property
    def accuracy(self) -> float:
        return self.correct / max(1, self.n)


@torch.no_grad()
def evaluate(model, config: EvalConfig, progress: bool = True) -> list[dict]:
    """Greedy exact-match accuracy per task family; returns result rows of schema ``kvlearn.results.v1``."""
    attach(model)
    device = next(model.parameters()).device
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    eos_id = model.config.eos_token_id
    total = len(config.tasks) * config.n_per_task
    bar = tqdm(total=total, desc=f"eval {config.method}", disable=not progress, unit="ex")
    rows = []
    for task in config.tasks:
        result = TaskResult(task)
        examples = [
            testbed_tasks.generate(task, testbed_tasks.example_seed(task, config.split, config.seed_offset + i), config.context)
            for i in range(config.n_per_task)
        ]
        for start in range(0, len(examples), config.batch_size):
            batch = examples[start : start + config.batch_size]
            ids, mask = _left_pad([ex.prompt_ids for ex in batch], pad_id, device)
            max_new = max(len(ex.answer_ids) for ex in batch) + (32 if task == "trace" else 0)
            cache = make_cache(config, model)
            out = model.generate(
                input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=max_new,
                do_sample=False, pad_token_id=pad_id, eos_token_id=eos_id,
            )
            per_example_bytes = cache_bytes(cache) // len(batch)
            for i, ex in enumerate(batch):
                ok = bool(testbed_tasks.score(ex, out[i, ids.shape[1] :].tolist()))
                result.correct += ok
                result.n += 1
                result.kv_bytes.append(per_example_bytes)
                v = result.by_variant.setdefault(ex.variant or task, [0, 0])
                v[0] += ok
                v[1] += 1
            bar.update(len(batch))
            bar.set_postfix(task=task, acc=f"{result.accuracy:.2f}")
        rows.append(
            {
                "method": config.method,
                "budget": config.budget if config.method != "dense" else config.context,
                "compression": round(config.compression, 6),
                "task": task,
                "split": config.split,
                "accuracy": result.accuracy,
                "n": result.n,
                "kv_bytes": int(sum(result.kv_bytes) / max(1, len(result.kv_bytes))),
                "variants": {k: {"accuracy": c / n, "n": n} for k, (c, n) in sorted(result.by_variant.items())},
            }
        )
    bar.close()
    return rows


def format_table(rows: list[dict]) -> str:
    """A plain-text table of result rows."""
    header = f"{'method':<10} {'budget':>6} {'CR':>5} {'split':<8} {'task':<8} {'acc':>6} {'n':>4} {'kv_bytes':>12}"
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['method']:<10} {r['budget']:>6} {r['compression']:>5.2f} {r.get('split', 'eval'):<8} {r['task']:<8} {r['accuracy']:>6.3f} "
            f"{r['n']:>4} {r['kv_bytes']:>12,}"
        )
    return "\n".join(lines)


def wilson_interval(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval of an accuracy (for plots and the docs)."""
    if n == 0:
        return 0.0, 1.0
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)
