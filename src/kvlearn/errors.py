"""Errors that kvlearn raises for bad input: one line, naming the bad value and the valid range.

:func:`check` raises with a message; :func:`check_int` is the one integer/range checker every module uses.
"""

from __future__ import annotations

import math


class KVLearnError(ValueError):
    """A user-facing error: bad configuration, bad tensor shapes, unknown names or missing files.

    The message is one line that names the offending value and what would be valid. The CLI prints it
    without a traceback.
    """


def check(condition: bool, message: str) -> None:
    """Raise :class:`KVLearnError` with ``message`` unless ``condition`` holds."""
    if not condition:
        raise KVLearnError(message)


def is_int(value) -> bool:
    """Whether ``value`` is a Python integer (``bool`` excluded)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value, low: int, high: float = math.inf, hint: str = "") -> int:
    """Raise a one-line :class:`KVLearnError` unless ``value`` is an integer in ``[low, high]``; return it.

    ``hint`` is appended to the message (for example why the bound is what it is).
    """
    bound = f">= {low}" if high == math.inf else f"in [{low}, {int(high)}]"
    check(is_int(value) and low <= value <= high, f"{name}={value!r} is invalid: expected an integer {bound}{hint}")
    return value


def check_positive(name: str, value) -> float:
    """``value`` as a float when it is a finite number > 0, else a one-line error naming ``name``."""
    check(isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0,
          f"{name}={value!r} is invalid: expected a finite number > 0")
    return float(value)


def check_non_negative(name: str, value, allow_inf: bool = False) -> float:
    """``value`` as a float when it is a number >= 0 (finite unless ``allow_inf``), else a one-line error."""
    ok = (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0
          and (math.isfinite(value) or (allow_inf and value == math.inf)))
    check(ok, f"{name}={value!r} is invalid: expected a {'' if allow_inf else 'finite '}number >= 0")
    return float(value)

