"""FlexAttention plumbing shared by every kvlearn kernel call (sparse attention, causal LSE, transposed target).

- :func:`flex_fn`: one ``torch.compile(flex_attention, dynamic=False)`` per process on CUDA (the fused kernel);
  plain eager ``flex_attention`` elsewhere (CPU flex runs eager only: it materialises the scores, small sizes).
  Calls run in :func:`compile_scope`, which allows enough specialisations for every kvlearn kernel.
- :func:`flex_attention_lse`: one call returning ``(out, lse)`` with the log-sum-exp requested the way the
  installed torch wants it (``return_aux=AuxRequest(lse=True)`` from torch 2.9, the deprecated
  ``return_lse=True`` before). The LSE is a natural log in torch 2.11 and 2.13 (the kernels work in base 2
  and FlexAttention rescales by ``ln 2`` before returning); rows with no unmasked key give ``-inf``.
- Pass distinct key and value tensors: eager (CPU) flex runs under dynamo, and torch 2.13 crashes while
  explaining a recompile when one tensor is both key and value after calls where it was not (a guard bug).
"""

from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import flex_attention

from kvlearn.errors import check

try:  # torch >= 2.9 (2.11 and 2.13 have it)
    from torch.nn.attention.flex_attention import AuxRequest
except ImportError:  # pragma: no cover - older torch
    AuxRequest = None

try:
    from torch.nn.attention.flex_attention import FlexKernelOptions

    KERNEL_OPTION_KEYS = tuple(FlexKernelOptions.__annotations__)
except ImportError:  # pragma: no cover - older torch
    KERNEL_OPTION_KEYS = ("num_warps", "num_stages", "BLOCK_M", "BLOCK_N")

_compiled: Callable | None = None

# Every kvlearn kernel is its own specialisation of the one compiled flex_attention: the sparse attention on two
# layouts, the causal LSE, the transposed target with and without a lookahead, with and without autograd, one
# per sequence length. Dynamo's default of 8 per code object is too small: past it calls silently run EAGER flex
# (results/raw/kvpop_ops_h200_b80db6a.json: attn_sparse_fwd_k1792 63 ms against 4.6 ms compiled at k=2016).
RECOMPILE_LIMIT = 64


def compile_scope():
    """Context in which dynamo allows :data:`RECOMPILE_LIMIT` specialisations per code object (never lowers it)."""
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    return cfg.patch(**{name: max(getattr(cfg, name), RECOMPILE_LIMIT)})


def flex_fn(device: torch.device) -> Callable:
    """``flex_attention`` compiled once per process on CUDA, eager elsewhere."""
    global _compiled
    if device.type != "cuda":
        return flex_attention
    if _compiled is None:
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def autocast_qkv(query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``query``, ``key``, ``value`` in one compute dtype: the autocast dtype when autocast is on for their device
    (what SDPA does under autocast), else the query's. Under bf16 autocast a Qwen3 layer hands over float32 queries
    and keys (its q/k RMSNorms return float32) with bf16 values; the kvlearn kernels need one dtype."""
    dtype = query.dtype
    if torch.is_autocast_enabled(query.device.type):
        dtype = torch.get_autocast_dtype(query.device.type)
    return query.to(dtype), key.to(dtype), value.to(dtype)


def check_qkv(query, key, value) -> tuple[int, int, int, int, int]:
    """One-line errors unless ``query [B, Hq, T, D]`` and ``key, value [B, Hkv, T, D]`` are GQA attention inputs of
    one dtype and device (``Hkv`` divides ``Hq``). Returns ``(B, Hq, Hkv, T, D)``."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        check(isinstance(x, Tensor), f"{name} of type {type(x).__name__} is invalid: expected a torch.Tensor")
        check(x.dim() == 4, f"{name} with shape {tuple(x.shape)} is invalid: expected 4 dims [batch, heads, seq, head_dim]")
    check(key.shape == value.shape, f"value shape {tuple(value.shape)} is invalid: expected the key shape {tuple(key.shape)}")
    B, Hq, T, D = query.shape
    Bk, Hkv, Tk, Dk = key.shape
    check((Bk, Tk, Dk) == (B, T, D),
          f"key shape {tuple(key.shape)} is invalid: expected [batch={B}, kv_heads, seq={T}, head_dim={D}] as query")
    check(Hkv >= 1 and Hq % Hkv == 0, f"kv_heads={Hkv} is invalid: expected a divisor of the query heads {Hq} (GQA)")
    check(key.dtype == query.dtype and value.dtype == query.dtype,
          f"key/value dtypes {key.dtype}/{value.dtype} are invalid: expected the query dtype {query.dtype}")
    check(key.device == query.device and value.device == query.device,
          f"key/value devices {key.device}/{value.device} are invalid: expected the query device {query.device}")
    return B, Hq, Hkv, T, D


def check_kernel_options(kernel_options) -> dict | None:
    """``None`` or a dict of FlexAttention kernel options (``num_warps``, ``num_stages``, ``BLOCK_M``, ``BLOCK_N``,
    ...: the keys of ``torch.nn.attention.flex_attention.FlexKernelOptions``); a one-line error otherwise."""
    if kernel_options is None:
        return None
    valid = KERNEL_OPTION_KEYS
    check(isinstance(kernel_options, dict),
          f"kernel_options of type {type(kernel_options).__name__} is invalid: expected None or a dict with keys from {valid}")
    bad = [k for k in kernel_options if k not in valid]
    check(not bad, f"kernel_options keys {bad} are invalid: expected keys from {valid}")
    return dict(kernel_options)


def flex_attention_lse(query: Tensor, key: Tensor, value: Tensor, *, score_mod=None, block_mask=None, scale=None,
                       enable_gqa: bool = False, return_lse: bool = True,
                       kernel_options: dict | None = None) -> tuple[Tensor, Tensor | None]:
    """FlexAttention ``out [B, Hq, L, Dv]`` and, when asked, ``lse [B, Hq, L]`` float32 (natural log).

    ``kernel_options``: optional tile sizes / warps / stages for the compiled kernel (:func:`check_kernel_options`);
    each distinct dict is a separate compilation. Eager (CPU) flex accepts and ignores them."""
    fn = flex_fn(query.device)
    kwargs = dict(score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
    kernel_options = check_kernel_options(kernel_options)
    if kernel_options:
        kwargs["kernel_options"] = kernel_options
    with warnings.catch_warnings(), compile_scope():
        # eager (CPU) flex warns that it is unfused; that is expected off-GPU
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        warnings.filterwarnings("ignore", message=".*return_lse is deprecated.*")
        if not return_lse:
            return fn(query, key, value, **kwargs), None
        if AuxRequest is not None:
            out, aux = fn(query, key, value, return_aux=AuxRequest(lse=True), **kwargs)
            lse = aux.lse
        else:  # pragma: no cover - older torch
            out, lse = fn(query, key, value, return_lse=True, **kwargs)
    return out, lse.float()
