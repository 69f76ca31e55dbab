"""Accuracy of a model on the testbed under a cache method: greedy decoding through the method's real cache.

Each batch of examples is laid out and prefilled under the configured protocol (:mod:`kvlearn.eval.protocols`:
``bounded`` or ``context``) and its answers are generated greedily with ``model.generate(..., past_key_values=cache)``;
a family's ``score`` decides exact match. Every row names its ``method``, ``protocol`` and ``split``. ``kv_bytes`` is
the cache's allocated bytes at the end of the batch divided by its rows (``store_bytes``: the keys/values alone,
without the slot positions and scores a compact cache keeps beside them); ``peak_kv_bytes`` the same for the cache's
peak during the batch when the cache reports one (``CompactCache.peak_bytes(chunk)`` of its largest forward).

A method whose cache depends on the prompt (``kaizen``: ``Method.prompt_choices``) is batched by grouping: each row's
choice is made from its prompt alone, the batch's rows are grouped by equal choice (:func:`group_by_choice`) and
each group runs as its own left-padded sub-batch through one cache of its choice (:func:`answer_batch`). Each
example's generation is scored on its own ``new_tokens`` (greedy decoding is causal, so what a batch generates
beyond them does not count), so a batch scores every example as it would score alone.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import PurePath

import torch
from tqdm.auto import tqdm

from ..errors import check, check_int
from ..methods import PROTOCOLS, get_method, make_config, method_names
from ..testbed import tasks as testbed_tasks
from .protocols import DEFAULT_PREFILL_CHUNK, layout, run_batch

METHODS = method_names()  # every registered method (kvlearn.methods)
MIN_CONTEXT = 256


def eval_splits() -> tuple[str, ...]:
    """The testbed splits an evaluation may draw from: every split but ``train``."""
    return tuple(s for s in testbed_tasks.SPLITS if s != "train")


@dataclass(frozen=True)
class EvalConfig:
    """What to evaluate. ``budget`` and ``sinks`` apply to compressing methods (not ``dense``).

    ``split``: the testbed split the examples are drawn from (:func:`eval_splits`). ``protocol``: ``bounded`` or
    ``context`` (:mod:`kvlearn.eval.protocols`), one the method defines. ``chunk_size``: prefill chunk of the
    bounded cache. ``options``: further fields of the method's config (``make_config(method, ..., **options)``,
    e.g. ``{"scorer": "mlstm"}`` for ``kvpop``; recorded in each row when given). Every bad value is a one-line
    :class:`~kvlearn.errors.KVLearnError`.
    """

    method: str = "dense"
    budget: int | None = None
    sinks: int = 4
    tasks: tuple[str, ...] = testbed_tasks.FAMILIES
    n_per_task: int = 10
    context: int = 4096
    batch_size: int = 8
    split: str = "eval"
    protocol: str = "bounded"
    chunk_size: int = DEFAULT_PREFILL_CHUNK
    seed_offset: int = 0
    target: float | None = None  # kaizen: the target compression factor (None: the one it was trained for)
    options: dict | None = None

    def __post_init__(self) -> None:
        method = get_method(self.method)
        check(self.protocol in PROTOCOLS, f"protocol={self.protocol!r} is unknown: expected one of {', '.join(PROTOCOLS)}")
        method.check_protocol(self.protocol)
        splits = eval_splits()
        check(self.split in splits, f"split={self.split!r} is invalid: expected one of {', '.join(splits)}")
        check(len(self.tasks) > 0, "tasks is empty: expected at least one of " + ", ".join(testbed_tasks.FAMILIES))
        unknown = [t for t in self.tasks if t not in testbed_tasks.FAMILIES]
        check(not unknown, f"task(s) {', '.join(map(repr, unknown))} unknown: expected any of {', '.join(testbed_tasks.FAMILIES)}")
        check_int("sinks", self.sinks, 0)  # every method's, even one that ignores it (dense, the kaizen ones)
        check_int("n_per_task", self.n_per_task, 1)
        check_int("context", self.context, MIN_CONTEXT, testbed_tasks.MAX_LENGTH,
                  hint=f" (the testbed generates at most {testbed_tasks.MAX_LENGTH} tokens)")
        check_int("batch_size", self.batch_size, 1)
        check_int("chunk_size", self.chunk_size, 1)
        check_int("seed_offset", self.seed_offset, 0)
        extra = {} if self.target is None else {"target": self.target}
        check(self.target is None or not method.token_budget,
              f"target={self.target!r}: method {self.method!r} takes a token budget, not a compression target")
        check(self.options is None or isinstance(self.options, dict),
              f"options={self.options!r} is invalid: expected None or a dict of the method's config fields")
        object.__setattr__(self, "method_config", make_config(self.method, budget=self.budget, sinks=self.sinks,
                                                              context=self.context, **extra, **(self.options or {})))

    @property
    def compression(self) -> float:
        """``1 - budget / context`` (0 for dense and for methods that keep every token, like ``kaizen``)."""
        if self.method == "dense" or self.budget is None:
            return 0.0
        return 1.0 - self.budget / self.context

    def make_cache(self, model):
        """A fresh cache of the configured method for one batch of ``model``."""
        return get_method(self.method).new_cache(model, self.method_config)


def make_cache(config: EvalConfig, model):
    """A fresh cache of the configured method for ``model``."""
    return config.make_cache(model)


def cache_bytes(cache, keys_values_only: bool = False) -> int:
    """Allocated bytes of a kvlearn compact cache (all of it, or with ``keys_values_only`` its stores alone, without
    slot positions and scores) or of a transformers ``DynamicCache`` (keys and values either way)."""
    if hasattr(cache, "allocated_bytes"):
        return cache.store_bytes() if keys_values_only else cache.allocated_bytes()
    total = 0
    for layer in cache.layers:
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(t, torch.Tensor):
                total += t.numel() * t.element_size()
    return total


def peak_cache_bytes(cache, chunk: int) -> int | None:
    """Peak allocated bytes of a kvlearn compact cache whose largest forward took ``chunk`` new tokens: its buffers
    plus the ``capacity + chunk`` keys/values one layer returns during that forward (``CompactCache.peak_bytes``);
    ``None`` for caches that do not report it (transformers' ``DynamicCache``)."""
    peak = getattr(cache, "peak_bytes", None)
    return None if peak is None else int(peak(chunk))


def examples_for(config: EvalConfig, task: str) -> list:
    """The ``n_per_task`` examples of ``task`` in the configured split at the configured context."""
    return [
        testbed_tasks.generate(task, testbed_tasks.example_seed(task, config.split, config.seed_offset + i), config.context)
        for i in range(config.n_per_task)
    ]


@dataclass
class TaskResult:
    task: str
    correct: int = 0
    n: int = 0
    kv_bytes: list[int] = field(default_factory=list)
    store_bytes: list[int] = field(default_factory=list)
    peak_kv_bytes: list[int] = field(default_factory=list)
    by_variant: dict = field(default_factory=dict)
    factors: list[float] = field(default_factory=list)  # kaizen: realised cache reduction per example
    targets: list[float] = field(default_factory=list)
    choices: list = field(default_factory=list)  # kaizen: each example's configuration
    choice_correct: list = field(default_factory=list)  # and whether that example was answered correctly

    @property
    def accuracy(self) -> float:
        return self.correct / max(1, self.n)


def _row(config: EvalConfig, result: TaskResult) -> dict:
    row = {
        "method": config.method,
        "protocol": config.protocol,
        "split": config.split,
        "budget": config.budget if config.method != "dense" else config.context,
        "sinks": config.sinks if config.method != "dense" else None,
        "context": config.context,
        "compression": round(config.compression, 6),
        "task": result.task,
        "accuracy": result.accuracy,
        "n": result.n,
        "kv_bytes": int(sum(result.kv_bytes) / max(1, len(result.kv_bytes))),
        "store_bytes": int(sum(result.store_bytes) / max(1, len(result.store_bytes))),
    }
    if config.options:
        row["options"] = dict(config.options)
    if result.peak_kv_bytes:
        row["peak_kv_bytes"] = int(sum(result.peak_kv_bytes) / len(result.peak_kv_bytes))
    if result.factors:  # a compression-factor method (kaizen): the bits per token reduced, every token kept ...
        kept = getattr(config.method_config, "budget", None)  # ... or `budget` of them (kaizen+snapkv/kvpop)
        row["budget"] = config.context if kept is None else kept
        row["sinks"] = None if kept is None else config.method_config.sinks
        row["factor"] = round(sum(result.factors) / len(result.factors), 6)
        row["target"] = round(sum(result.targets) / len(result.targets), 6)
        row["compression"] = round(1.0 - 1.0 / row["factor"], 6)
    if result.choices:  # how many different per-layer configurations the method chose for this task's prompts
        groups = group_by_choice(result.choices)
        row["distinct_configurations"] = len(groups)
        # which ones ("b4 b8 share ..." per layer) and for how many prompts, the most frequent first (at most 8)
        top = sorted(groups, key=lambda g: -len(g[1]))[:CONFIGURATIONS_LISTED]
        row["configurations"] = {str(choice): len(rows) for choice, rows in top}
        # and the accuracy of the prompts that took each: which configuration loses a family's points
        row["configuration_accuracy"] = {str(choice): sum(result.choice_correct[i] for i in rows) / len(rows)
                                         for choice, rows in top}
    row["variants"] = {k: {"accuracy": c / n, "n": n} for k, (c, n) in sorted(result.by_variant.items())}
    if result.n < config.n_per_task:
        row["incomplete"] = True
    return row


def new_tokens(example) -> int:
    """Tokens generated for ``example``: its answer with ``<eos>``, plus 32 for ``trace`` (its reasoning before
    "answer :")."""
    return len(example.answer_ids) + (32 if example.family == "trace" else 0)


CONFIGURATIONS_LISTED = 8  # a row lists at most this many of its prompts' configurations (``configurations``)


def group_by_choice(choices: list) -> list[tuple[object, list[int]]]:
    """``[(choice, row indices)]``: the rows grouped by equal choice (``==``), groups in order of first appearance,
    rows in their order, so the groups list every row once."""
    groups: list[tuple[object, list[int]]] = []
    for i, c in enumerate(choices):
        for choice, rows in groups:
            if choice == c:
                rows.append(i)
                break
        else:
            groups.append((c, [i]))
    return groups


@dataclass
class Answer:
    """One example's generation and the cache bytes charged to it.

    ``tokens``: the generated ids, the example's first :func:`new_tokens` at most; ``kv_bytes``/``store_bytes``/
    ``peak_kv_bytes``: its cache's (allocated, keys/values alone, peak) divided by the rows of its (sub-)batch
    (``peak_kv_bytes`` ``None`` for a ``DynamicCache``); ``factor``/``target``: the realised compression and the target
    of a KV-Kaizen cache (``None`` otherwise); ``choice``: the configuration a prompt-dependent method chose for it
    (``None`` otherwise)."""

    tokens: list[int]
    kv_bytes: int
    store_bytes: int
    peak_kv_bytes: int | None = None
    factor: float | None = None
    target: float | None = None
    choice: object | None = None


@torch.no_grad()
def answer_batch(model, config: EvalConfig, examples: list, pad_id: int = 0, eos_id=None) -> list[Answer]:
    """Generate the answers of ``examples`` (one batch) under ``config`` (its method prepared on ``model``).

    A prompt-independent method runs them as one left-padded batch through one cache. A method with
    ``prompt_choices`` (``kaizen``) chooses per row from the row's prompt alone, and each group of rows with equal
    choices runs as its own sub-batch through a cache of that choice (``make_choice_cache``, capacity: the group's
    prompt columns + its largest :func:`new_tokens` + 1). Answers come back in the order of ``examples``.
    """
    method = get_method(config.method)
    device = next(model.parameters()).device
    if method.prompt_choices is None:
        groups = [(None, list(range(len(examples))))]
    else:
        whole = layout(examples, config.protocol, pad_id, config.chunk_size)
        groups = group_by_choice(method.prompt_choices(config.method_config, model, whole.ids, whole.mask))
    answers: list[Answer | None] = [None] * len(examples)
    for choice, rows in groups:
        group = [examples[i] for i in rows]
        max_new = max(new_tokens(ex) for ex in group)
        padded = layout(group, config.protocol, pad_id, config.chunk_size)
        padded.ids, padded.mask = padded.ids.to(device), padded.mask.to(device)
        if choice is None:
            cache = config.make_cache(model)
        else:
            cache = method.make_choice_cache(config.method_config, model, choice, padded.ids.shape[1] + max_new + 1)
        out = run_batch(model, cache, padded, config.protocol, max_new, chunk_size=config.chunk_size,
                        pad_id=pad_id, eos_id=eos_id)
        n = len(group)
        # the largest forward: one prefill chunk (bounded), or the whole context at once (context)
        largest = padded.split if config.protocol == "context" else min(config.chunk_size, padded.ids.shape[1])
        peak = peak_cache_bytes(cache, largest)
        kaizen = choice is not None and hasattr(cache, "realised_factor")
        for j, (i, ex) in enumerate(zip(rows, group)):
            answers[i] = Answer(out[j, :new_tokens(ex)].tolist(), cache_bytes(cache) // n,
                                cache_bytes(cache, keys_values_only=True) // n, None if peak is None else peak // n,
                                cache.realised_factor() if kaizen else None,
                                float(cache.target) if kaizen else None, choice)
        del cache
    return answers


@torch.no_grad()
def tasks_not_started(config: EvalConfig, rows: list[dict]) -> list[str]:
    """The families of ``config.tasks`` that :func:`evaluate`'s ``rows`` have no row for: its deadline came before
    they started. A table script keeps such a run under ``not_run`` (its file is then not ``complete``) instead of
    counting it as done."""
    measured = {r["task"] for r in rows}
    return [task for task in config.tasks if task not in measured]


def evaluate(model, config: EvalConfig, progress: bool = True, deadline: float | None = None, bar=None,
             clock=time.monotonic) -> list[dict]:
    """Greedy exact-match accuracy per task family; returns result rows of schema ``kvlearn.results.v1``.

    Examples run in batches of ``config.batch_size`` (:func:`answer_batch`; a prompt-dependent method in groups of
    equal choice within each batch). ``deadline`` (a ``clock()`` value, ``time.monotonic`` by default): no new batch
    starts after it; the rows measured so far are returned, those with fewer than ``n_per_task`` examples marked
    ``"incomplete": True`` (tasks never started are left out: :func:`tasks_not_started` names them). ``bar``: an outer tqdm bar to advance instead of a
    bar of this call.
    """
    method = get_method(config.method)
    method.prepare(model, config.method_config)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    eos_id = model.config.eos_token_id
    own_bar = bar is None
    if own_bar:
        bar = tqdm(total=len(config.tasks) * config.n_per_task, desc=f"eval {config.method}/{config.protocol}",
                   disable=not progress, unit="ex")
    rows = []
    for task in config.tasks:
        if deadline is not None and clock() >= deadline:
            break
        result = TaskResult(task)
        examples = examples_for(config, task)
        for start in range(0, len(examples), config.batch_size):
            if deadline is not None and clock() >= deadline:
                break
            batch = examples[start : start + config.batch_size]
            for ex, answer in zip(batch, answer_batch(model, config, batch, pad_id, eos_id)):
                ok = bool(testbed_tasks.score(ex, answer.tokens))
                result.correct += ok
                result.n += 1
                result.kv_bytes.append(answer.kv_bytes)
                result.store_bytes.append(answer.store_bytes)
                if answer.peak_kv_bytes is not None:
                    result.peak_kv_bytes.append(answer.peak_kv_bytes)
                if answer.factor is not None:
                    result.factors.append(answer.factor)
                    result.targets.append(answer.target)
                if answer.choice is not None:
                    result.choices.append(answer.choice)
                    result.choice_correct.append(ok)
                v = result.by_variant.setdefault(ex.variant or task, [0, 0])
                v[0] += ok
                v[1] += 1
            bar.update(len(batch))
            bar.set_postfix(task=task, acc=f"{result.accuracy:.2f}")
        if result.n:
            rows.append(_row(config, result))
    if own_bar:
        bar.close()
    return rows


def model_name(row: dict) -> str:
    """The folder name of the model a row records (``row["model"]``, a path), or ``""`` when it records none."""
    return PurePath(str(row.get("model", ""))).name


def format_table(rows: list[dict]) -> str:
    """A plain-text table of result rows; with a ``model`` column (its folder name) when rows record their model."""
    width = max((len(model_name(r)) for r in rows), default=0)
    width = max(width, len("model")) if width else 0

    def model(name: str) -> str:
        return f" {name:<{width}}" if width else ""

    header = (f"{'method':<10}{model('model')} {'protocol':<8} {'budget':>6} {'CR':>5} {'task':<8} "
              f"{'acc':>6} {'n':>4} {'kv_bytes':>12}")
    lines = [header, "-" * len(header)]
    for r in rows:
        lines.append(
            f"{r['method']:<10}{model(model_name(r))} {r.get('protocol', 'bounded'):<8} {r['budget']:>6} "
            f"{r['compression']:>5.2f} {r['task']:<8} {r['accuracy']:>6.3f} {r['n']:>4} {r['kv_bytes']:>12,}"
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
