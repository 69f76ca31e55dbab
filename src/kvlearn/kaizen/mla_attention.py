"""The attention of an MLA-converted layer (:func:`kvlearn.kaizen.mla.convert_to_mla`).

Per token it computes the latent ``c = kv_down(x)`` (width ``r``) and the shared RoPE key ``k_R = E · rope(knorm(
k_proj x))`` (width ``d_R``), and per query head ``q_h = qnorm(q_proj x)_h`` and ``q_R,h = E_g rope(q_h)``. Under a
rank action ``d`` only ``c[:d]`` and the first ``d`` columns of ``up_k``/``up_v`` are used (prefix truncation: one
converted model serves every width); under ``bits < 16`` ``c[:d]`` and ``k_R`` are fake-quantized (no cache) or held
by a packed :class:`~kvlearn.cache.latent.LatentStore` (cache), one scale per stored vector each.

The score of head ``h`` (KV group ``g``) with token ``t`` and the output are

    s = q_h · k̃_g,t + q_R,h · k_R,t,        k̃_g = P knorm(up_k,g[:, :d] c[:d])      (no-RoPE key, unrotated)
    o_h = Σ_t softmax(s · d_h^-1/2)_t  up_v,g[:, :d] c_t[:d]

(the GQA model's softmax scale is kept: the conversion is a reparameterisation). Two equal ways to compute it:

- **decompressed** (training / ``use_cache=False``, and every path of a model with ``k_norm``): expand ``c`` to the
  per-head ``k̃``, ``v`` and attend ``[q_h ; q_R,h]`` over ``[k̃_g ; k_R]``;
- **absorbed** (decoding through a cache, models without ``k_norm``: ``knorm`` = identity, ``P`` is folded into
  ``up_k`` at conversion): ``q̃_h = up_k,g[:, :d]ᵀ q_h``, attend ``[q̃_h ; q_R,h]`` over ``[c[:d] ; k_R]`` with the
  value ``c[:d]`` (MQA: one KV head of width ``d + d_R``), then ``o_h = up_v,g[:, :d] · (that)``. Never expands the
  cache. With ``k_norm`` (Qwen3) the key is nonlinear in ``c`` (the per-head RMS), so the decode decompresses
  ``c -> knorm(up_k c)`` per step (the value side could still be absorbed; not done).

Where the action comes from: a :class:`~kvlearn.kaizen.cache.KaizenCache` or ``kaizen_config=`` (the
:func:`kvlearn.kaizen.attach` hook passes ``kaizen_forward``); with neither, the full latent at 16 bits. Any other
transformers ``Cache`` (``DynamicCache``) stores ``(k_R, c)`` as one KV head. The selector's training mixture
(``kaizen_train``) mixes the prefix-masked, fake-quantized latents (:meth:`MLAAttention.mixture`).

**Share (depth).** A sharing layer attends its own queries over its anchor's latent of this forward (fake-quantized,
or read from its store), with the *anchor's* up-projections and RoPE mixing (the sharer's own ``kv_down``/``up_*``/
``E`` are unused; it keeps no cache: a ``BorrowedLayer``). The anchor fills the forward's anchor dictionary only when
a later layer shares it, in one of two equal forms:

- **absorbed**, when the anchor itself attends absorbed (through a cache, no ``k_norm``): a :class:`SharedLatent`,
  the anchor's ``up_k[..., :d]``, ``up_v[..., :d]`` ``[n_kv, d_h, d]``, ``E`` ``[d_R, n_kv d_h]``, ``k_R [B, 1, S,
  d_R]``, ``c[:d] [B, 1, S, d]`` and mask. The sharer's head ``h`` (KV group ``g`` of the anchor: the same head
  layout) attends ``[up_k,g[:, :d]ᵀ q_h ; E_g rope(q_h)]`` over ``[c[:d] ; k_R]`` with value ``c[:d]`` (its own
  softmax scale), then ``o_h = up_v,g[:, :d] · (that)`` (:func:`absorbed_attention`, the anchor's own decode too).
  Never expands the latent.
- **decompressed** otherwise (no cache, or an anchor with ``k_norm``): ``(K, V, mask)``, the latent expanded into the
  layer-independent form of :meth:`MLAAttention.full_keys`, ``K = [k̃ ; Eᵀk_R] [B, n_kv, S, 2 d_h]`` per KV head and
  ``V [B, n_kv, S, d_h]``, attended by ``[q_h ; rope(q_h)]`` (``rope(q_h)·(Eᵀk_R)_g = q_R,h·k_R``).

(The alternative, the anchor's latent expanded with the sharer's own up-projections, is not built.) Not built yet for
MLA: evicting policies.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from ..cache import CompactCache
from ..errors import check
from ..hf import masked_attention
from ..ops.quant import fake_quantize


class SharedLatent(NamedTuple):
    """What an anchor that attends absorbed puts in the forward's anchor dictionary for the layers sharing it
    (module docstring, "Share (depth)"): its up-projections' first ``d`` columns ``up_k``, ``up_v`` ``[n_kv, d_h,
    d]``, its RoPE mixing ``rope_mix`` (``E [d_R, n_kv d_h]``), the latent of this forward ``k_r [B, 1, S, d_R]``,
    ``c [B, 1, S, d]`` and the boolean ``mask [B | 1, 1 | P, T, S]``. Per-forward state only."""

    up_k: torch.Tensor
    up_v: torch.Tensor
    rope_mix: torch.Tensor
    k_r: torch.Tensor
    c: torch.Tensor
    mask: torch.Tensor


def rope_query(rope_mix: torch.Tensor, q_rot: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``q_R,h = E_g rope(q_h)``: ``rope_mix`` ``E [d_R, n_kv d_h]``, ``q_rot`` ``rope(q) [B, Hq, T, d_h]`` (head
    ``h`` in KV group ``g = h // (Hq / n_kv)``) -> ``[B, Hq, T, d_R]``."""
    b, hq, t, dh = q_rot.shape
    e = rope_mix.view(rope_mix.shape[0], num_kv_heads, dh)
    q = q_rot.reshape(b, num_kv_heads, hq // num_kv_heads, t, dh)
    return torch.einsum("rgd,bgjtd->bgjtr", e, q).reshape(b, hq, t, -1)


def absorbed_attention(q, q_r, k_r, c, mask, up_k, up_v, scaling) -> torch.Tensor:
    """The absorbed MLA attention (module docstring) of the queries ``q [B, Hq, T, d_h]`` (unrotated) and ``q_r
    [B, Hq, T, d_R]`` over the latent ``k_r [B, 1, S, d_R]``, ``c [B, 1, S, d]`` with the up-projections ``up_k``,
    ``up_v`` ``[n_kv, d_h, d]`` (the first ``d`` columns) and the boolean ``mask``: ``q̃_h = up_k,g[:, :d]ᵀ q_h``,
    MQA of ``[q̃_h ; q_R,h]`` over ``[c ; k_R]`` with value ``c``, then ``o_h = up_v,g · (that)``. Returns ``[B, T,
    Hq, d_h]``. An anchor's own decode, and a sharing layer's over its anchor's :class:`SharedLatent`."""
    b, hq, t, dh = q.shape
    kv, d = up_k.shape[0], c.shape[-1]
    g = hq // kv
    qa = torch.einsum("bgjtx,gxr->bgjtr", q.view(b, kv, g, t, dh), up_k).reshape(b, hq, t, d)
    out = masked_attention(torch.cat([qa, q_r], dim=-1), torch.cat([c, k_r], dim=-1), c, mask, scaling)
    out = torch.einsum("btgjr,gxr->btgjx", out.view(b, t, kv, g, d), up_v)
    return out.reshape(b, t, hq, dh)


class MLAAttention(nn.Module):
    """The MLA replacement of a GQA attention module ``orig`` (keeps its ``q_proj``, ``q_norm``, ``k_proj``,
    ``k_norm``, ``o_proj``; drops ``v_proj``). Weights are filled by :func:`~kvlearn.kaizen.mla.convert_to_mla`.

    Attributes: ``kv_down`` (hidden -> ``r``), ``up_k``/``up_v`` ``[n_kv, d_h, r]``, buffers ``rope_mix`` (``E
    [d_R, n_kv d_h]``) and ``nope_proj`` (``P [n_kv d_h, n_kv d_h]``); ``absorb``: decode through a cache with the
    absorbed query (True unless the model has ``k_norm``; tests switch it)."""

    def __init__(self, orig: nn.Module, rank: int, rope_dim: int, bias: bool):
        super().__init__()
        cfg = orig.config
        self.config = cfg
        self.layer_idx = orig.layer_idx
        self.head_dim = orig.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.num_key_value_groups = self.num_heads // self.num_kv_heads
        self.scaling = orig.scaling
        self.is_causal = True
        self.rank, self.rope_dim = rank, rope_dim
        self.q_proj, self.k_proj, self.o_proj = orig.q_proj, orig.k_proj, orig.o_proj
        self.q_norm = orig.q_norm if getattr(orig, "q_norm", None) is not None else nn.Identity()
        self.has_k_norm = getattr(orig, "k_norm", None) is not None
        self.k_norm = orig.k_norm if self.has_k_norm else nn.Identity()
        dtype, hidden = orig.q_proj.weight.dtype, orig.q_proj.weight.shape[1]
        kv, dh = self.num_kv_heads, self.head_dim
        self.kv_down = nn.Linear(hidden, rank, bias=bias, dtype=dtype)
        self.up_k = nn.Parameter(torch.zeros(kv, dh, rank, dtype=dtype))
        self.up_v = nn.Parameter(torch.zeros(kv, dh, rank, dtype=dtype))
        self.register_buffer("rope_mix", torch.zeros(rope_dim, kv * dh, dtype=dtype))
        self.register_buffer("nope_proj", torch.zeros(kv * dh, kv * dh, dtype=dtype))
        self.absorb = not self.has_k_norm

    @property
    def widths(self) -> tuple[int, ...]:
        r = self.rank
        return (r // 8, r // 4, r // 2, r)

    # ----- the action of this layer -----
    def _action(self, kwargs) -> tuple[int, int]:
        """``(d, bits)`` of this layer (module docstring)."""
        forward = kwargs.get("kaizen_forward")
        if forward is None:
            return self.rank, 16
        action = forward.config.actions[self.layer_idx]
        d = self.rank if action.rank is None else action.rank
        check(d in self.widths, f"layer {self.layer_idx}: rank={d} is invalid: expected one of "
                                f"{', '.join(map(str, self.widths))} (r={self.rank})")
        return d, action.bits

    # ----- the pieces -----
    def project(self, hidden_states, position_embeddings):
        """``(q [B, Hq, T, d_h] unrotated, rope(q), q_R [B, Hq, T, d_R], k_R [B, 1, T, d_R], c [B, 1, T, r])``."""
        b, t, _ = hidden_states.shape
        kv, dh = self.num_kv_heads, self.head_dim
        q = self.q_norm(self.q_proj(hidden_states).view(b, t, -1, dh)).transpose(1, 2)
        k = self.k_norm(self.k_proj(hidden_states).view(b, t, -1, dh)).transpose(1, 2)
        cos, sin = position_embeddings
        q_rot, k_rot = apply_rotary_pos_emb(q, k, cos, sin)
        e = self.rope_mix.view(self.rope_dim, kv, dh)
        k_r = torch.einsum("rgd,bgtd->btr", e, k_rot)[:, None]
        q_r = rope_query(self.rope_mix, q_rot, kv)
        c = self.kv_down(hidden_states)[:, None]
        return q, q_rot, q_r, k_r, c

    def expand(self, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``c [B, 1, S, d]`` -> the no-RoPE keys ``k̃ [B, n_kv, S, d_h]`` and values ``v [B, n_kv, S, d_h]``."""
        d = c.shape[-1]
        b, _, s, _ = c.shape
        k = torch.einsum("gxr,bsr->bgsx", self.up_k[..., :d], c[:, 0])
        if self.has_k_norm:  # the norm needs the whole pre-norm head; then drop the RoPE components
            k = self.k_norm(k)
            k = (k.transpose(1, 2).reshape(b, s, -1) @ self.nope_proj.T).view(b, s, self.num_kv_heads, -1)
            k = k.transpose(1, 2)
        v = torch.einsum("gxr,bsr->bgsx", self.up_v[..., :d], c[:, 0])
        return k, v

    def full_keys(self, k_r: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer-independent form of ``(k_R, c[:d])``: ``K = [k̃_g ; (Eᵀ k_R)_g] [B, n_kv, S, 2 d_h]`` and ``V``,
        attended by ``[q_h ; rope(q_h)]`` (``rope(q_h)·(Eᵀk_R)_g = q_R,h·k_R``). What a sharing layer attends: it
        needs neither the anchor's ``E`` nor its up-projections."""
        k, v = self.expand(c)
        b, kv, s, dh = k.shape
        k_rope = torch.einsum("rgd,bsr->bgsd", self.rope_mix.view(self.rope_dim, kv, dh), k_r[:, 0])
        return torch.cat([k, k_rope], dim=-1), v

    def attend_decompressed(self, q, q_r, k_r, c, mask):
        k, v = self.expand(c)
        b, kv, s, _ = k.shape
        key = torch.cat([k, k_r.expand(b, kv, s, self.rope_dim)], dim=-1)
        return masked_attention(torch.cat([q, q_r], dim=-1), key, v, mask, self.scaling)  # [B, T, Hq, d_h]

    def attend_absorbed(self, q, q_r, k_r, c, mask):
        d = c.shape[-1]
        return absorbed_attention(q, q_r, k_r, c, mask, self.up_k[..., :d], self.up_v[..., :d], self.scaling)

    def shared_latent(self, k_r: torch.Tensor, c: torch.Tensor, mask: torch.Tensor) -> SharedLatent:
        """This anchor's latent ``(k_R, c[:d])`` of the forward as a :class:`SharedLatent` for the layers sharing it."""
        d = c.shape[-1]
        return SharedLatent(self.up_k[..., :d], self.up_v[..., :d], self.rope_mix, k_r, c, mask)

    def attend_shared(self, q, q_rot, shared: SharedLatent):
        """This (sharing) layer's queries ``q``, ``rope(q)`` ``[B, Hq, T, d_h]`` over its anchor's latent, absorbed
        with the anchor's projections: ``q_R,h = E_anchor,g rope(q_h)``. Returns ``[B, T, Hq, d_h]``."""
        q_r = rope_query(shared.rope_mix, q_rot, shared.up_k.shape[0])
        return absorbed_attention(q, q_r, shared.k_r, shared.c, shared.mask, shared.up_k, shared.up_v, self.scaling)

    def mixture(self, state, k_r: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The selector's training mixture (``kaizen_train``, :class:`~kvlearn.kaizen.sharing.KaizenTrainForward`),
        as :meth:`full_keys` ``(K, V)``: the own actions mixed in latent space, ``Σ_a w_a (fq(k_R, b_a), fq(c ⊙
        1[:d_a], b_a))`` (prefix mask: zeros after ``d_a``, so every candidate keeps the full shape; the per-vector
        quantizer gives ``fq(c[:d])`` padded with zeros), expanded once, plus ``w_share · carried`` (the previous
        layer's ``(K, V)``: by induction the anchor's). With one-hot weights this is the chosen configuration's
        forward per row (a row that shares expands a zero latent: ``K = V = 0`` before adding the carried)."""
        w = state.weights[:, self.layer_idx].to(c.dtype)  # [B, A]
        k_mix, c_mix = torch.zeros_like(k_r), torch.zeros_like(c)
        coords = torch.arange(self.rank, device=c.device)
        w_share = None
        for a, action in enumerate(state.space):
            wa = w[:, a].view(-1, 1, 1, 1)
            if action.share:
                w_share = wa if w_share is None else w_share + wa
                continue
            d = self.rank if action.rank is None else action.rank
            check(d in self.widths, f"layer {self.layer_idx}: rank={d} is invalid: expected one of "
                                    f"{', '.join(map(str, self.widths))} (r={self.rank})")
            k_mix = k_mix + wa * fake_quantize(k_r, action.bits)
            c_mix = c_mix + wa * fake_quantize(c * (coords < d).to(c.dtype), action.bits)
        key, value = self.full_keys(k_mix, c_mix)
        if w_share is not None and state.carried is not None:  # layer 0: share is masked (weight 0)
            key, value = key + w_share * state.carried[0], value + w_share * state.carried[1]
        state.carried = (key, value)
        return key, value

    def forward(self, hidden_states, position_embeddings, attention_mask, past_key_values=None, **kwargs):
        b, t, _ = hidden_states.shape
        l = self.layer_idx
        q, q_rot, q_r, k_r, c = self.project(hidden_states, position_embeddings)
        cache = kwargs.get("kvlearn_cache")
        train, forward = kwargs.get("kaizen_train"), kwargs.get("kaizen_forward")
        if train is not None:
            check(forward is None and cache is None,
                  "kaizen_train is for use_cache=False training forwards without kaizen_config: pass one of them")
            key, value = self.mixture(train, k_r, c)
            mask = _bool_mask(attention_mask, t, t, c.device)
            out = masked_attention(torch.cat([q, q_rot], dim=-1), key, value, mask, self.scaling)
            return self.o_proj(out.reshape(b, t, -1)), None
        if forward is not None and forward.config.actions[l].share:  # the anchor's latent or (K, V, mask)
            anchor = forward.config.anchor_of(l)
            check(anchor in forward.shared, f"layer {l} shares layer {anchor}, which has not run in this forward")
            if isinstance(cache, CompactCache):
                cache.update(k_r, c, l)  # a BorrowedLayer: writes nothing
            shared = forward.shared[anchor]
            if isinstance(shared, SharedLatent):
                out = self.attend_shared(q, q_rot, shared)
            else:
                key, value, mask = shared
                out = masked_attention(torch.cat([q, q_rot], dim=-1), key, value, mask, self.scaling)
            return self.o_proj(out.reshape(b, t, -1)), None
        d, bits = self._action(kwargs)
        c = c[..., :d]
        if isinstance(cache, CompactCache):
            from ..cache.latent import LatentStore

            layer = cache.layers[l]
            store = getattr(layer, "store", None)
            check(isinstance(store, LatentStore) and store.rank == d and store.bits == bits,
                  f"layer {l}: the cache layer is not a LatentStore of rank {d} at {bits} bits: build it "
                  "with kvlearn.kaizen.make_cache for this MLA model")
            k_r, c = cache.update(k_r, c, l)
            step = cache.step
            mask = layer.visibility_mask(step.positions, step.has_padding)
            absorb = self.absorb
        elif past_key_values is not None:  # a transformers cache: (k_R, c[:d]) as one KV head
            check(bits == 16, f"layer {l}: bits={bits} needs a KaizenCache (a plain transformers cache holds the "
                              "model dtype)")
            k_r, c = past_key_values.update(k_r, c, l)
            mask = _bool_mask(attention_mask, t, c.shape[2], c.device)
            absorb = self.absorb
        else:
            k_r, c = fake_quantize(k_r, bits), fake_quantize(c, bits)
            mask = _bool_mask(attention_mask, t, c.shape[2], c.device)
            absorb = False
        if forward is not None and l in forward.needed:  # a later layer shares this one (module docstring)
            forward.shared[l] = self.shared_latent(k_r, c, mask) if absorb else (*self.full_keys(k_r, c), mask)
        attend = self.attend_absorbed if absorb else self.attend_decompressed
        out = attend(q, q_r, k_r, c, mask)
        return self.o_proj(out.reshape(b, t, -1)), None


def _bool_mask(attention_mask, q: int, kv: int, device) -> torch.Tensor:
    """transformers' mask as ``[batch | 1, 1, q, kv]`` (``None``: causal, the queries the last ``q`` positions)."""
    if attention_mask is None:
        i = torch.arange(q, device=device)[:, None] + (kv - q)
        return (torch.arange(kv, device=device)[None, :] <= i)[None, None]
    if attention_mask.dim() == 2:  # a padding mask [batch, kv] (not expected from the model; be safe)
        causal = _bool_mask(None, q, kv, device)
        return causal & attention_mask.bool()[:, None, None, :]
    return attention_mask[..., -kv:]


__all__ = ["MLAAttention", "SharedLatent", "absorbed_attention", "rope_query"]
