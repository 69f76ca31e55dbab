"""The learning-rate schedule every trainer here uses: linear warm-up, then a cosine to a floor."""

from __future__ import annotations

import math


def warmup_cosine(peak: float, step: int, fraction: float, warmup_steps: int, min_ratio: float) -> float:
    """``peak`` times a linear warm-up over ``warmup_steps`` (step 0 gets ``1 / warmup_steps``; none when 0) times a
    cosine from 1 to ``min_ratio`` over the run, ``fraction`` of which is done (clipped to 1)."""
    warm = min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0
    return peak * warm * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, fraction))))
