"""Prefill a long prompt into a compact cache without holding more than the budget plus one chunk.

``DEFAULT_PREFILL_CHUNK = 256``: a multi-token forward returns ``capacity + chunk`` keys per layer, so the peak is
the budget plus one chunk (:meth:`kvlearn.cache.CompactCache.peak_bytes`). 256 keeps that extra at a quarter of a
1024-token budget while the forwards stay large enough to keep a GPU busy (4096 tokens = 16 forwards); a multiple
of 128 also matches the query blocks of :mod:`kvlearn.cache.observe` and common kernel tiles.
"""

from __future__ import annotations

import torch

from ..errors import check, check_int
from .layer import CompactCache

DEFAULT_PREFILL_CHUNK = 256


def prefill(model, cache: CompactCache, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
            chunk_size: int = DEFAULT_PREFILL_CHUNK, dense: bool = False) -> torch.Tensor:
    """Run ``input_ids [batch, n]`` through ``model`` into ``cache``; return the last column's logits ``[batch, vocab]``.

    ``bounded`` (``dense=False``): forwards of ``chunk_size`` tokens; the cache never holds more than its budget
    (rule-based policies keep the exact per-query visibility inside each chunk; attention-driven ones compress after
    each chunk). ``dense=True`` (the ``context`` protocol): one forward over the whole input, every query sees every
    earlier token, and the policy compresses once at the end. ``attention_mask [batch, n]`` may hold padding anywhere:
    RoPE positions and cache positions count real tokens only. The model must be :func:`kvlearn.attach` ed, and the
    cache may already hold earlier tokens (the mask then covers only ``input_ids``).
    """
    check_int("chunk_size", chunk_size, 1)
    check(input_ids.dim() == 2, f"input_ids of shape {tuple(input_ids.shape)} is invalid: expected [batch, tokens]")
    b, n = input_ids.shape
    if attention_mask is None:
        attention_mask = torch.ones(b, n, dtype=torch.long, device=input_ids.device)
    check(tuple(attention_mask.shape) == (b, n),
          f"attention_mask of shape {tuple(attention_mask.shape)} is invalid: expected {(b, n)} like input_ids")
    seen = cache.get_seq_length()
    real_before = cache._real_seen if cache._real_seen is not None else torch.zeros(b, dtype=torch.long,
                                                                                    device=input_ids.device)
    positions = (real_before[:, None].to(input_ids.device) + attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
    past = torch.ones(b, seen, dtype=attention_mask.dtype, device=attention_mask.device)
    full_mask = torch.cat([past, attention_mask], dim=1)
    step = n if dense else chunk_size
    logits = None
    with torch.no_grad():
        for a in range(0, n, step):
            z = min(n, a + step)
            kwargs = dict(input_ids=input_ids[:, a:z], attention_mask=full_mask[:, : seen + z],
                          position_ids=positions[:, a:z], past_key_values=cache, use_cache=True, logits_to_keep=1)
            if dense:
                with cache.dense():
                    out = model(**kwargs)
            else:
                out = model(**kwargs)
            logits = out.logits[:, -1]
    return logits
