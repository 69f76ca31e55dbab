"""Running top-k cutoff per (batch, KV head): the rank threshold behind KVpop's retention mask.

KVpop (appendix C) keeps, for every query position ``q``, the sinks ``t < sinks``, the protected window
``q - t < window`` and the ``topk`` best tokens of the eligible set ``E(q) = {t : sinks <= t <= q - window}``.
Tokens are ranked once by a static priority (rank 0 = highest priority); the cutoff ``cutoffs[q]`` is the
``topk``-th smallest rank in ``E(q)``, so an eligible token ``t`` is kept iff ``ranks[t] <= cutoffs[q]``.

Sentinels: ``cutoffs[q] = T`` ("keep every eligible token") while ``|E(q)| < topk``, and ``-1`` ("keep none")
everywhere when ``topk == 0``.

Three backends with the same signature and bit-identical results:

* ``torch``: the paper's algorithm (appendix C.2): scan ``q`` left to right, insert the rank of the token
  ``t = q - window`` that enters ``E(q)`` into a Fenwick tree over ranks, and find the ``topk``-th inserted rank
  by binary lifting. Vectorised over batch * heads; a Python loop over ``q``. The reference.
* ``counts``: the CPU default, no loop over ``q``. ``E(q)`` is a prefix of ``e_j = ranks[sinks + j]``, and the
  ``topk``-th smallest value of a prefix is the number of values ``r`` with fewer than ``topk`` prefix elements
  ``<= r``; for a block of prefix lengths at once, comparisons of the block's elements with every value, summed
  along the prefix, give those counts. ``O(T x (T - window - sinks - topk))`` work per (batch, head), in blocks of
  bounded memory; on a CPU it is ~10x faster than the scan at the KVpop cache's chunk shapes (a Python loop of ~30
  small ops per query costs more than the counts).
* ``triton``: a parallel scheme for the GPU. ``E(q)`` is a prefix of the sequence ``e_j = ranks[sinks + j]``,
  of length ``n(q) = q - window - sinks + 1``, so the cutoff is a "k-th smallest value in a prefix" query. One
  program per (batch, head) builds a wavelet matrix over ``e`` (``ceil(log2 T)`` levels, each a stable
  partition by one bit whose prefix zero-counts come from ``tl.cumsum``); then every query is answered
  independently in ``ceil(log2 T)`` steps, all queries in parallel. See ``docs/DESIGN.md`` (section 3, "Triton:
  wavelet matrix").
"""

from __future__ import annotations

import torch

from kvlearn.errors import check, check_int, is_int
from kvlearn.ops.triton_support import HAS_TRITON as _HAS_TRITON
from kvlearn.ops.triton_support import interpreting as _interpreting
from kvlearn.ops.triton_support import tl, triton

BACKENDS = ("auto", "torch", "counts", "triton")
COUNTS_BLOCK_ELEMENTS = 1 << 22  # int32 elements of one block of the counts backend (16 MiB)


def _check_params(sinks, window, topk) -> None:
    check_int("sinks", sinks, 0)
    check(
        not (is_int(window) and window == 0),
        "window=0 is invalid (zero window): expected an integer >= 1 (the query itself is always in the window)",
    )
    check_int("window", window, 1)
    check_int("topk", topk, 0)


def _check_3d(name: str, tensor, dtype: torch.dtype) -> None:
    check(isinstance(tensor, torch.Tensor), f"{name} of type {type(tensor).__name__} is invalid: expected a torch.Tensor")
    check(
        tensor.dim() == 3,
        f"{name} with shape {tuple(tensor.shape)} is invalid: expected 3 dims [batch, kv_heads, seq]",
    )
    check(tensor.dtype == dtype, f"{name} with dtype {tensor.dtype} is invalid: expected {dtype}")


