"""Training data from the testbed: fixed-length batches, sequence packing and a worker-safe stream.

Labels follow the Hugging Face convention: ``labels[i] = input_ids[i]`` where token ``i`` is supervised and
``-100`` elsewhere (the model shifts internally, so position ``i - 1`` learns to predict token ``i``).
Supervised tokens are the answer (``<eos>`` included; for trace the whole generated trace) and the in-context
answers that ``loss_mask_prompt`` marks. Filler, keys, values at their first mention and questions are not.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import torch
from torch.utils.data import IterableDataset, get_worker_info

from ..errors import check
from ..ops.distill_loss import IGNORE_INDEX  # the label of an unsupervised position
from .filler import TRAIN_STYLES
from .tasks import (FAMILIES, MULTIVALUE_PROBE_SHARE, TRAIN_REGIMES, Example, check_multivalue_share, example_seed,
                    generate)
from .tokenizer import PAD_ID

MAX_BATCH = 4096  # rows of one batch: example index = (batch seed << 12) | row


def example_labels(example: Example) -> list[int]:
    """Labels ``[length]`` of ``example.input_ids``: the token where supervised, else -100."""
    prompt = [t if m else IGNORE_INDEX for t, m in zip(example.prompt_ids, example.loss_mask_prompt)]
    return prompt + list(example.answer_ids)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_mixture(families, weights) -> tuple[tuple[str, ...], list[float]]:
    """``(families, weights)`` of a training mixture, validated: a non-empty subset of the testbed's families and one
    non-negative number per family with a positive sum (``None``: uniform); one-line errors naming the families."""
    families = tuple(families) if not isinstance(families, str) else (families,)
    check(
        len(families) > 0 and all(f in FAMILIES for f in families),
        f"families={families!r} is invalid: expected a non-empty subset of {FAMILIES}",
    )
    if weights is None:
        return families, [1.0] * len(families)
    ok = isinstance(weights, (list, tuple)) and all(isinstance(w, (int, float)) and not isinstance(w, bool)
                                                    for w in weights)
    check(ok and len(weights) == len(families) and all(w >= 0 for w in weights) and sum(weights) > 0,
          f"weights={weights!r} is invalid: expected {len(families)} non-negative numbers with a positive sum, one per "
          f"family ({', '.join(families)})")
    return families, [float(w) for w in weights]


def dense_share(dense, name: str = "dense") -> float:
    """``dense`` as the share of rows drawn in the dense training format: True -> 1, False -> 0, or a number in
    [0, 1]; a one-line error naming ``name`` otherwise."""
    ok = isinstance(dense, bool) or (isinstance(dense, (int, float)) and 0.0 <= float(dense) <= 1.0)
    check(ok, f"{name}={dense!r} is invalid: expected True, False or a share of dense rows in [0, 1]")
    return float(dense)


def check_haystack_subset(values, allowed: tuple[str, ...], name: str) -> tuple[str, ...] | None:
    """``values`` as a non-empty tuple of names from ``allowed`` (None stays None: the seed draws from all of
    them); a one-line error naming ``name`` and the choices otherwise. Training may narrow the haystack, never
    widen it to the held-out styles and regimes."""
    if values is None:
        return None
    values = (values,) if isinstance(values, str) else tuple(values)
    bad = [v for v in values if v not in allowed]
    check(values and not bad, f"{name}={values!r} is invalid: expected a non-empty subset of the training choices "
                              f"{', '.join(allowed)}")
    return values


def batch_examples(
    batch_size: int, length: int, seed: int, families: Sequence[str] = FAMILIES, weights=None,
    dense: bool | float = True, styles: Sequence[str] | None = None, regimes: Sequence[str] | None = None,
    rows: range | None = None, multivalue_share: float = MULTIVALUE_PROBE_SHARE,
) -> list[Example]:
    """The examples of training batch ``seed``: row ``j`` is train example ``(seed << 12) | j`` of a family
    drawn from ``families`` with probabilities proportional to ``weights`` (uniform when None).

    ``dense``: True (every row in the dense training format), False (every row in the evaluation format, only
    the final answer supervised) or the share in [0, 1] of dense rows, each row drawn independently.
    ``styles`` / ``regimes``: when given, each row's haystack style / depth regime is drawn uniformly from them
    (subsets of the training ones) instead of from the example's seed. ``rows``: only these rows of the batch
    (a data-parallel share, :func:`shard_rows`); the rows are the same examples as in the whole batch.
    ``multivalue_share``: the share of dense niah rows' in-context probes (from length 512 on) whose key gets several
    needles (:func:`kvlearn.testbed.tasks.generate`); 0 gives the rows of 1880c5c, the shipped teacher's data."""
    check(_is_int(batch_size) and 1 <= batch_size <= MAX_BATCH, f"batch_size={batch_size!r} is invalid: expected an integer in [1, {MAX_BATCH}]")
    check(_is_int(seed) and seed >= 0, f"seed={seed!r} is invalid: expected an integer >= 0")
    families, weights = check_mixture(families, weights)
    share = dense_share(dense)
    multivalue_share = check_multivalue_share(multivalue_share)
    styles = check_haystack_subset(styles, TRAIN_STYLES, "styles")
    regimes = check_haystack_subset(regimes, TRAIN_REGIMES, "regimes")
    rng = random.Random(f"kvlearn-batch:{seed}")
    chosen = rng.choices(families, weights=weights, k=batch_size)
    is_dense = [rng.random() < share for _ in range(batch_size)]  # share 1 -> all, 0 -> none
    hay_rng = random.Random(f"kvlearn-batch-haystack:{seed}")  # only drawn from when narrowed: default batches unchanged
    hay = [(hay_rng.choice(styles) if styles else None, hay_rng.choice(regimes) if regimes else None)
           for _ in range(batch_size)]
    rows = range(batch_size) if rows is None else _check_rows(rows, batch_size)
    return [
        generate(chosen[j], example_seed(chosen[j], "train", (seed << 12) | j), length, dense=is_dense[j],
                 style=hay[j][0], regime=hay[j][1], multivalue_share=multivalue_share)
        for j in rows
    ]


