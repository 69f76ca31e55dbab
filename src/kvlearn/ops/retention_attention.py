"""KVpop sparse attention over the retained keys (sinks, window, running top-k), with its log-normalizer.

Query head ``h`` reads KV head ``h // (Hq // Hkv)`` (GQA). Two layouts (``layout=``), and on the gathered one two
kernels (``backend=``):

* ``"gathered"`` (default): every key has a visibility interval ``[t, end_t)``
  (:func:`kvlearn.ops.masks.eviction_positions`); per query block of ``block_size`` queries the keys any of its
  queries sees are gathered into ``capacity <= round_up(s + w + k + block_size - 1, block_size)`` slots
  (:func:`kvlearn.ops.gathered.gathered_layout`).

  - ``backend="triton"`` (the default on CUDA when no gradient is needed, e.g. evaluation): the
    fused forward of :mod:`kvlearn.ops.gathered_triton`, which reads K/V through the slot index (nothing is
    gathered in memory) and serves the G query heads of a KV head from each key tile. Only the layout is built.
  - ``backend="flex"`` (training, CPU): FlexAttention runs with the queries as ``[batch * blocks, Hq,
    block_size, D]`` against the gathered keys ``[batch * blocks, Hkv, capacity, D]`` (``index_select``, so
    autograd scatters the key/value gradients back).
* ``"blockmask"``: the ``[T, T]`` retention ``BlockMask`` of :func:`kvlearn.ops.masks.retention_block_mask`.

The per-query LSE it returns (natural log, float32) is the sparse normalizer that the future-attention target
reuses (Eq. 9 of the paper).

On CUDA the flex calls go through one ``torch.compile(flex_attention)`` per process (the fused sparse kernel).
Elsewhere FlexAttention runs eagerly (it materialises the scores: small T only), and eager FlexAttention has
no backward on the CPU: when a gradient is needed there (CPU tests, tiny CPU training runs) the call falls
back to a dense masked softmax with the same mask (on the gathered layout for ``"gathered"``, so the gather and
its gradient scatter are the ones the GPU runs; :func:`kvlearn.ops.masks.retention_mask_dense` for
``"blockmask"``), which gives the same output, LSE and gradients up to float rounding.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask

from kvlearn.errors import check, check_int
from kvlearn.ops import gathered_triton  # a module attribute: tests spy on the kernel call
from kvlearn.ops.flex import check_kernel_options, check_qkv, flex_attention_lse
from kvlearn.ops.gathered import gathered_block_mask, gathered_layout, relative_intervals
from kvlearn.ops.gathered_layout import GatheredLayout
from kvlearn.ops.masks import retention_block_mask, retention_mask_dense
from kvlearn.ops.triton_support import HAS_TRITON, check_triton_options, kernel_supports

LAYOUTS = ("gathered", "blockmask")
BACKENDS = ("auto", "triton", "flex")
TRITON_OPTION_KEYS = ("block_m", "block_n", "num_warps", "num_stages", "fp32_precision")


class GatheredPlan(NamedTuple):
    """Everything the gathered attention needs besides q/k/v; build it once with :func:`gathered_plan`.

    ``layout``: the :class:`~kvlearn.ops.gathered_layout.GatheredLayout`. ``block_mask``: its FlexAttention BlockMask
    (:func:`~kvlearn.ops.gathered.gathered_block_mask`). ``flat_index``: int64 ``[batch * blocks * kv_heads *
    capacity]`` rows of ``key.reshape(batch * kv_heads * T, D)`` to gather. ``rel_pos``/``rel_end``: int32
    ``[batch * blocks, kv_heads, capacity]`` slot intervals relative to the block start (the mask_mod's tensors).
    """

    layout: GatheredLayout
    block_mask: BlockMask
    flat_index: torch.Tensor
    rel_pos: torch.Tensor
    rel_end: torch.Tensor
    query_heads_per_kv: int


def gathered_plan(
    ranks: torch.Tensor,
    cutoffs: torch.Tensor,
    sinks: int,
    window: int,
    query_heads_per_kv: int,
    topk: int | None = None,
    block_size: int = 128,
) -> GatheredPlan:
    """Eviction positions, gathered layout, its BlockMask and gather index (see :class:`GatheredPlan`).

    ``topk``: the budget the cutoffs were computed with (no host sync); None sizes the layout from the data
    (one host sync). See :func:`kvlearn.ops.gathered.gathered_layout`.
    """
    check_int("query_heads_per_kv", query_heads_per_kv, 1)
    layout = gathered_layout(ranks, cutoffs, sinks, window, topk=topk, block_size=block_size)
    rel_pos, rel_end = relative_intervals(layout)
    block_mask = gathered_block_mask(layout, query_heads_per_kv, (rel_pos, rel_end))
    B, H, nQ, C = layout.index.shape
    T = layout.seq_len
    rows = (torch.arange(B * H, device=ranks.device, dtype=torch.int64) * T).view(B, H, 1, 1)
    flat_index = (rows + layout.index).transpose(1, 2).reshape(-1)  # [B, nQ, H, C] order
    return GatheredPlan(layout, block_mask, flat_index, rel_pos, rel_end, query_heads_per_kv)


def _check_attention_inputs(query, key, value, ranks, cutoffs) -> None:
    B, _, Hkv, T, _ = check_qkv(query, key, value)
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
    *,
    layout: str = "gathered",
    topk: int | None = None,
    plan: GatheredPlan | None = None,
    kernel_options: dict | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention restricted to the KVpop retained keys.

    Args:
        query: ``[batch, q_heads, T, head_dim]``.
        key, value: ``[batch, kv_heads, T, head_dim]``; ``q_heads`` is a multiple of ``kv_heads``.
        ranks, cutoffs: int32 ``[batch, kv_heads, T]`` (see :mod:`kvlearn.ops.fenwick`).
        sinks: >= 0. window: >= 1.
        scale: logit scale, default ``1 / sqrt(head_dim)``.
        return_lse: also return the log-sum-exp of the masked, scaled logits.
        block_mask: ``layout="blockmask"`` only: a prebuilt :func:`kvlearn.ops.masks.retention_block_mask` for
            these inputs (built here when None).
        block_size: query block / key tile size of the mask or layout built here (128 for the CUDA kernel).
        layout: ``"gathered"`` (default: the interval-gathered layout) or ``"blockmask"`` (the ``[T, T]``
            retention BlockMask).
        topk: ``layout="gathered"`` only: the budget the cutoffs were computed with; sizes the layout without a
            host sync (None: sized from the data, one sync). Must be the real budget (see
            :func:`kvlearn.ops.gathered.gathered_layout`).
        plan: ``layout="gathered"`` only: a prebuilt :func:`gathered_plan` for these inputs (built here when
            None; then ``topk`` and ``block_size`` are the plan's).
        kernel_options: launch options, None for the defaults. Flex: FlexAttention kernel options (tile sizes,
            warps, stages; see :func:`kvlearn.ops.flex.check_kernel_options`). Triton: keys of
            :data:`TRITON_OPTION_KEYS` (see :func:`kvlearn.ops.gathered_triton.gathered_attention_forward`).
        backend: ``layout="gathered"`` only. ``"auto"``: the fused Triton forward when it applies (CUDA inputs,
            no gradient needed, triton installed, bf16/fp16/fp32, head_dim a power of two in [16, 256], no
            ``kernel_options`` (None or empty)), else FlexAttention. ``"triton"`` (forward only) or ``"flex"`` to force one.

    Returns:
        ``(out [batch, q_heads, T, head_dim] in the query dtype, lse [batch, q_heads, T] float32 natural-log
        or None when return_lse is False)``.
    """
    _check_attention_inputs(query, key, value, ranks, cutoffs)
    check(layout in LAYOUTS, f"layout={layout!r} is invalid: expected one of {LAYOUTS}")
    check(backend in BACKENDS, f"backend={backend!r} is invalid: expected one of {BACKENDS}")
    check(layout == "gathered" or backend != "triton",
          "backend='triton' is invalid with layout='blockmask': expected 'auto' or 'flex' (the Triton kernel runs "
          "on the gathered layout)")
    group = query.shape[1] // key.shape[1]
    if scale is None:
        scale = query.shape[-1] ** -0.5
    needs_grad = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
    if layout == "gathered" and backend == "auto":
        backend = "triton" if not kernel_options and _triton_applies(query, needs_grad) else "flex"
    if backend == "triton":
        options = check_triton_options(kernel_options, TRITON_OPTION_KEYS)
        check(block_mask is None, "block_mask is invalid with layout='gathered': expected None (pass plan= instead)")
        if plan is None:
            lay = gathered_layout(ranks, cutoffs, sinks, window, topk=topk, block_size=block_size)
        else:
            _check_plan(plan, ranks, group)
            lay = plan.layout
        # gathered_attention_forward checks the device, dtype, head_dim and that no gradient is needed
        return gathered_triton.gathered_attention_forward(query, key, value, lay, scale, return_lse, **options)
    kernel_options = check_kernel_options(kernel_options)
    if layout == "gathered":
        check(block_mask is None, "block_mask is invalid with layout='gathered': expected None (pass plan= instead)")
        if plan is None:
            plan = gathered_plan(ranks, cutoffs, sinks, window, group, topk=topk, block_size=block_size)
        else:
            _check_plan(plan, ranks, group)
        return _gathered_attention(query, key, value, plan, scale, return_lse, needs_grad, kernel_options)
    check(plan is None, "plan is invalid with layout='blockmask': expected None (pass block_mask= instead)")
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
                                  return_lse=return_lse, kernel_options=kernel_options)
    if lse is not None:
        lse = lse.float()
    return out, lse