def static_ranks(priorities: torch.Tensor) -> torch.Tensor:
    """Rank tokens by static priority, per (batch, head).

    Args:
        priorities: float32 ``[batch, kv_heads, T]``; higher means more important.

    Returns:
        int32 ``[batch, kv_heads, T]``: for each (b, h) a permutation of ``0..T-1``; rank 0 is the highest
        priority, and equal priorities are ordered by position (the earlier token gets the smaller rank).
        Deterministic (stable sort). NaN sorts as the highest priority (``torch.sort`` semantics).
    """
    _check_3d("priorities", priorities, torch.float32)
    T = priorities.shape[-1]
    # stable descending sort keeps equal priorities in position order -> earlier token first.
    order = torch.sort(priorities, dim=-1, descending=True, stable=True).indices
    positions = torch.arange(T, device=priorities.device, dtype=torch.int32).expand_as(order)
    ranks = torch.empty(priorities.shape, dtype=torch.int32, device=priorities.device)
    ranks.scatter_(-1, order, positions)
    return ranks


def running_cutoff(
    ranks: torch.Tensor, sinks: int, window: int, topk: int, backend: str = "auto"
) -> torch.Tensor:
    """Running top-k cutoff rank for every query position.

    Args:
        ranks: int32 ``[batch, kv_heads, T]``, values in ``[0, T)`` (a permutation per (b, h), as returned by
            :func:`static_ranks`; repeated values are counted with multiplicity). Values are not checked
            (that would need a device sync).
        sinks: number of always-kept first tokens (>= 0).
        window: protected recent window (>= 1; the query itself is inside it).
        topk: long-range budget (>= 0).
        backend: ``"auto"`` (triton when ``ranks`` is on CUDA and triton imports, else counts), ``"torch"``,
            ``"counts"`` or ``"triton"``.

    Returns:
        int32 ``[batch, kv_heads, T]``: ``cutoffs[..., q]`` = the ``topk``-th smallest rank in
        ``E(q) = {t : sinks <= t <= q - window}``; ``T`` when ``|E(q)| < topk``; ``-1`` everywhere when
        ``topk == 0``.
    """
    _check_3d("ranks", ranks, torch.int32)
    _check_params(sinks, window, topk)
    check(backend in BACKENDS, f"backend={backend!r} is invalid: expected one of {BACKENDS}")
    if backend == "auto":
        backend = "triton" if (_HAS_TRITON and ranks.is_cuda) else "counts"
    if backend == "triton":
        check(_HAS_TRITON, "backend='triton' is unavailable: triton is not installed (use backend='torch')")
        check(
            ranks.is_cuda or _interpreting(),
            f"backend='triton' needs a CUDA tensor, got device {ranks.device} (set TRITON_INTERPRET=1 to run on CPU)",
        )

    B, H, T = ranks.shape
    if topk == 0:
        return torch.full((B, H, T), -1, dtype=torch.int32, device=ranks.device)
    n_eligible = T - window - sinks  # |E(T - 1)|: the most tokens that are ever eligible
    if n_eligible < topk or B * H == 0:
        return torch.full((B, H, T), T, dtype=torch.int32, device=ranks.device)
    ranks = ranks.contiguous()
    if backend == "torch":
        return _running_cutoff_torch(ranks, sinks, window, topk)
    if backend == "counts":
        return _running_cutoff_counts(ranks, sinks, window, topk)
    return running_cutoff_triton(ranks, sinks, window, topk)