def _check_rows(rows, batch_size: int) -> range:
    check(isinstance(rows, range) and rows.step == 1 and 0 <= rows.start <= rows.stop <= batch_size,
          f"rows={rows!r} is invalid: expected a range(start, stop) within [0, batch_size={batch_size}]")
    return rows


def shard_rows(batch_size: int, index: int, count: int) -> range:
    """The rows of a global batch of ``batch_size`` that data-parallel process ``index`` of ``count`` trains on
    (contiguous, equal shares; one-line error when ``batch_size`` is not a multiple of ``count``)."""
    check(_is_int(count) and count >= 1 and _is_int(index) and 0 <= index < count,
          f"row shard {index!r} of {count!r} is invalid: expected 0 <= index < count")
    check(batch_size % count == 0,
          f"batch_size={batch_size} is invalid for {count} processes: expected a multiple of {count}")
    share = batch_size // count
    return range(index * share, (index + 1) * share)


def training_batch(
    batch_size: int, length: int, seed: int, families: Sequence[str] = FAMILIES, weights=None,
    dense: bool | float = True, styles: Sequence[str] | None = None, regimes: Sequence[str] | None = None,
    rows: range | None = None, multivalue_share: float = MULTIVALUE_PROBE_SHARE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)``, both ``LongTensor [batch_size, length]``: one whole example per row.

    ``dense=True`` (default) draws the training format with in-context question/answer pairs; a number in
    [0, 1] is the share of such rows (the others are in the evaluation format). Different ``seed`` values give
    disjoint train examples; no eval example is ever drawn. ``styles`` / ``regimes`` narrow the haystack and
    ``multivalue_share`` sets the share of multi-needle niah probes (:func:`batch_examples`).
    """
    examples = batch_examples(batch_size, length, seed, families, weights, dense, styles, regimes, rows,
                              multivalue_share=multivalue_share)
    input_ids = torch.tensor([e.input_ids for e in examples], dtype=torch.long)
    labels = torch.tensor([example_labels(e) for e in examples], dtype=torch.long)
    return input_ids, labels


def _check_pack(examples, seq_len) -> list[Example]:
    check(_is_int(seq_len) and seq_len >= 1, f"seq_len={seq_len!r} is invalid: expected an integer >= 1")
    examples = list(examples)
    for i, e in enumerate(examples):
        check(isinstance(e, Example), f"examples[{i}] of type {type(e).__name__} is invalid: expected an Example")
        check(e.length <= seq_len, f"examples[{i}] has length {e.length}, which is invalid: expected <= seq_len={seq_len}")
    return examples


def _row(examples: list[Example], seq_len: int, indices: list[int]) -> dict[str, torch.Tensor]:
    ids: list[int] = []
    labels: list[int] = []
    pos: list[int] = []
    doc: list[int] = []
    for d, e in enumerate(examples):
        ids += e.input_ids
        labels += example_labels(e)
        pos += range(e.length)
        doc += [d] * e.length
    pad = seq_len - len(ids)
    ids += [PAD_ID] * pad
    labels += [IGNORE_INDEX] * pad
    pos += range(pad)
    doc += [-1] * pad
    as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return {
        "input_ids": as_long(ids),
        "labels": as_long(labels),
        "position_ids": as_long(pos),
        "document_ids": as_long(doc),
        "example_indices": as_long(indices),
    }


def pack_examples(examples: Sequence[Example], seq_len: int) -> dict[str, torch.Tensor]:
    """Pack whole examples into one row of ``seq_len`` tokens, greedily: in order, each example that still
    fits is appended (the rest are skipped); the tail is padding.

    Returns ``input_ids``, ``labels``, ``position_ids`` (0 at each document start; the padding counts from 0
    as one more pseudo-document), ``document_ids`` (0, 1, ... per packed example; -1 on padding), all
    ``LongTensor [seq_len]``, and ``example_indices`` ``[n_packed]`` (which inputs were packed). Padding and
    ``<bos>`` are never supervised, so no loss crosses a document boundary.
    """
    examples = _check_pack(examples, seq_len)
    chosen, used = [], 0
    for i, e in enumerate(examples):
        if used + e.length <= seq_len:
            chosen.append(i)
            used += e.length
    return _row([examples[i] for i in chosen], seq_len, chosen)


def pack_rows(examples: Sequence[Example], seq_len: int) -> list[dict[str, torch.Tensor]]:
    """First-fit packing of every example into as many rows as needed (each row as :func:`pack_examples`).

    Each example goes to the first row with room for it; a new row opens when none has.
    """
    examples = _check_pack(examples, seq_len)
    rows: list[list[int]] = []
    free: list[int] = []
    for i, e in enumerate(examples):
        for r, room in enumerate(free):
            if e.length <= room:
                rows[r].append(i)
                free[r] -= e.length
                break
        else:
            rows.append([i])
            free.append(seq_len - e.length)
    return [_row([examples[i] for i in row], seq_len, row) for row in rows]


class TestbedStream(IterableDataset):
    """An endless stream of training batches ``(input_ids, labels)``, each ``LongTensor [batch_size, length]``.

    Use it with ``DataLoader(stream, batch_size=None, num_workers=n)``. Batch numbers are dealt round robin
    over ``world_size`` ranks times ``n`` workers (stream ``rank * n + worker`` takes batches
    ``start_batch + stream + k * world_size * n``), so workers and ranks never draw the same train example,
    and with ``DataLoader``'s in-order delivery a rank sees batches in increasing order. Batch ``b`` is
    :func:`training_batch` with seed ``(seed << 40) | b``: streams with different ``seed`` are disjoint too
    (give each curriculum stage its own ``seed``, or resume with ``start_batch``). ``rows`` (a range from
    :func:`shard_rows`) keeps only those rows of every batch: data-parallel processes that each take one share of
    the same batches (``world_size=1`` then) together see exactly the batches one process would.
    ``multivalue_share``: the share of multi-needle niah probes in dense rows (:func:`batch_examples`).
    """

    __test__ = False  # not a pytest class

    def __init__(
        self,
        length: int,
        batch_size: int,
        seed: int = 0,
        families: Sequence[str] = FAMILIES,
        weights=None,
        rank: int = 0,
        world_size: int = 1,
        dense: bool | float = True,
        start_batch: int = 0,
        styles: Sequence[str] | None = None,
        regimes: Sequence[str] | None = None,
        rows: range | None = None,
        multivalue_share: float = MULTIVALUE_PROBE_SHARE,
    ) -> None:
        super().__init__()
        check(_is_int(world_size) and world_size >= 1, f"world_size={world_size!r} is invalid: expected an integer >= 1")
        check(_is_int(rank) and 0 <= rank < world_size, f"rank={rank!r} is invalid: expected an integer in [0, {world_size - 1}]")
        check(_is_int(seed) and seed >= 0, f"seed={seed!r} is invalid: expected an integer >= 0")
        check(_is_int(start_batch) and start_batch >= 0, f"start_batch={start_batch!r} is invalid: expected an integer >= 0")
        check(_is_int(batch_size) and 1 <= batch_size <= MAX_BATCH, f"batch_size={batch_size!r} is invalid: expected an integer in [1, {MAX_BATCH}]")
        self.families, self.weights = check_mixture(families, weights)
        dense_share(dense)
        self.styles = check_haystack_subset(styles, TRAIN_STYLES, "styles")
        self.regimes = check_haystack_subset(regimes, TRAIN_REGIMES, "regimes")
        self.rows = None if rows is None else _check_rows(rows, batch_size)
        self.multivalue_share = check_multivalue_share(multivalue_share)
        generate(self.families[0], 0, length)  # validates length early, in the main process
        self.length, self.batch_size, self.seed = length, batch_size, seed
        self.rank, self.world_size, self.dense, self.start_batch = rank, world_size, dense, start_batch

    def batch_numbers(self, worker_id: int = 0, num_workers: int = 1):
        """The (endless) batch numbers drawn by ``worker_id`` of ``num_workers`` on this rank."""
        n_streams = self.world_size * num_workers
        b = self.start_batch + self.rank * num_workers + worker_id
        while True:
            yield b
            b += n_streams

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        for b in self.batch_numbers(wid, nw):
            yield training_batch(
                self.batch_size, self.length, (self.seed << 40) | b, self.families, self.weights, self.dense,
                self.styles, self.regimes, self.rows, multivalue_share=self.multivalue_share,
            )


def measure_throughput(length: int = 4096, batch_size: int = 16, n_batches: int = 8, seed: int = 0) -> dict:
    """Single-process generation speed of :func:`training_batch` (all families, dense): tokens per second."""
    training_batch(1, length, seed + 10**6)  # warm-up
    start = time.perf_counter()
    for b in range(n_batches):
        training_batch(batch_size, length, seed + b)
    seconds = time.perf_counter() - start
    tokens = n_batches * batch_size * length
    return {
        "length": length,
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds),
        "ms_per_example": round(1000 * seconds / (n_batches * batch_size), 3),
    }
