"""Optional Triton: the module objects when installed, and whether kernels run in Triton's CPU interpreter.

Every Triton kernel of kvlearn has a torch or FlexAttention counterpart, so a machine without triton still runs
everything; kernels are defined under ``if HAS_TRITON:``.
"""

from __future__ import annotations

import os

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised only where triton is missing
    triton = None
    tl = None
    HAS_TRITON = False


def interpreting() -> bool:
    """True when triton runs kernels on the CPU through its interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


__all__ = ["HAS_TRITON", "interpreting", "tl", "triton"]