def running_topk_cutoff(
    priorities: torch.Tensor, sinks: int, window: int, topk: int, backend: str = "auto"
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ranks, cutoffs)`` from float32 priorities ``[batch, kv_heads, T]``; see :func:`static_ranks` and
    :func:`running_cutoff` (both int32 ``[batch, kv_heads, T]``)."""
    _check_3d("priorities", priorities, torch.float32)
    _check_params(sinks, window, topk)
    check(backend in BACKENDS, f"backend={backend!r} is invalid: expected one of {BACKENDS}")
    ranks = static_ranks(priorities)
    return ranks, running_cutoff(ranks, sinks, window, topk, backend=backend)


# ----------------------------------------------------------------------------------------------------------
# torch reference: Fenwick tree + binary lifting (appendix C.2), vectorised over batch * heads
# ----------------------------------------------------------------------------------------------------------


def _running_cutoff_torch(ranks: torch.Tensor, sinks: int, window: int, topk: int) -> torch.Tensor:
    """Fenwick-tree scan. ``ranks`` int32 ``[B, H, T]`` contiguous, ``topk >= 1``; returns int32 ``[B, H, T]``."""
    B, H, T = ranks.shape
    device = ranks.device
    rows = ranks.reshape(B * H, T).long()
    n_rows = rows.shape[0]
    tree = torch.zeros(n_rows, T + 1, dtype=torch.int64, device=device)  # 1-indexed: tree[r + 1] covers rank r
    out = torch.full((n_rows, T), T, dtype=torch.int32, device=device)
    row_ids = torch.arange(n_rows, device=device)
    top_step = 1 << (T.bit_length() - 1)  # highest power of two <= T
    update_steps = T.bit_length()  # an index climbs at most bit_length(T) times before passing T
    ones = torch.ones(n_rows, dtype=torch.int64, device=device)

    for q in range(sinks + window, T):
        t = q - window  # the token that enters E(q)
        # insert rank[t]: add 1 at Fenwick index rank + 1 and all its ancestors
        idx = rows[:, t] + 1
        for _ in range(update_steps):
            live = idx <= T
            tree.index_put_((row_ids, idx.clamp(max=T)), torch.where(live, ones, 0), accumulate=True)
            idx = idx + (idx & -idx)
        if t - sinks + 1 < topk:  # |E(q)| < topk: keep every eligible token (sentinel T)
            continue
        # binary lifting: largest pos with prefix_count(pos) < topk; the topk-th rank is then `pos` (0-based)
        pos = torch.zeros(n_rows, dtype=torch.int64, device=device)
        remaining = torch.full((n_rows,), topk, dtype=torch.int64, device=device)
        step = top_step
        while step:
            nxt = pos + step
            count = tree[row_ids, nxt.clamp(max=T)]
            take = (nxt <= T) & (count < remaining)
            pos = torch.where(take, nxt, pos)
            remaining = remaining - torch.where(take, count, 0)
            step >>= 1
        out[:, q] = pos.to(torch.int32)
    return out.reshape(B, H, T)


# ----------------------------------------------------------------------------------------------------------
# counts: the cutoffs of a block of prefix lengths at once, from value histograms (no loop over q)
# ----------------------------------------------------------------------------------------------------------


def _running_cutoff_counts(ranks: torch.Tensor, sinks: int, window: int, topk: int,
                           block_elements: int = COUNTS_BLOCK_ELEMENTS) -> torch.Tensor:
    """Counting form of the scan. ``ranks`` int32 ``[B, H, T]`` contiguous, ``1 <= topk <= T - window - sinks``;
    returns int32 ``[B, H, T]``. Prefix length ``n`` of ``e_j = ranks[sinks + j]`` answers query
    ``q = n + window + sinks - 1``; its cutoff is ``#{r : #{j < n : e_j <= r} < topk}``. Lengths below ``topk`` keep
    the sentinel ``T``; the others run in blocks of about ``block_elements`` counts ``[rows, value, length]``."""
    B, H, T = ranks.shape
    rows = ranks.reshape(B * H, T).long()
    n_rows, n_max, device = rows.shape[0], T - window - sinks, ranks.device
    out = torch.full((n_rows, T), T, dtype=torch.int32, device=device)
    first = rows[:, sinks:sinks + topk - 1]  # e[:topk - 1], in every prefix that gets a cutoff
    seen = torch.zeros(n_rows, T, dtype=torch.int32, device=device).scatter_add_(1, first, torch.ones_like(first, dtype=torch.int32))
    seen = seen.cumsum(dim=1, dtype=torch.int32)  # seen[r] = #{j < n0 - 1 : e_j <= r}
    values = torch.arange(T, device=device)[None, :, None]
    step = max(1, block_elements // (n_rows * T))
    for n0 in range(topk, n_max + 1, step):
        n1 = min(n_max + 1, n0 + step)  # prefix lengths n0 .. n1 - 1; their last elements e[n0 - 1 : n1 - 1]
        last = rows[:, None, sinks + n0 - 1:sinks + n1 - 1]
        counts = (last <= values).cumsum(dim=2, dtype=torch.int32)  # [rows, value r, length]: new elements <= r
        below = counts < (topk - seen)[:, :, None]  # fewer than topk prefix elements <= r
        out[:, n0 + window + sinks - 1:n1 + window + sinks - 1] = below.sum(dim=1, dtype=torch.int32)
        seen = seen + counts[:, :, -1]
    return out.reshape(B, H, T)


# ----------------------------------------------------------------------------------------------------------
# triton: wavelet matrix over the eligible sequence, all queries in parallel
# ----------------------------------------------------------------------------------------------------------

if _HAS_TRITON:

    @triton.jit
    def _wavelet_build_kernel(
        ranks_ptr,  # int32 [BH, T]
        buf_a_ptr,  # int32 [BH, N] scratch
        buf_b_ptr,  # int32 [BH, N] scratch
        zc_ptr,  # int32 [BH, NBITS, N + 1]: zc[l, i] = zeros of level-l bit among positions [0, i)
        T,
        N,
        sinks,
        NBITS: tl.constexpr,
        NBITS_P2: tl.constexpr,
        BLOCK: tl.constexpr,
        BLOCK_Z: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        src0 = ranks_ptr + pid * T + sinks  # e_j = ranks[row, sinks + j], j in [0, N)
        buf_a = buf_a_ptr + pid * N
        buf_b = buf_b_ptr + pid * N
        zc_row = zc_ptr + pid * NBITS * (N + 1)

        # The multiset of values is the same at every level, so the number of zeros of each bit (which is
        # where the ones start after the stable partition) is known up front.
        bit_ids = tl.arange(0, NBITS_P2)
        ones_per_bit = tl.zeros([NBITS_P2], dtype=tl.int32)
        # (`while` rather than `for ... in range(0, N, ...)`: triton's CPU interpreter cannot take a runtime
        # loop bound under numpy >= 2.4, and the compiled kernel does not care.)
        start = N * 0
        while start < N:
            offs = start + tl.arange(0, BLOCK_Z)
            valid = offs < N
            v = tl.load(src0 + offs, mask=valid, other=0)
            bits = (v[:, None] >> bit_ids[None, :]) & 1
            ones_per_bit += tl.sum(bits, axis=0)
            start += BLOCK_Z
        zeros_per_bit = N - ones_per_bit

        for lvl in tl.static_range(NBITS):
            bit = NBITS - 1 - lvl  # most significant bit first
            if lvl == 0:
                src = src0
                dst = buf_a
            elif lvl % 2 == 1:
                src = buf_a
                dst = buf_b
            else:
                src = buf_b
                dst = buf_a
            zc_lvl = zc_row + lvl * (N + 1)
            n_zeros = tl.sum(tl.where(bit_ids == bit, zeros_per_bit, 0), axis=0)
            carry = n_zeros * 0  # zeros seen in earlier chunks (int32 scalar)
            tl.store(zc_lvl, carry)
            start = N * 0
            while start < N:
                offs = start + tl.arange(0, BLOCK)
                valid = offs < N
                v = tl.load(src + offs, mask=valid, other=0)
                is_one = (v >> bit) & 1
                is_zero = tl.where(valid, 1 - is_one, 0)
                incl = tl.cumsum(is_zero, axis=0)
                zeros_before = carry + incl - is_zero
                tl.store(zc_lvl + 1 + offs, carry + incl, mask=valid)
                if lvl < NBITS - 1:  # stable partition: zeros first, then ones, order kept within each
                    dest = tl.where(is_one == 0, zeros_before, n_zeros + offs - zeros_before)
                    tl.store(dst + dest, v, mask=valid)
                carry += tl.sum(is_zero, axis=0)
                start += BLOCK
            # the next level reads what other threads of this program wrote
            tl.debug_barrier()

    @triton.jit
    def _wavelet_query_kernel(
        zc_ptr,  # int32 [BH, NBITS, N + 1]
        out_ptr,  # int32 [BH, T]
        T,
        N,
        sinks,
        window,
        topk,
        NBITS: tl.constexpr,
        BLOCK_Q: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        q = tl.program_id(1) * BLOCK_Q + tl.arange(0, BLOCK_Q)
        in_range = q < T
        n = q - window - sinks + 1  # |E(q)|: E(q) is the prefix [0, n) of e
        active = in_range & (n >= topk)
        zc_row = zc_ptr + pid * NBITS * (N + 1)
        lo = tl.zeros([BLOCK_Q], dtype=tl.int32)
        hi = tl.where(active, n, 0)
        k = tl.zeros([BLOCK_Q], dtype=tl.int32) + topk  # 1-based order statistic still to find
        value = tl.zeros([BLOCK_Q], dtype=tl.int32)
        for lvl in tl.static_range(NBITS):
            bit = NBITS - 1 - lvl
            zc_lvl = zc_row + lvl * (N + 1)
            n_zeros = tl.load(zc_lvl + N)
            z_lo = tl.load(zc_lvl + lo, mask=active, other=0)
            z_hi = tl.load(zc_lvl + hi, mask=active, other=0)
            zeros_in_range = z_hi - z_lo
            go_zero = k <= zeros_in_range
            value = tl.where(go_zero, value, value | (1 << bit))
            k = tl.where(go_zero, k, k - zeros_in_range)
            lo = tl.where(go_zero, z_lo, n_zeros + lo - z_lo)
            hi = tl.where(go_zero, z_hi, n_zeros + hi - z_hi)
        result = tl.where(active, value, T)
        tl.store(out_ptr + pid * T + q, result, mask=in_range)


def _wavelet_bits(T: int) -> int:
    """Bits needed for values in ``[0, T)`` (at least one level)."""
    return max(1, (T - 1).bit_length())


def running_cutoff_triton(
    ranks: torch.Tensor, sinks: int, window: int, topk: int, block: int | None = None, block_q: int | None = None
) -> torch.Tensor:
    """The Triton backend of :func:`running_cutoff` without validation: wavelet-matrix cutoffs, int32 ``[B, H, T]``.

    The caller guarantees what :func:`running_cutoff` checks and handles first: ``ranks`` int32 ``[B, H, T]``
    contiguous on CUDA (or the CPU under ``TRITON_INTERPRET=1``), ``B * H >= 1``, ``1 <= topk <= T - window -
    sinks``. ``block`` (build chunk) and ``block_q`` (queries per program) are powers of two, None for the
    defaults; tests shrink them to exercise the chunk loop at small T.
    """
    B, H, T = ranks.shape
    N = T - window - sinks
    BH = B * H
    nbits = _wavelet_bits(T)
    device = ranks.device
    buf_a = torch.empty(BH, N, dtype=torch.int32, device=device)
    buf_b = torch.empty(BH, N, dtype=torch.int32, device=device)
    zc = torch.empty(BH, nbits, N + 1, dtype=torch.int32, device=device)
    out = torch.empty(B, H, T, dtype=torch.int32, device=device)
    block = block or min(2048, triton.next_power_of_2(N))  # H200: 2048 x 8 warps was fastest
    _wavelet_build_kernel[(BH,)](
        ranks,
        buf_a,
        buf_b,
        zc,
        T,
        N,
        sinks,
        NBITS=nbits,
        NBITS_P2=triton.next_power_of_2(nbits),
        BLOCK=block,
        BLOCK_Z=min(256, block),
        num_warps=8 if block >= 2048 else 4,
    )
    block_q = block_q or min(256, triton.next_power_of_2(T))
    _wavelet_query_kernel[(BH, triton.cdiv(T, block_q))](
        zc, out, T, N, sinks, window, topk, NBITS=nbits, BLOCK_Q=block_q, num_warps=4
    )
    return out


__all__ = ["BACKENDS", "running_cutoff", "running_cutoff_triton", "running_topk_cutoff", "static_ranks"]
