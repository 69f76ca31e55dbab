"""The two evaluation protocols: how a batch of testbed prompts goes through a cache before decoding.

- ``bounded`` (the default, KVpop's setting): the whole prompt is prefilled through the bounded cache in chunks,
  so the cache never holds more than its budget plus one chunk; the final question, at the end of the prompt,
  cannot rescue tokens that were already evicted.
- ``context`` (kvpress's setting): everything before the final question (the *context*) is prefilled with full
  attention and compressed once to the budget; then the question and the answer run through the bounded cache.
  The question is never seen at compression time.

Batch layout (each row's real tokens are what the row alone would hold; positions, RoPE's and the caches', count
real tokens only, so padding anywhere in a row changes nothing for that row):

- ``bounded``: the prompt but its last token in *chunk-aligned* blocks, then the last token:
  ``[pad chunks…][chunk 1]…[chunk n-1][pad… chunk n][last]``, ``ids, mask: [batch, N * chunk + 1]``. Every
  prefill forward (``chunk`` columns) then holds the same real tokens of each row as the row's own run does, so
  policies that evict after each chunk (TOVA, H2O) decide exactly as they would for the row alone.
- ``context``: ``[pad… context][question in the same chunk-aligned form]``, ``ids, mask: [batch, Wc + Wq]``; column
  ``Wc`` is the first question column of every row (the context is one forward, so plain left padding suffices).

Then every prompt column but the last is prefilled, and ``model.generate(ids, mask, past_key_values=cache)``
processes the last prompt column (transformers slices ``input_ids`` to the columns the cache has not seen,
``cache.get_seq_length()``) and decodes greedily.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..errors import check
from ..methods import PROTOCOLS
from ..testbed.tasks import Example
from ..testbed.tokenizer import WORD_TO_ID

from ..cache import DEFAULT_PREFILL_CHUNK
from ..cache import prefill as cache_prefill

_QUESTION_STARTS = (WORD_TO_ID["question"], WORD_TO_ID["program"])


def question_start(example: Example) -> int:
    """Index in ``example.prompt_ids`` of the first token of the final question.

    The generators append the final question last (``tasks._assemble``'s ``tail``, which is always the last needed
    span): it starts at the last ``question`` token for niah / vt / recall and at the last ``program`` token for
    trace (the program and its question).
    """
    start = example.needed_spans[-1][0]
    check(0 < start < len(example.prompt_ids) and example.prompt_ids[start] in _QUESTION_STARTS,
          f"example {example.family}/{example.seed}: its last needed span does not start a final question")
    return start


@dataclass
class Batch:
    """A padded batch: ``ids, mask: [batch, W]`` (int64), ``split``: the first question column (``context``
    protocol) or ``None`` (``bounded``)."""

    ids: torch.Tensor
    mask: torch.Tensor
    split: int | None


def _left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids, mask


def _chunk_aligned(seqs: list[list[int]], chunk: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of ``seqs`` (each non-empty) as ``[pad chunks…][chunk 1]…[pad… last partial chunk][last token]``: all
    but the last token in blocks of ``chunk`` columns that start at the row's own chunk boundaries, the last token
    in the final column. ``ids, mask: [batch, N * chunk + 1]``, ``N`` the most chunks of any row."""
    n_chunks = [-(-(len(s) - 1) // chunk) for s in seqs]
    width = max(n_chunks) * chunk + 1
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, (s, n) in enumerate(zip(seqs, n_chunks)):
        body = s[:-1]
        start = width - 1 - n * chunk  # the row's first chunk
        full = (n - 1) * chunk if n else 0
        cols = list(range(start, start + full)) + list(range(width - 1 - (len(body) - full), width - 1)) + [width - 1]
        ids[i, cols] = torch.tensor(s, dtype=torch.long)
        mask[i, cols] = 1
    return ids, mask


def layout(examples: list[Example], protocol: str, pad_id: int, chunk_size: int = DEFAULT_PREFILL_CHUNK) -> Batch:
    """The padded batch of ``examples`` for ``protocol`` whose prefill runs in forwards of ``chunk_size`` columns
    (see the module docstring)."""
    check(protocol in PROTOCOLS, f"protocol={protocol!r} is unknown: expected one of {', '.join(PROTOCOLS)}")
    if protocol == "bounded":
        ids, mask = _chunk_aligned([ex.prompt_ids for ex in examples], chunk_size, pad_id)
        return Batch(ids, mask, None)
    cuts = [question_start(ex) for ex in examples]
    ci, cm = _left_pad([ex.prompt_ids[:c] for ex, c in zip(examples, cuts)], pad_id)
    qi, qm = _chunk_aligned([ex.prompt_ids[c:] for ex, c in zip(examples, cuts)], chunk_size, pad_id)
    return Batch(torch.cat([ci, qi], 1), torch.cat([cm, qm], 1), ci.shape[1])


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """RoPE positions ``[batch, W]`` counting real tokens (what ``generate`` computes from the mask)."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


def _forward(model, cache, ids, mask, pos, a: int, b: int) -> None:
    model(input_ids=ids[:, a:b], attention_mask=mask[:, :b], position_ids=pos[:, a:b], past_key_values=cache,
          use_cache=True, logits_to_keep=1)


def _dense_cache_prefill(model, cache: DynamicCache, ids, mask, start: int, stop: int, chunk_size: int) -> None:
    """Columns ``[start, stop)`` of ``ids, mask: [batch, W]`` through a transformers ``DynamicCache`` (the ``dense``
    method keeps everything, so both protocols are the same forwards), in chunks of ``chunk_size``."""
    pos = _positions(mask)
    for a in range(start, stop, chunk_size):
        _forward(model, cache, ids, mask, pos, a, min(stop, a + chunk_size))


def prefill_columns(model, cache, batch: Batch, start: int, stop: int, chunk_size: int, dense: bool) -> None:
    """Run columns ``[start, stop)`` of ``batch`` through ``cache``; ``dense=True`` compresses once at the end."""
    if stop <= start:
        return
    if isinstance(cache, DynamicCache):
        _dense_cache_prefill(model, cache, batch.ids, batch.mask, start, stop, chunk_size)
    else:
        cache_prefill(model, cache, batch.ids[:, start:stop], batch.mask[:, start:stop], chunk_size=chunk_size,
                      dense=dense)


@torch.no_grad()
def run_batch(model, cache, batch: Batch, protocol: str, max_new_tokens: int, chunk_size: int = DEFAULT_PREFILL_CHUNK,
              pad_id: int = 0, eos_id: int | None = None) -> torch.Tensor:
    """Prefill ``batch`` into the empty ``cache`` under ``protocol`` and decode greedily.

    Returns the generated tokens ``[batch, <= max_new_tokens]`` (rows that finished early are padded with
    ``pad_id``, as ``generate`` does).
    """
    check(protocol in PROTOCOLS, f"protocol={protocol!r} is unknown: expected one of {', '.join(PROTOCOLS)}")
    width = batch.ids.shape[1]
    if protocol == "bounded":
        prefill_columns(model, cache, batch, 0, width - 1, chunk_size, dense=False)
    else:
        prefill_columns(model, cache, batch, 0, batch.split, chunk_size, dense=True)
        prefill_columns(model, cache, batch, batch.split, width - 1, chunk_size, dense=False)
    out = model.generate(input_ids=batch.ids, attention_mask=batch.mask, past_key_values=cache,
                         max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id, eos_token_id=eos_id)
    return out[:, width:]
