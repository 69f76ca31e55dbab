"""GQA -> MLA conversion for KV-Kaizen's rank axis (``docs/DESIGN.md``, section 8, "Rank: GQA -> MLA conversion").

:func:`convert_to_mla` replaces every layer's attention of a Qwen3/Qwen2/Llama/Mistral model (GQA, RoPE over the
whole head dim, HF half-split layout: dim ``j`` pairs with ``j + d_h/2`` at frequency ``θ_j``) by an
:class:`~kvlearn.kaizen.mla_attention.MLAAttention` that caches, per token, a latent ``c`` (width ``r``) and one
decoupled RoPE key ``k_R`` (width ``d_R``) shared by every head. Calibration: forwards of the *original* model on
``input_ids`` (:func:`calibrate`, ``batch_size`` rows at a time) accumulate, per layer, the second moment of the
attention input ``x̃ = [x; 1]`` (after ``input_layernorm``) and the per-frequency key covariance: memory independent of
the calibration size; no propagation through converted layers.

**Decoupled RoPE key (RoRoPE-style).** Let ``k_g = knorm(W_k,g x)`` (``knorm`` = Qwen3's per-head ``k_norm``, the
identity otherwise) and ``k_g^j = (k_g[j], k_g[j + d_h/2])`` the 2-d pair of head ``g`` at frequency ``j``. RoPE
rotates every head's pair ``j`` by the same angle, so a real orthogonal mixing ``U_j`` of the *heads* commutes with
it. For each ``j``: ``C_j = Σ_tokens Σ_{re,im} k^j k^jᵀ`` (``n_kv x n_kv``), ``C_j = U_j Λ_j U_jᵀ``. A *component*
``(j, c)`` is ``κ_c^j = Σ_g U_j[g, c] k_g^j`` (2 dims, energy ``λ_{j,c}``); the ``d_R / 2`` components of most
energy (over all ``j, c``) form ``k_R`` (``d_R`` dims, half-split layout: the real parts then the imaginary parts).
As one matrix ``E [d_R, n_kv d_h]`` with orthonormal rows: ``k_R = E · rope(k)`` (heads flattened), and head
``h`` (group ``g``) gets the RoPE query ``q_R,h = E_g rope(q_h)`` (``E_g`` = the columns of head ``g``); then
``q_R,h · k_R = rope(q_h) · (Eᵀ E rope(k))_g``: exact on the kept components. The other components lose RoPE: the
no-RoPE key is ``k̃ = P k`` with ``P = I - Eᵀ E`` (the unrotated key), scored against the unrotated query ``q_h``.
``d_R = n_kv d_h`` keeps every component (exact: ``P = 0``); ``d_R = 2 · (d_h / 2)`` with one KV head is plain RoPE.
When ``n_kv = 1`` or the keys are collinear across heads at a frequency, the first components already hold all.

**Joint low-rank factorisation.** The key source is ``W_src = P W_k`` without ``k_norm`` (the no-RoPE key, linear in
``x``) and the *pre-norm* ``W_k`` with ``k_norm`` (the norm needs the whole head's RMS, so the latent reconstructs
the pre-norm key and the attention computes ``P knorm(up_k c)``). Balanced scaling (TransMLA's BKV): ``α =
mean_i ‖K_src[:, i]‖ / mean_i ‖V[:, i]‖`` (column L2 norms of the calibration outputs), ``M = [W_src / α, b_src / α;
W_v, b_v]`` (``2 n_kv d_h x (hidden + 1)``, biases as an input column of ones) so neither K nor V dominates. Then

- ``svd``: ``M = U S Vᵀ`` (weights only);
- ``care`` (activation-aware, CARE): ``M Σ^{1/2} = U S Vᵀ`` with ``Σ = E[x̃ x̃ᵀ] + δ·mean(diag)·I``, ``x̃ = [x; 1]``,
  minimising the expected output error ``‖(M - M̂) Σ^{1/2}‖_F``.

Down-projection ``c = U_rᵀ M x̃`` (``kv_down``: weight ``U_rᵀ [W_src/α; W_v]``, bias ``U_rᵀ [b_src/α; b_v]``),
up-projections ``up_k = α U_r[K rows]`` (times ``P`` without k_norm), ``up_v = U_r[V rows]``. The singular vectors
are sorted, so the first ``d`` latent coordinates with the first ``d`` columns of the up-projections are the rank-``d``
solution of the same objective (nested: one converted model serves every width ``r/8 .. r``). ``r = 2 n_kv d_h``
(the largest) is exact: ``U U ᵀ = I``. The paper's default is ``r = n_kv d_h``.

The converted config gets ``kv_lora_rank = r`` and ``qk_rope_head_dim = d_R`` (DeepSeek naming), so
:meth:`Backbone.from_config` / :meth:`Backbone.from_model` report an MLA backbone (the reference cost stays the GQA
model's ``num_key_value_heads x head_dim``). ``save_pretrained`` writes the converted model; :func:`kvlearn.load`
restores it (:func:`load_mla`).
"""

