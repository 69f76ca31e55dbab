"""Optional Triton: the module objects when installed, and whether kernels run in Triton's CPU interpreter.

Every Triton kernel of kvlearn has a torch or FlexAttention counterpart, so a machine without triton still runs
everything; kernels are defined under ``if HAS_TRITON:``.
"""

from __future__ import annotations

import os

import torch

from kvlearn.errors import check, check_int, is_int

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


LOG2E = 1.4426950408889634  # the kernels run their softmax / log-sum-exp in base 2 (exp2, log2)

if HAS_TRITON:

    @triton.jit
    def online_lse_step(m_i, l_i, s):
        """One tile of an online log-sum-exp in base 2: ``s [rows, cols]`` (``-inf`` = masked) into the running max
        ``m_i [rows]`` and sum ``l_i [rows]``. Returns ``(m_new, l_new, alpha, p)``: ``alpha`` rescales anything
        accumulated against the old max, ``p = exp2(s - m_new)``. ``m_i`` must start finite (-1e30): a row with
        nothing unmasked yet then keeps ``alpha = 1, p = 0`` (no NaN)."""
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        return m_new, l_i * alpha + tl.sum(p, 1), alpha, p

    @triton.jit
    def finish_lse(m_i, l_i):
        """Natural-log LSE from the running base-2 max and sum; ``-inf`` for rows that saw nothing."""
        seen = l_i > 0.0
        return tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))


def is_pow2(n) -> bool:
    """True for a Python int that is a power of two (>= 1); False for anything else, bools included."""
    return is_int(n) and n >= 1 and (n & (n - 1)) == 0


# What the attention-type kernels (fused sparse forward, transposed target pass) take.
KERNEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP32_PRECISIONS = ("ieee", "tf32")


def kernel_supports(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the attention-type kernels take this dtype and head_dim (bf16 / fp16 / fp32, a power of two in
    [16, 256]); the ``"auto"`` backends fall back to FlexAttention otherwise."""
    return dtype in KERNEL_DTYPES and is_pow2(head_dim) and 16 <= head_dim <= 256


def check_kernel_inputs(dtype: torch.dtype, head_dim: int) -> None:
    """One-line errors for a dtype or head_dim :func:`kernel_supports` refuses."""
    check(dtype in KERNEL_DTYPES, f"dtype {dtype} is invalid for the Triton kernel: expected one of bfloat16, "
                                  "float16, float32")
    check(is_pow2(head_dim) and 16 <= head_dim <= 256,
          f"head_dim={head_dim} is invalid for the Triton kernel: expected a power of two in [16, 256]")


def check_launch(num_warps, num_stages, fp32_precision: str = "ieee", **blocks) -> None:
    """One-line errors for a launch: each ``blocks`` value (tile sizes) a power of two >= 16, ``num_warps`` a power
    of two <= 32, ``num_stages`` >= 1, ``fp32_precision`` in :data:`FP32_PRECISIONS`."""
    for name, value in blocks.items():
        check(is_pow2(value) and value >= 16, f"{name}={value!r} is invalid: expected a power of two >= 16")
    check(is_pow2(num_warps) and num_warps <= 32, f"num_warps={num_warps!r} is invalid: expected a power of two <= 32")
    check_int("num_stages", num_stages, 1)
    check(fp32_precision in FP32_PRECISIONS,
          f"fp32_precision={fp32_precision!r} is invalid: expected one of {FP32_PRECISIONS}")


def check_triton_options(options: dict | None, keys: tuple[str, ...]) -> dict:
    """``kernel_options`` for a kvlearn Triton kernel: None -> ``{}``; a dict whose keys are among ``keys`` (the
    kernel's keyword tunables, whose values the kernel validates) -> a copy; anything else -> a one-line error."""
    if options is None:
        return {}
    check(isinstance(options, dict), f"kernel_options of type {type(options).__name__} is invalid: expected a dict")
    bad = sorted(set(options) - set(keys))
    check(not bad, f"kernel_options key(s) {bad} are invalid for backend='triton': expected a subset of {keys}")
    return dict(options)


__all__ = ["FP32_PRECISIONS", "HAS_TRITON", "KERNEL_DTYPES", "LOG2E", "check_kernel_inputs", "check_launch",
           "kernel_supports", "check_triton_options", "dot_fp32", "finish_lse", "is_pow2", "online_lse_step", "interpreting", "tl", "triton"]
