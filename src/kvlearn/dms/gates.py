"""The DMS eviction gate (adapter variant of Łańcucki et al. 2025, arXiv 2506.05345, section 3.2; NVIDIA
Model-Optimizer ``experimental/dms``: ``dms_proj_alpha_norm`` + ``dms_proj_alpha``).

One :class:`DMSGate` per decoder layer, registered as ``self_attn.dms``. Input: the layer's *pre-input_layernorm*
residual stream ``[batch, T, hidden]``; output: the eviction logit ``[batch, kv_heads, T]`` float32::

    alpha = alpha_scale * proj(RMSNorm(h)) - alpha_offset        (reference: 100 * proj - 5)

``proj`` is ``Linear(hidden, kv_heads, bias=False)`` (the reference, ``gate_hidden = 0``) or, with ``gate_hidden =
m > 0``, ``Linear(hidden, m) -> SiLU -> Linear(m, kv_heads)``. The last linear layer is zero-initialised, so every
logit starts at ``-alpha_offset`` (keep every token). ``alpha[b, h, t]`` is produced at token ``t`` and decides
whether key ``t - 1`` is evicted (the shift by one lives in :mod:`kvlearn.dms.attention` and the cache).

Parameter counts (per layer; :func:`gate_parameter_count`): linear gate ``hidden + hidden * kv_heads``; MLP gate
``hidden + (hidden + 1) * m + (m + 1) * kv_heads``. KVpop's MLP scorer has ``kv_heads * (2D * 2D + 2 * 2D + 1)``
with ``2D = 2 * head_dim``; :func:`matched_gate_hidden` gives the ``m`` whose count is closest to a target, so the
two learned methods can be compared at matched size (docs/DESIGN.md, "DMS and StreamingLLM+").
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..errors import KVLearnError, check, check_int


MODULE_NAME = "dms"  # the submodule of each decoder layer's attention module


class DMSGate(nn.Module):
    """``forward(h [B, T, hidden]) -> alpha [B, kv_heads, T]`` float32 (see the module docstring)."""

    def __init__(self, hidden_size: int, num_kv_heads: int, gate_hidden: int = 0, alpha_scale: float = 100.0,
                 alpha_offset: float = 5.0, eps: float = 1e-6):
        super().__init__()
        check_int("gate_hidden", gate_hidden, 0)
        self.norm = nn.RMSNorm(hidden_size, eps=eps)
        if gate_hidden == 0:
            self.proj = nn.Linear(hidden_size, num_kv_heads, bias=False)
            last = self.proj
        else:
            self.proj = nn.Sequential(nn.Linear(hidden_size, gate_hidden), nn.SiLU(), nn.Linear(gate_hidden, num_kv_heads))
            last = self.proj[2]
        nn.init.zeros_(last.weight)
        if last.bias is not None:
            nn.init.zeros_(last.bias)
        self.gate_hidden, self.num_kv_heads = gate_hidden, num_kv_heads
        self.alpha_scale, self.alpha_offset = float(alpha_scale), float(alpha_offset)

    def forward(self, hidden: Tensor) -> Tensor:
        with torch.autocast(device_type=hidden.device.type, enabled=False):  # rule 5: gate logits in float32
            x = self.proj(self.norm(hidden.float()))  # [B, T, kv_heads]
            return (self.alpha_scale * x - self.alpha_offset).transpose(1, 2).contiguous()

    def extra_repr(self) -> str:
        return f"gate_hidden={self.gate_hidden}, alpha = {self.alpha_scale:g} * proj - {self.alpha_offset:g}"


def gate_parameter_count(hidden_size: int, num_kv_heads: int, gate_hidden: int = 0) -> int:
    """Parameters of one :class:`DMSGate` (RMSNorm weight included)."""
    if gate_hidden == 0:
        return hidden_size + hidden_size * num_kv_heads
    return hidden_size + (hidden_size + 1) * gate_hidden + (gate_hidden + 1) * num_kv_heads


def kvpop_mlp_parameter_count(num_kv_heads: int, head_dim: int) -> int:
    """Parameters of one KVpop :class:`~kvlearn.kvpop.scorers.MLPScorer` at its default width ``2 * head_dim``."""
    c = 2 * head_dim
    return num_kv_heads * (c * c + c + c + 1)


def matched_gate_hidden(hidden_size: int, num_kv_heads: int, target: int) -> int:
    """The ``gate_hidden`` whose :func:`gate_parameter_count` is closest to ``target`` (0 = the linear gate, if that
    is closest)."""
    best = min(range(0, 4 * hidden_size + 1),
               key=lambda m: (abs(gate_parameter_count(hidden_size, num_kv_heads, m) - target), m))
    return best


def decoder_layers(model) -> list[nn.Module]:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    check(layers is not None and len(layers) > 0 and all(hasattr(layer, "self_attn") for layer in layers),
          f"{type(model).__name__} has no decoder layers with a self_attn module: expected a causal LM of a "
          "supported family")
    return list(layers)


def has_dms(model) -> bool:
    """Whether :func:`apply_dms` has put DMS gates on ``model``."""
    try:
        return all(isinstance(getattr(layer.self_attn, MODULE_NAME, None), DMSGate) for layer in decoder_layers(model))
    except KVLearnError:
        return False


def dms_gates(model) -> list[DMSGate]:
    """Layer ``i``'s gate; a one-line error for a model without them."""
    check(has_dms(model), f"{type(model).__name__} has no DMS gates: call kvlearn.dms.apply.apply_dms(model, config) first")
    return [getattr(layer.self_attn, MODULE_NAME) for layer in decoder_layers(model)]
