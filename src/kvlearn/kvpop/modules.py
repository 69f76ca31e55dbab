"""KVpop's learned modules on a model: one :class:`KVpopModules` (scorer + per-KV-head decay) registered as
``self_attn.kvpop`` on every decoder layer, and the accessors the cache and :mod:`kvlearn.kvpop.apply` share.

Parameters only; per-sequence state lives in :class:`~kvlearn.kvpop.cache.KVpopCache`.
"""

from __future__ import annotations

from torch import nn

from ..config import KVpopConfig
from ..errors import KVLearnError, check
from .policy import LearnedDecay
from .scorers import LinearScorer, MLPScorer, MLSTMScorer

MODULE_NAME = "kvpop"  # the submodule of each decoder layer's attention module


class KVpopModules(nn.Module):
    """One decoder layer's learned KVpop modules: ``scorer`` (``[B,H,T,D]`` key/value -> ``[B,H,T]`` float32 scores)
    and ``decay`` (``() -> log gamma [kv_heads]`` float32). Parameters only; no per-sequence state."""

    def __init__(self, config: KVpopConfig, num_kv_heads: int, head_dim: int):
        super().__init__()
        if config.scorer == "linear":
            self.scorer = LinearScorer(num_kv_heads, head_dim)
        elif config.scorer == "mlp":
            self.scorer = MLPScorer(num_kv_heads, head_dim)
        else:
            self.scorer = MLSTMScorer(num_kv_heads, head_dim, window=config.window,
                                      delayed_readout=config.delayed_readout, matmul_dtype=config.mlstm_matmul_dtype,
                                      skip=config.mlstm_skip, compile_mode=config.mlstm_compile_mode,
                                      use_norm=config.mlstm_use_norm, chunk_size=config.mlstm_chunk_size,
                                      value_dim=config.mlstm_value_dim, gate_softcap=config.mlstm_gate_softcap)
        self.decay = LearnedDecay(num_kv_heads, config.decay_min, config.decay_max, config.decay_init)
        self.scorer_kind = config.scorer

    def extra_repr(self) -> str:
        return f"scorer={self.scorer_kind!r}"


def attention_modules(model) -> list[nn.Module]:
    """Every decoder layer's attention module, in layer order."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    check(layers is not None and len(layers) > 0 and all(hasattr(layer, "self_attn") for layer in layers),
          f"{type(model).__name__} has no decoder layers with a self_attn module: expected a causal LM of a "
          "supported family")
    return [layer.self_attn for layer in layers]


def has_kvpop(model) -> bool:
    """Whether :func:`apply_kvpop` has put KVpop modules on ``model``."""
    try:
        return all(isinstance(getattr(a, MODULE_NAME, None), KVpopModules) for a in attention_modules(model))
    except KVLearnError:
        return False


def kvpop_modules(model) -> tuple[list[nn.Module], list[nn.Module]]:
    """``(scorers, decays)``: layer ``i``'s scorer and decay modules (registered on the model by
    :func:`apply_kvpop`); a one-line error for a model without them."""
    mods = [getattr(a, MODULE_NAME, None) for a in attention_modules(model)]
    check(all(isinstance(m, KVpopModules) for m in mods),
          f"{type(model).__name__} has no KVpop modules: call kvlearn.kvpop.apply.apply_kvpop(model, config) first")
    return [m.scorer for m in mods], [m.decay for m in mods]