def _triton_applies(query: torch.Tensor, needs_grad: bool) -> bool:
    """Whether ``backend="auto"`` takes the fused Triton forward for these inputs."""
    return HAS_TRITON and query.is_cuda and not needs_grad and kernel_supports(query.dtype, query.shape[-1])


def _check_plan(plan, ranks, group: int) -> None:
    check(isinstance(plan, GatheredPlan), f"plan of type {type(plan).__name__} is invalid: expected a GatheredPlan")
    B, H, T = ranks.shape
    lay = plan.layout
    got = (lay.index.shape[0], lay.index.shape[1], lay.seq_len, plan.query_heads_per_kv, lay.index.device)
    want = (B, H, T, group, ranks.device)
    check(got == want, f"plan for (batch, kv_heads, seq, group, device)={got} is invalid: expected {want}")


def _gathered_attention(query, key, value, plan: GatheredPlan, scale, return_lse, needs_grad, kernel_options=None):
    """Attention on the gathered layout: flex (or its dense CPU twin), then back to ``[B, Hq, T]``."""
    lay = plan.layout
    B, Hq, T, D = query.shape
    Hkv = key.shape[1]
    G = Hq // Hkv
    BS, nQ, C = lay.block_size, lay.num_blocks, lay.capacity
    Tp = nQ * BS
    qp = F.pad(query, (0, 0, 0, Tp - T)) if Tp > T else query  # padded rows are zeros, dropped below
    qg = qp.reshape(B, Hq, nQ, BS, D).transpose(1, 2).reshape(B * nQ, Hq, BS, D)
    # index_select: its backward is index_add_ (atomic adds), not advanced indexing's sort-based index_put_
    # (results/raw/kvpop_ops_h200_b80db6a.json measured the gathered backward with advanced indexing at ~58 ms).
    # Keys and values are gathered together, as rows [k; v] of 2D: on CUDA index_select runs a gather kernel with
    # one thread block per index row, so its cost follows the number of rows more than their bytes (a D = 32 bf16
    # row is 64 bytes) and one gather of [k; v] rows should cost about what one of K alone did; the backward is one
    # index_add_ instead of two. kg, vg are strided views (row stride 2D, last dim contiguous, as FlexAttention
    # takes them).
    kv = torch.cat([key, value], dim=-1).reshape(B * Hkv * T, 2 * D)
    kg, vg = kv.index_select(0, plan.flat_index).view(B * nQ, Hkv, C, 2, D).unbind(-2)
    if query.device.type == "cpu" and needs_grad:  # eager FlexAttention has no backward on the CPU
        out, lse = _dense_gathered(qg, kg, vg, plan.rel_pos, plan.rel_end, G, scale, return_lse)
    else:
        if query.device.type == "cpu":  # eager flex refuses inputs that require grad even under no_grad
            qg, kg, vg = qg.detach(), kg.detach(), vg.detach()
        out, lse = flex_attention_lse(qg, kg, vg, block_mask=plan.block_mask, scale=scale, enable_gqa=True,
                                      return_lse=return_lse, kernel_options=kernel_options)
    out = out.view(B, nQ, Hq, BS, D).transpose(1, 2).reshape(B, Hq, Tp, D)
    if Tp > T:
        out = out[:, :, :T].contiguous()
    if lse is not None:
        lse = lse.float().view(B, nQ, Hq, BS).transpose(1, 2).reshape(B, Hq, Tp)[:, :, :T].contiguous()
    return out, lse