from __future__ import annotations

import torch

from ..errors import check, check_int, is_int
from ..hf import check_supported

VARIANTS = ("svd", "care")


def key_covariance(keys: torch.Tensor) -> torch.Tensor:
    """``C [d_h / 2, n_kv, n_kv]``: per frequency ``j``, ``Σ_tokens (k^j_re k^j_reᵀ + k^j_im k^j_imᵀ)`` of ``keys
    [N, n_kv, d_h]`` (normed, unrotated)."""
    half = keys.shape[-1] // 2
    re, im = keys[..., :half], keys[..., half:]  # [N, n_kv, half]
    return torch.einsum("ngj,nhj->jgh", re, re) + torch.einsum("ngj,nhj->jgh", im, im)


def rope_components(cov: torch.Tensor, rope_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoupled RoPE mixing from the :func:`key_covariance` ``cov [d_h / 2, n_kv, n_kv]`` (float64): ``(E [d_R,
    n_kv d_h], energy [n_kv d_h / 2])``, the energies of every component in descending order (module docstring)."""
    half, n_kv, _ = cov.shape
    d_h = 2 * half
    lam, vec = torch.linalg.eigh(cov)  # ascending per frequency
    lam_flat = lam.reshape(-1).cpu()  # index j * n_kv + c
    order = sorted(range(lam_flat.numel()), key=lambda i: (-float(lam_flat[i]), i))
    keep = order[: rope_dim // 2]
    e = torch.zeros(rope_dim, n_kv * d_h, dtype=cov.dtype, device=cov.device)
    heads = torch.arange(n_kv, device=cov.device) * d_h
    for s, i in enumerate(keep):
        j, c = divmod(i, n_kv)
        u = vec[j, :, c]  # [n_kv]
        e[s, heads + j] = u
        e[s + rope_dim // 2, heads + j + half] = u
    return e, lam_flat[order]


def check_rope_dim(rope_dim, kv_heads: int, head_dim: int) -> int:
    top = kv_heads * head_dim
    check(is_int(rope_dim) and 2 <= rope_dim <= top and rope_dim % 2 == 0,
          f"rope_dim={rope_dim!r} is invalid: expected an even integer in [2, {top}] (n_kv x head_dim = {kv_heads} x "
          f"{head_dim}: every rotary component of every KV head)")
    return rope_dim


def check_rank(rank, kv_heads: int, head_dim: int) -> int:
    top = 2 * kv_heads * head_dim
    check(is_int(rank) and 8 <= rank <= top and rank % 8 == 0,
          f"rank={rank!r} is invalid: expected a multiple of 8 in [8, {top}] (2 x n_kv x head_dim; widths r/8 .. r)")
    return rank


def is_mla(model) -> bool:
    """Whether ``model`` was converted by :func:`convert_to_mla`."""
    from .mla_attention import MLAAttention

    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None) or []
    return bool(layers) and all(isinstance(layer.self_attn, MLAAttention) for layer in layers)


class _Stats:
    """One layer's calibration statistics, accumulated in float64 over batches: ``xtx = Σ x̃ x̃ᵀ`` (``x̃ = [x; 1]``,
    ``x`` the attention input), ``tokens``, and the key covariance ``cov`` (:func:`key_covariance` of the normed,
    unrotated keys). Memory ``(hidden + 1)² + d_h/2 · n_kv²`` per layer, whatever the calibration size."""

    def __init__(self):
        self.xtx, self.cov, self.tokens = None, None, 0

    def add(self, x: torch.Tensor, keys: torch.Tensor) -> None:
        x = torch.cat([x.double(), torch.ones(x.shape[0], 1, dtype=torch.float64, device=x.device)], dim=1)
        xtx, cov = x.T @ x, key_covariance(keys.double())
        self.xtx = xtx if self.xtx is None else self.xtx + xtx
        self.cov = cov if self.cov is None else self.cov + cov
        self.tokens += x.shape[0]


def calibrate(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
              batch_size: int = 8) -> list[_Stats]:
    """Every layer's :class:`_Stats` from forwards of the original model on ``input_ids`` (``batch_size`` rows at a
    time; padding left out by ``attention_mask``)."""
    layers = model.model.layers
    stats = [_Stats() for _ in layers]
    keep: list[torch.Tensor | None] = [None]
    hooks = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        head_dim = attn.head_dim

        def hook(module, args, output, i=i, attn=attn, head_dim=head_dim):
            x = args[0].reshape(-1, args[0].shape[-1])
            k = output.reshape(-1, output.shape[-1] // head_dim, head_dim)
            if getattr(attn, "k_norm", None) is not None:
                k = attn.k_norm(k)
            if keep[0] is not None:
                x, k = x[keep[0]], k[keep[0]]
            stats[i].add(x, k)
        hooks.append(attn.k_proj.register_forward_hook(hook))
    try:
        with torch.no_grad():
            for start in range(0, input_ids.shape[0], batch_size):
                ids = input_ids[start:start + batch_size]
                mask = None if attention_mask is None else attention_mask[start:start + batch_size]
                keep[0] = None if mask is None else mask.reshape(-1).bool()
                model(input_ids=ids, attention_mask=mask, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return stats


def _sqrtm(sigma: torch.Tensor) -> torch.Tensor:
    lam, vec = torch.linalg.eigh(sigma)
    return (vec * lam.clamp(min=0).sqrt()) @ vec.T


def factorise(xtx: torch.Tensor, tokens: int, w_src: torch.Tensor, b_src: torch.Tensor, w_v: torch.Tensor,
              b_v: torch.Tensor, variant: str, damping: float = 0.01):
    """The joint factorisation (module docstring), float64, from the calibration moment ``xtx = Σ x̃ x̃ᵀ`` over
    ``tokens``: ``(down_w [m, hidden], down_b [m], up_k [n_k, m], up_v [n_v, m], alpha)`` with every ``m`` column,
    sorted (truncate to ``r``). Column norms of the outputs: ``‖Y[:, i]‖² = w̃_iᵀ xtx w̃_i``."""
    def mean_col_norm(w, b):
        wt = torch.cat([w, b[:, None]], dim=1)
        return ((wt @ xtx) * wt).sum(dim=1).clamp(min=0).sqrt().mean()

    kn, vn = mean_col_norm(w_src, b_src), mean_col_norm(w_v, b_v)
    if kn <= 1e-8 * vn:  # no key source left (every component in the RoPE key, no k_norm): rounding noise only
        w_src, b_src = torch.zeros_like(w_src), torch.zeros_like(b_src)
    alpha = float(kn / vn) if kn > 1e-8 * vn and vn > 0 else 1.0
    w = torch.cat([w_src / alpha, w_v])
    b = torch.cat([b_src / alpha, b_v])
    m = torch.cat([w, b[:, None]], dim=1)  # [rows, hidden + 1]
    if variant == "care":
        sigma = xtx / max(tokens, 1)
        sigma = sigma + damping * sigma.diagonal().mean() * torch.eye(sigma.shape[0], dtype=xtx.dtype,
                                                                      device=xtx.device)
        m = m @ _sqrtm(sigma)
    u, _, _ = torch.linalg.svd(m, full_matrices=False)  # u [rows, min(rows, hidden + 1)]
    n_k = w_src.shape[0]
    return u.T @ w, u.T @ b, alpha * u[:n_k], u[n_k:], alpha


def convert_to_mla(model, rope_dim: int, input_ids: torch.Tensor, rank: int | None = None, variant: str = "svd",
                   attention_mask: torch.Tensor | None = None, damping: float = 0.01, batch_size: int = 8):
    """Convert ``model`` (in place) to MLA with latent width ``rank`` (default ``n_kv x head_dim``, the paper's) and
    decoupled RoPE key width ``rope_dim``, calibrated on ``input_ids [batch, T]`` (module docstring). Returns it.

    ``variant``: ``"svd"`` (weights only) or ``"care"`` (activation-aware). Full rank ``2 n_kv d_h`` with
    ``rope_dim = n_kv d_h`` reproduces the GQA model; smaller ones approximate it."""
    check_supported(model)
    check(not is_mla(model), "the model is already converted to MLA: convert the original GQA model")
    cfg = model.config
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    check(head_dim % 2 == 0, f"head_dim={head_dim} is odd: RoPE pairs need an even head dim")
    check_rope_dim(rope_dim, kv, head_dim)
    rank = kv * head_dim if rank is None else rank
    check_rank(rank, kv, head_dim)
    check(variant in VARIANTS, f"variant={variant!r} is invalid: expected one of {', '.join(VARIANTS)}")
    check(isinstance(input_ids, torch.Tensor) and input_ids.dim() == 2 and input_ids.numel() > 0
          and not input_ids.is_floating_point(),
          "input_ids is invalid: expected a non-empty integer tensor [batch, tokens] of calibration tokens")
    rope_params = getattr(cfg, "rope_parameters", None) or {}
    partial = rope_params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0)) or 1.0
    check(partial == 1.0, f"partial_rotary_factor={partial} is not supported: expected RoPE over the whole head dim")

    check_int("batch_size", batch_size, 1)
    stats = calibrate(model, input_ids, attention_mask, batch_size)
    with torch.no_grad():
        _convert_layers(model, stats, kv, head_dim, rank, rope_dim, variant, damping)
    cfg.kv_lora_rank = rank
    cfg.qk_rope_head_dim = rope_dim
    cfg.kvlearn_mla_variant = variant
    return model


def _convert_layers(model, stats, kv, head_dim, rank, rope_dim, variant, damping) -> None:
    from .mla_attention import MLAAttention

    for layer, st in zip(model.model.layers, stats):
        attn = layer.self_attn
        dtype = attn.q_proj.weight.dtype
        k_norm = getattr(attn, "k_norm", None)
        w_k, w_v = attn.k_proj.weight.double(), attn.v_proj.weight.double()
        zeros = torch.zeros(w_k.shape[0], dtype=torch.float64, device=w_k.device)
        b_k = attn.k_proj.bias.double() if attn.k_proj.bias is not None else zeros
        b_v = attn.v_proj.bias.double() if attn.v_proj.bias is not None else zeros
        e, _ = rope_components(st.cov, rope_dim)
        p = torch.eye(kv * head_dim, dtype=torch.float64, device=w_k.device) - e.T @ e
        if k_norm is None:
            w_src, b_src = p @ w_k, p @ b_k
        else:
            w_src, b_src = w_k, b_k
        down_w, down_b, up_k, up_v, _ = factorise(st.xtx, st.tokens, w_src, b_src, w_v, b_v, variant, damping)
        check(down_w.shape[0] >= rank, f"rank={rank} exceeds the factorisation's {down_w.shape[0]} components (hidden "
                                       f"size {w_k.shape[1]} + 1): expected rank <= {down_w.shape[0]}")
        if k_norm is None:
            up_k = p @ up_k
        has_bias = attn.k_proj.bias is not None or attn.v_proj.bias is not None
        new = MLAAttention(attn, rank, rope_dim, has_bias)
        new.kv_down.weight.copy_(down_w[:rank].to(dtype))
        if has_bias:
            new.kv_down.bias.copy_(down_b[:rank].to(dtype))
        new.up_k.copy_(up_k[:, :rank].reshape(kv, head_dim, rank).to(dtype))
        new.up_v.copy_(up_v[:, :rank].reshape(kv, head_dim, rank).to(dtype))
        new.rope_mix.copy_(e.to(dtype))
        new.nope_proj.copy_(p.to(dtype))
        layer.self_attn = new.to(attn.q_proj.weight.device)


MLA_PARAMS = (".self_attn.kv_down.", ".self_attn.up_k", ".self_attn.up_v", ".self_attn.rope_mix",
              ".self_attn.nope_proj")
"""Substrings of the state-dict keys an MLA conversion adds (what :func:`load_mla` restores)."""


def load_mla(model, path) -> None:
    """Re-apply a conversion saved with ``save_pretrained`` to ``model``, just loaded from ``path`` as the GQA model
    (its config records ``kv_lora_rank``, ``qk_rope_head_dim`` and ``kvlearn_mla_variant``): rebuild every
    :class:`~kvlearn.kaizen.mla_attention.MLAAttention` and load its tensors. :func:`kvlearn.load` calls it."""
    from ..hf import load_added_weights
    from .mla_attention import MLAAttention

    cfg = model.config
    rank, rope_dim = getattr(cfg, "kv_lora_rank", None), getattr(cfg, "qk_rope_head_dim", None)
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    check_rank(rank, kv, head_dim)
    check_rope_dim(rope_dim, kv, head_dim)
    check(not is_mla(model), "the model is already converted to MLA")
    for layer in model.model.layers:
        attn = layer.self_attn
        layer.self_attn = MLAAttention(attn, rank, rope_dim, attn.k_proj.bias is not None).to(attn.q_proj.weight.device)
    load_added_weights(model, str(path), lambda k: any(n in k for n in MLA_PARAMS), "MLA checkpoint",
                       "expected a save_pretrained of a converted model")


__all__ = ["MLA_PARAMS", "VARIANTS", "calibrate", "check_rank", "check_rope_dim", "convert_to_mla", "factorise",
           "is_mla", "key_covariance", "load_mla", "rope_components"]
