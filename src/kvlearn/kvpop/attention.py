"""KVpop sparse attention over the retained keys (sinks, window, running top-k), with its log-normalizer.

The attention itself is FlexAttention with the retention ``BlockMask`` of :mod:`kvlearn.ops.masks` and GQA
(``enable_gqa=True``: query head ``h`` reads KV head ``h // (Hq // Hkv)``). The per-query LSE it returns
(natural log, float32) is the sparse normalizer that the future-attention target reuses (Eq. 9 of the paper).

On CUDA the call goes through one ``torch.compile(flex_attention)`` per process (the fused sparse kernel).
Elsewhere FlexAttention runs eagerly (it materialises the scores: small T only), and eager FlexAttention has
no backward on the CPU: when a gradient is needed there (CPU tests, tiny CPU training runs) the call falls
back to a dense masked softmax with the same mask (:func:`kvlearn.ops.masks.retention_mask_dense`), which
gives the same output, LSE and gradients up to float rounding.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask

from kvlearn.errors import check
from kvlearn.ops.flex import flex_attention_lse
from kvlearn.ops.masks import retention_block_mask, retention_mask_dense

def _check_attention_inputs(query, key, value, ranks, cutoffs) -> None:
    for name, x in (("query", query), ("key", key), ("value", value)):
        check(isinstance(x, torch.Tensor), f"{name} of type {type(x).__name__} is invalid: expected a torch.Tensor")
        check(x.dim() == 4, f"{name} with shape {tuple(x.shape)} is invalid: expected 4 dims [batch, heads, seq, head_dim]")
    check(
        key.shape == value.shape,
        f"value shape {tuple(value.shape)} is invalid: expected the key shape {tuple(key.shape)}",
    )
    B, Hq, T, D = query.shape
    Bk, Hkv, Tk, Dk = key.shape
    check(
        (Bk, Tk, Dk) == (B, T, D),
        f"key shape {tuple(key.shape)} is invalid: expected [batch={B}, kv_heads, seq={T}, head_dim={D}] as query",
    )
    check(
        Hkv >= 1 and Hq % Hkv == 0,
        f"kv_heads={Hkv} is invalid: expected a divisor of the query heads {Hq} (GQA)",
    )
    check(
        key.dtype == query.dtype and value.dtype == query.dtype,
        f"key/value dtypes {key.dtype}/{value.dtype} are invalid: expected the query dtype {query.dtype}",
    )
    check(
        key.device == query.device and value.device == query.device,
        f"key/value devices {key.device}/{value.device} are invalid: expected the query device {query.device}",
    )
    for name, x in (("ranks", ranks), ("cutoffs", cutoffs)):
        check(isinstance(x, torch.Tensor), f"{name} of type {type(x).__name__} is invalid: expected a torch.Tensor")
        check(
            tuple(x.shape) == (B, Hkv, T),
            f"{name} with shape {tuple(x.shape)} is invalid: expected [batch, kv_heads, seq] = {(B, Hkv, T)}",
        )
        check(x.device == query.device, f"{name} on {x.device} is invalid: expected the query device {query.device}")


def sparse_retention_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    ranks: torch.Tensor,
    cutoffs: torch.Tensor,
    sinks: int,
    window: int,
    scale: float | None = None,
    return_lse: bool = True,
    block_mask: BlockMask | None = None,
    block_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention restricted to the KVpop retained keys.

    Args:
        query: ``[batch, q_heads, T, head_dim]``.
        key, value: ``[batch, kv_heads, T, head_dim]``; ``q_heads`` is a multiple of ``kv_heads``.
        ranks, cutoffs: int32 ``[batch, kv_heads, T]`` (see :mod:`kvlearn.ops.fenwick`).
        sinks: >= 0. window: >= 1.
        scale: logit scale, default ``1 / sqrt(head_dim)``.
        return_lse: also return the log-sum-exp of the masked, scaled logits.
        block_mask: a prebuilt :func:`kvlearn.ops.masks.retention_block_mask` for these inputs (built here
            when None).
        block_size: block size used when the block mask is built here.

    Returns:
        ``(out [batch, q_heads, T, head_dim] in the query dtype, lse [batch, q_heads, T] float32 natural-log
        or None when return_lse is False)``.
    """
    _check_attention_inputs(query, key, value, ranks, cutoffs)
    group = query.shape[1] // key.shape[1]
    if scale is None:
        scale = query.shape[-1] ** -0.5
    needs_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    if query.device.type == "cpu":
        if needs_grad:  # eager FlexAttention has no backward on the CPU
            return _dense_attention(query, key, value, ranks, cutoffs, sinks, window, scale, return_lse)
        # eager flex refuses inputs that require grad even under no_grad
        query, key, value = query.detach(), key.detach(), value.detach()
    if block_mask is None:
        block_mask = retention_block_mask(ranks, cutoffs, sinks, window, group, block_size=block_size)
    else:
        check(isinstance(block_mask, BlockMask), f"block_mask of type {type(block_mask).__name__} is invalid: expected a BlockMask")
    out, lse = flex_attention_lse(query, key, value, block_mask=block_mask, scale=scale, enable_gqa=True,
                                  return_lse=return_lse)
    if lse is not None:
        lse = lse.float()
    return out, lse


def _dense_attention(query, key, value, ranks, cutoffs, sinks, window, scale, return_lse):
    """Dense masked softmax twin of the flex call (CPU autograd). Same shapes and dtypes as the flex path."""
    group = query.shape[1] // key.shape[1]
    mask = retention_mask_dense(ranks, cutoffs, sinks, window).repeat_interleave(group, dim=1)  # [B, Hq, T, T]
    compute = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    k = key.to(compute).repeat_interleave(group, dim=1)
    v = value.to(compute).repeat_interleave(group, dim=1)
    logits = (query.to(compute) @ k.transpose(-1, -2)) * scale
    logits = logits.masked_fill(~mask, float("-inf"))  # every row keeps its diagonal: no empty row
    lse = torch.logsumexp(logits, dim=-1)
    out = (torch.exp(logits - lse[..., None]) @ v).to(query.dtype)
    return out, (lse.float() if return_lse else None)


def block_sparsity(block_mask: BlockMask) -> float:
    """Fraction in ``[0, 1]`` of (query block, key block) tiles the kernel skips."""
    check(isinstance(block_mask, BlockMask), f"block_mask of type {type(block_mask).__name__} is invalid: expected a BlockMask")
    return float(block_mask.sparsity()) / 100.0


__all__ = ["block_sparsity", "sparse_retention_attention"]