def _dense_gathered(qg, kg, vg, rel_pos, rel_end, group, scale, return_lse):
    """Dense masked softmax on the gathered layout (CPU autograd twin of the flex call, same shapes/dtypes)."""
    qi = torch.arange(qg.shape[2], device=qg.device, dtype=torch.int32)[:, None]  # [BS, 1]
    mask = (rel_pos[:, :, None, :] <= qi) & (qi < rel_end[:, :, None, :])  # [B*nQ, Hkv, BS, C]
    return _masked_softmax(qg, kg, vg, mask, group, scale, return_lse)


def _dense_attention(query, key, value, ranks, cutoffs, sinks, window, scale, return_lse):
    """Dense masked softmax twin of the flex call (CPU autograd). Same shapes and dtypes as the flex path."""
    mask = retention_mask_dense(ranks, cutoffs, sinks, window)
    return _masked_softmax(query, key, value, mask, query.shape[1] // key.shape[1], scale, return_lse)


def _masked_softmax(query, key, value, kv_mask, group, scale, return_lse):
    """``softmax(scale q k^T, masked) v`` in float32 (at least) and its LSE; ``kv_mask [B, Hkv, Q, K]`` is shared by
    the ``group`` query heads of each KV head. Every row must keep at least one key."""
    compute = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    k = key.to(compute).repeat_interleave(group, dim=1)
    v = value.to(compute).repeat_interleave(group, dim=1)
    logits = (query.to(compute) @ k.transpose(-1, -2)) * scale
    logits = logits.masked_fill(~kv_mask.repeat_interleave(group, dim=1), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    out = (torch.exp(logits - lse[..., None]) @ v).to(query.dtype)
    return out, (lse.float() if return_lse else None)


def block_sparsity(block_mask: BlockMask) -> float:
    """Fraction in ``[0, 1]`` of (query block, key block) tiles the kernel skips."""
    check(isinstance(block_mask, BlockMask), f"block_mask of type {type(block_mask).__name__} is invalid: expected a BlockMask")
    return float(block_mask.sparsity()) / 100.0


def gathered_tile_fraction(plan: GatheredPlan | GatheredLayout) -> float:
    """Fraction in ``[0, 1]`` of the ``T x T`` grid's (query block, key block) tiles the gathered kernel computes
    (one host sync); ``1 -`` this is the gathered layout's counterpart of :func:`block_sparsity`."""
    lay = plan.layout if isinstance(plan, GatheredPlan) else plan
    check(isinstance(lay, GatheredLayout), f"plan of type {type(plan).__name__} is invalid: expected a GatheredPlan")
    B, H, nQ, _ = lay.index.shape
    return float(lay.tiles_computed()) / float(B * H * nQ * nQ)


__all__ = [
    "BACKENDS",
    "LAYOUTS",
    "TRITON_OPTION_KEYS",
    "GatheredPlan",
    "block_sparsity",
    "gathered_plan",
    "gathered_tile_fraction",
    "sparse_retention_attention",
]
