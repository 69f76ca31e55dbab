"""The two evaluation protocols: how a batch of testbed prompts goes through a cache before decoding.

- ``bounded`` (the default, KVpop's setting): the whole prompt is prefilled through the bounded cache in chunks,
  so the cache never holds more than its budget plus one chunk; the final question, at the end of the prompt,
  cannot rescue tokens that were already evicted.
- ``context`` (kvpress's setting): everything before the final question (the *context*) is prefilled with full
  attention and compressed once to the budget; then the question and the answer run through the bounded cache.
  The question is never seen at compression time.

Batch layout (left padding, each row's real tokens are what the row alone would hold):

- ``bounded``: ``[pad… prompt]``, ``ids, mask: [batch, W]``.
- ``context``: ``[pad… context][pad… question]``, ``ids, mask: [batch, Wc + Wq]``; column ``Wc`` is the first
  question column of every row. Positions (RoPE and the caches') count real tokens only, so padding in the middle
  of a row changes nothing for that row.

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

try:  # cache contract v2 (engineer A): kvlearn.cache.prefill and its default chunk
    from ..cache import DEFAULT_PREFILL_CHUNK, prefill as _cache_prefill
except ImportError:  # SHIM until contract v2 lands: the local prefill below
    DEFAULT_PREFILL_CHUNK = 512
    _cache_prefill = None

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


def layout(examples: list[Example], protocol: str, pad_id: int) -> Batch:
    """The padded batch of ``examples`` for ``protocol`` (see the module docstring)."""
    check(protocol in PROTOCOLS, f"protocol={protocol!r} is unknown: expected one of {', '.join(PROTOCOLS)}")
    if protocol == "bounded":
        ids, mask = _left_pad([ex.prompt_ids for ex in examples], pad_id)
        return Batch(ids, mask, None)
    cuts = [question_start(ex) for ex in examples]
    ci, cm = _left_pad([ex.prompt_ids[:c] for ex, c in zip(examples, cuts)], pad_id)
    qi, qm = _left_pad([ex.prompt_ids[c:] for ex, c in zip(examples, cuts)], pad_id)
    return Batch(torch.cat([ci, qi], 1), torch.cat([cm, qm], 1), ci.shape[1])


def _positions(mask: torch.Tensor) -> torch.Tensor:
    """RoPE positions ``[batch, W]`` counting real tokens (what ``generate`` computes from the mask)."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


def _forward(model, cache, ids, mask, pos, a: int, b: int) -> None:
    model(input_ids=ids[:, a:b], attention_mask=mask[:, :b], position_ids=pos[:, a:b], past_key_values=cache,
          use_cache=True, logits_to_keep=1)


def _local_prefill(model, cache, ids, mask, start: int, stop: int, chunk_size: int, dense: bool) -> None:
    """SHIM until ``kvlearn.cache.prefill`` (contract v2) lands, and the dense path for ``DynamicCache``.

    Columns ``[start, stop)`` of ``ids, mask: [batch, W]`` go through ``cache`` (columns before ``start`` are in it).
    ``dense=False``: forwards of ``chunk_size`` columns. ``dense=True`` on a compact cache: one forward with full
    causal attention into a scratch ``DynamicCache``, then every layer's keys/values ``[batch, kv_heads, n, head_dim]``
    go through the compact cache's ``update`` once, which compresses them to the budget (valid for policies that do
    not need attention weights, as streaming).
    """
    pos = _positions(mask)
    if not dense or isinstance(cache, DynamicCache):
        for a in range(start, stop, chunk_size):
            _forward(model, cache, ids, mask, pos, a, min(stop, a + chunk_size))
        return
    check(start == 0 and cache.get_seq_length() == 0, "a dense prefill must start on an empty cache")
    scratch = DynamicCache(config=model.config)
    _forward(model, scratch, ids, mask, pos, 0, stop)
    cache.begin_forward(mask[:, :stop], ids.shape[0], stop, ids.device)
    for i, layer in enumerate(scratch.layers):
        cache.update(layer.keys, layer.values, i)
    del scratch


def prefill_columns(model, cache, batch: Batch, start: int, stop: int, chunk_size: int, dense: bool) -> None:
    """Run columns ``[start, stop)`` of ``batch`` through ``cache``; ``dense=True`` compresses once at the end."""
    if stop <= start:
        return
    if _cache_prefill is not None and not isinstance(cache, DynamicCache):
        _cache_prefill(model, cache, batch.ids[:, start:stop], batch.mask[:, start:stop], chunk_size=chunk_size,
                       dense=dense)
    else:
        _local_prefill(model, cache, batch.ids, batch.mask, start, stop, chunk_size, dense)


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
