"""Optional Triton: the module objects when installed, and whether kernels run in Triton's CPU interpreter.

Every Triton kernel of kvlearn has a torch or FlexAttention counterpart, so a machine without triton still runs
everything; kernels are defined under ``if HAS_TRITON:``.
"""

from __future__ import annotations

import os

from kvlearn.errors import check

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


if HAS_TRITON:

    @triton.jit
    def dot_fp32(a, b, acc, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
        """``acc + a @ b`` in fp32 (``acc`` None: ``a @ b``), for the kvlearn kernels.

        ``DOT_UPCAST``: the interpreter's bfloat16 ``tl.dot`` multiplies the raw uint16 storage (triton 3.6), so
        under the interpreter bf16 operands go through fp32 (exact: a bf16 x bf16 product fits in fp32)."""
        if DOT_UPCAST:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            return tl.dot(a, b, acc, input_precision=DOT_PRECISION)


def is_pow2(n) -> bool:
    """True for a Python int that is a power of two (>= 1); False for anything else, bools included."""
    return isinstance(n, int) and not isinstance(n, bool) and n >= 1 and (n & (n - 1)) == 0


def check_triton_options(options: dict | None, keys: tuple[str, ...]) -> dict:
    """``kernel_options`` for a kvlearn Triton kernel: None -> ``{}``; a dict whose keys are among ``keys`` (the
    kernel's keyword tunables, whose values the kernel validates) -> a copy; anything else -> a one-line error."""
    if options is None:
        return {}
    check(isinstance(options, dict), f"kernel_options of type {type(options).__name__} is invalid: expected a dict")
    bad = sorted(set(options) - set(keys))
    check(not bad, f"kernel_options key(s) {bad} are invalid for backend='triton': expected a subset of {keys}")
    return dict(options)


__all__ = ["HAS_TRITON", "check_triton_options", "dot_fp32", "is_pow2", "interpreting", "tl", "triton"]
