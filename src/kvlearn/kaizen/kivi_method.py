"""Registry entry ``kivi``: post-hoc KIVI quantization (Liu et al., 2024) of every layer's keys and values, every token
kept, no training (the KV-Kaizen paper's "stronger post-hoc quantizer" baseline, its Table 10).

Every layer is a :class:`~kvlearn.cache.CompactLayer` on :class:`~kvlearn.cache.KIVIStore` (``bits``, key groups of
``group_size`` tokens, value groups of as many channels, a full-precision window of ``residual`` tokens; KIVI's
defaults 32 and 128) under :class:`~kvlearn.cache.KeepAllPolicy`, sized to the prompt like the other KV-Kaizen
methods (the per-prompt contract of :mod:`kvlearn.kaizen.prompt`; every row chooses the same, so a batch is one
group). ``--target F`` picks the nominal ``bits = 16 / F`` (2x: 8 bits, 4x: 4, 8x: 2; any other target is a one-line
error); the row's ``factor`` is the *realised* reduction against the dense cache in the compute dtype, with the
scales, minima and the full-precision window counted (the paper's post-hoc factors include metadata): below the
target, e.g. about 5x at 2 bits and context 4096 in bf16.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..cache import CompactCache, CompactLayer, KeepAllPolicy, KIVIStore
from ..errors import KVLearnError, check, check_int
from ..ops.quant import QUANT_BITS
from .prompt import one_choice, prompt_capacity, prompt_rows


@dataclass(frozen=True)
class KIVIConfig:
    """``target``: the nominal factor, ``16 / bits`` (2, 4 or 8); ``group_size``: G (tokens per key group, channels
    per value group); ``residual``: R, the full-precision window (a multiple of G)."""

    target: float = 4.0
    group_size: int = 32
    residual: int = 128

    def __post_init__(self) -> None:
        ok = isinstance(self.target, (int, float)) and not isinstance(self.target, bool) and math.isfinite(self.target)
        nominal = tuple(16 // b for b in reversed(QUANT_BITS))
        check(ok and self.target in nominal, f"target={self.target!r} is invalid for kivi: expected one of "
                                             f"{', '.join(f'{t}' for t in nominal)} (16 / bits, bits in {QUANT_BITS})")
        check_int("group_size", self.group_size, 1)
        check_int("residual", self.residual, self.group_size)
        check(self.residual % self.group_size == 0,
              f"residual={self.residual} is invalid: expected a multiple of group_size={self.group_size}")

    @property
    def bits(self) -> int:
        return int(round(16 / self.target))


class KIVICache(CompactCache):
    """A keep-all cache of :class:`KIVIStore` layers; :meth:`realised_factor` and ``target`` for the harness."""

    def __init__(self, config: KIVIConfig, num_layers: int, capacity: int):
        super().__init__([CompactLayer(KeepAllPolicy(capacity), KIVIStore(config.bits, config.group_size,
                                                                          config.residual))
                          for _ in range(num_layers)])
        self.target = float(config.target)

    def realised_factor(self) -> float:
        """Dense bytes (every slot's K and V in the compute dtype) over the bytes the KIVI stores allocate."""
        dense = stored = 0
        for layer in self.layers:
            store = layer.store
            if store.dims is None:
                continue
            b, h, n, k_dim, v_dim = store.shape
            dense += b * h * n * (k_dim + v_dim) * store.key_window.element_size()
            stored += store.allocated_bytes()
        check(stored > 0, "the KIVI cache has not been written yet: no factor to report")
        return dense / stored


def apply(model, config: KIVIConfig):
    from ..hf import attach

    return attach(model)


def make_cache(config, model):
    raise KVLearnError("method 'kivi' sizes its cache to the prompt: use make_prompt_cache(config, model, input_ids, "
                       "attention_mask, max_new_tokens)")


def prompt_choices(config: KIVIConfig, model, input_ids, attention_mask) -> list:
    return [config] * len(prompt_rows(input_ids, attention_mask))


def make_choice_cache(config: KIVIConfig, model, choice, capacity: int) -> KIVICache:
    return KIVICache(config, model.config.num_hidden_layers, capacity)


def make_prompt_cache(config: KIVIConfig, model, input_ids, attention_mask, max_new_tokens: int) -> KIVICache:
    capacity = prompt_capacity(input_ids.shape[1], max_new_tokens)  # checked before the choice is computed
    choice = one_choice(prompt_choices(config, model, input_ids, attention_mask))
    return make_choice_cache(config, model, choice, capacity)


def config_from_budget(budget=None, sinks: int = 4, context: int | None = None, target: float | None = None,
                       **extra) -> KIVIConfig:
    check(budget is None, f"method 'kivi' keeps every token: it takes --target (16 / bits), not --budget "
                          f"(got budget={budget!r})")
    return KIVIConfig(**({"target": target} if target is not None else {}), **extra)


CONFIG = KIVIConfig
SUMMARY = ("KIVI post-hoc quantization (keys per channel over G-token groups, values per token, a full-precision "
           "R-token window): --target 2/4/8 = 8/4/2 bits, no training; every token kept")
PROTOCOLS = ("bounded", "context")
TOKEN_BUDGET = False

__all__ = ["CONFIG", "SUMMARY", "PROTOCOLS", "TOKEN_BUDGET", "KIVIConfig", "KIVICache", "apply", "make_cache",
           "make_prompt_cache", "prompt_choices", "make_choice_cache", "config_from_budget"]
