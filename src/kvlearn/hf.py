"""What every method shares to sit inside a Hugging Face model.

- :data:`SUPPORTED_MODEL_TYPES`: the decoder families whose attention calls ``past_key_values.update`` then the
  registered attention function with ``[batch, heads, seq, head_dim]`` tensors (Qwen3, Qwen2, Llama, Mistral).
- :func:`attach`: registers the ``"kvlearn"`` attention function with transformers' ``AttentionInterface`` (and a
  mask function with ``AttentionMaskInterface``), switches the model to it and adds one forward pre-hook to the
  top-level model. Nothing is patched globally and nothing is stored on modules between calls: the hook only hands
  the padding mask of each forward to the kvlearn cache passed in ``past_key_values`` and passes that cache on to
  the attention function as the keyword ``kvlearn_cache``.
- :func:`kvlearn_attention`: with a kvlearn cache it attends over the keys the cache returned under the cache's
  visibility mask; without one (training, dense evaluation, a plain ``DynamicCache``) it is transformers' SDPA
  attention unchanged.
"""

from __future__ import annotations

import logging
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from .cache import ChunkRetention, CompactCache
from .cache.observe import attention_summary
from .errors import KVLearnError, check, check_int

ATTENTION_NAME = "kvlearn"
MAX_MASK_BYTES = 512 * 2**20  # masked_attention: the largest float mask SDPA may build before the queries are chunked
BROADCAST_MIN_QUERIES = 64  # masked_attention: from this many queries, one KV head broadcasts instead of folding (CUDA)
SPARSE_CHUNK_MIN_QUERIES = 8192  # chunk_attention="auto": from this many CUDA queries, sparse_chunk_attention
SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral")


def check_supported(model) -> None:
    """Raise a one-line error unless ``model`` is a decoder of a supported family with full attention only."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    check(
        model_type in SUPPORTED_MODEL_TYPES,
        f"model type {model_type!r} is not supported: expected one of {', '.join(SUPPORTED_MODEL_TYPES)}",
    )
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    other = sorted(set(layer_types) - {"full_attention"})
    check(not other, f"layer types {other} are not supported: kvlearn compresses full-attention layers only")


def register_attention() -> None:
    """Register the ``"kvlearn"`` attention and mask functions with transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, kvlearn_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def _route_cache_hook(module, args, kwargs):
    cache = kwargs.get("past_key_values")
    if not isinstance(cache, CompactCache):
        return None
    ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    ref = ids if ids is not None else embeds
    check(ref is not None, "a kvlearn cache needs input_ids or inputs_embeds passed by keyword")
    cache.check_model(module.config.num_hidden_layers, module)
    cache.begin_forward(kwargs.get("attention_mask"), ref.shape[0], ref.shape[1], ref.device)
    kwargs = dict(kwargs)
    kwargs["kvlearn_cache"] = cache
    # The padding mask is consumed: with a kvlearn cache every attention attends under the cache's own visibility,
    # so transformers need not build its [batch, 1, q, capacity + q] mask (1 GB of booleans for a 32k-token prompt).
    # A 4-D mask passes through transformers' mask creation as it is; no kvlearn attention reads it.
    kwargs["attention_mask"] = torch.ones(ref.shape[0], 1, 1, 1, dtype=torch.bool, device=ref.device)
    return args, kwargs


def attach(model):
    """Make ``model`` able to run with kvlearn caches (and keep running normally without them). Returns ``model``."""
    check_supported(model)
    register_attention()
    model.set_attn_implementation(ATTENTION_NAME)
    if not any(h is _route_cache_hook for h in model._forward_pre_hooks.values()):
        model.register_forward_pre_hook(_route_cache_hook, with_kwargs=True)
    return model


def kvlearn_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    kvlearn_cache: CompactCache | None = None,
    **kwargs,
):
    """Attention over a compact cache.

    Args:
        query: ``[batch, q_heads, q, head_dim]`` (after RoPE).
        key, value: ``[batch, kv_heads, kv, head_dim]`` as returned by the cache's ``update``.
        attention_mask: transformers' mask, used only without a kvlearn cache.
    Returns:
        ``(out [batch, q, q_heads, head_dim], None)``.

    After attending, a layer whose policy requests attention (TOVA, H2O, SnapKV) gets it back
    (:func:`kvlearn.cache.observe.attention_summary`, blockwise, float32, per KV head) through
    ``layer.observe_attention``; a policy that requests nothing costs nothing extra.
    """
    if kvlearn_cache is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    step = kvlearn_cache.step
    layer = kvlearn_cache.layers[module.layer_idx]
    check(not getattr(layer, "borrows", False),
          f"layer {module.layer_idx} shares its anchor's cache: run the model with kvlearn.kaizen.attach(model)")
    sparse = sparse_chunk_visibility(kvlearn_cache, layer, query, step)
    if sparse is not None:  # a long multi-token forward of a static-score policy: no [q, capacity + q] mask
        return sparse_chunk_attention(sparse, query, key, value, scaling), None
    mask = layer.visibility_mask(step.positions, step.has_padding)  # [batch, P, q, kv]
    if layer.store_attends:  # a decode step over a store that attends itself (packed codes, no read-back)
        return store_decode_attention(layer, query, mask, scaling), None
    out = masked_attention(query, key, value, mask, scaling)
    if layer.policy.observes:  # the policy evicts after attending
        request = layer.policy.attention_request(step)
        attention = None if request is None else attention_summary(query, key, mask, scaling, request, step.positions)
        layer.observe_attention(step, attention)
    return out, None


class SparseChunk(NamedTuple):
    """A multi-token forward's visibility as sparse retention over one sequence (:func:`sparse_chunk_visibility`):
    the layer's :class:`~kvlearn.cache.ChunkRetention` and ``held``, the tokens every row and KV head held before
    the forward (so the sequence is ``T = held + q`` keys long)."""

    retention: ChunkRetention
    held: int


def sparse_chunk_visibility(cache: CompactCache, layer, query: torch.Tensor, step) -> SparseChunk | None:
    """The forward's visibility as a :class:`SparseChunk`, or None where the visibility mask is to be used.

    None unless the forward has several queries, the layer's visibility is a running top-k
    (``layer.chunk_retention``: a static-score policy under ``bounded``), no query is padding, nothing traces the
    masks, the cache's ``chunk_attention`` asks for it (``"sparse"``; ``"auto"``: CUDA queries, at least
    :data:`SPARSE_CHUNK_MIN_QUERIES` of them), and every row and KV head held as many tokens before the forward
    (one host sync counts them)."""
    q = query.shape[2]
    if q < 2:  # decoding: nothing more to read
        return None
    mode, ret = cache.chunk_attention, layer.chunk_retention
    if mode == "mask" or ret is None or layer.trace is not None or step.has_padding is not False:
        return None
    if mode == "auto" and not (query.is_cuda and q >= SPARSE_CHUNK_MIN_QUERIES):
        return None
    lo, hi = torch.stack(torch.aminmax(ret.held)).tolist()  # one read-back
    return SparseChunk(ret, hi) if lo == hi else None


def sparse_chunk_attention(sparse: SparseChunk, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           scaling: float | None) -> torch.Tensor:
    """A multi-token forward attended as sparse retention over one sequence, without the ``[batch, P, q, capacity +
    q]`` visibility mask: ``query [batch, q_heads, q, head_dim]``, ``key, value [batch, kv_heads, capacity + q,
    head_dim]`` (the keys the layer returned; a sharing layer passes its anchor's keys and :class:`SparseChunk`).
    Returns ``[batch, q, q_heads, head_dim]``.

    The held tokens followed by the chunk, in position order, are a sequence of ``T = held + q`` keys under the
    rule the policy ranked them by (sinks, window, running top-k), so the chunk's queries are its last ``q`` queries:
    the first ``held`` rows are zeros whose output is dropped (``held <=`` the budget). On CUDA
    :func:`kvlearn.ops.retention_attention.sparse_retention_attention` runs the fused Triton forward on the gathered layout
    (FlexAttention where it does not apply); elsewhere eager FlexAttention."""
    from .ops.retention_attention import sparse_retention_attention

    ret, held = sparse
    b, hkv = key.shape[:2]
    t = held + query.shape[2]
    order = ret.order[..., :t].expand(b, hkv, t)  # a policy with one set of slots for all heads (P = 1) broadcasts
    ks = torch.gather(key, 2, order[..., None].expand(b, hkv, t, key.shape[-1]))
    vs = torch.gather(value, 2, order[..., None].expand(b, hkv, t, value.shape[-1]))
    ranks, cutoffs = (x[..., :t].expand(b, hkv, t).contiguous() for x in (ret.ranks, ret.cutoffs))
    qs = torch.cat([query.new_zeros(b, query.shape[1], held, query.shape[-1]), query], dim=2) if held else query
    out, _ = sparse_retention_attention(qs, ks, vs, ranks, cutoffs, ret.sinks, ret.window, scale=scaling,
                                        return_lse=False, topk=ret.topk)
    return out[:, :, held:].transpose(1, 2).contiguous()


def store_decode_attention(layer, query: torch.Tensor, mask: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """A decode step attended inside ``layer``'s store (``layer.store_attends``): ``query [batch, q_heads, 1,
    head_dim]``, ``mask [batch, P, 1, capacity]``; returns ``[batch, 1, q_heads, head_dim]`` in the query dtype."""
    out = layer.store.decode_attention(query[:, :, 0], mask[:, :, 0], scaling)  # [batch, q_heads, head_dim] float32
    return out.to(query.dtype)[:, None].contiguous()


def masked_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                     scaling: float | None, *, max_mask_bytes: int | None = None,
                     broadcast: bool | None = None) -> torch.Tensor:
    """SDPA of ``query [batch, q_heads, q, head_dim]`` over ``key, value [batch, kv_heads, kv, head_dim]`` (GQA, not
    expanded) under the boolean ``mask [batch, P, q, kv]`` (``P`` = 1: one mask for every head, or ``kv_heads``).
    Returns ``[batch, q, q_heads, head_dim]`` (transformers' attention output layout).

    SDPA turns the boolean mask into a float bias (over every query head when the mask was expanded to them: a
    4096-token prefill at batch 8 asked the GPU for 18.5 GiB), so when that bias (:func:`query_rows_per_chunk`)
    would exceed ``max_mask_bytes`` (default :data:`MAX_MASK_BYTES`) the query axis goes through in chunks, each with its
    rows of the mask; query rows are independent, so the result is the same. The K/V are never expanded to the query
    heads: each KV head's group of query heads is folded into the query axis (:func:`_grouped_sdpa`). Expanding them
    had copied ``g`` times the whole cache per layer and call: at 131k tokens, 40 query heads over 8 KV heads of 128,
    2.7 GB of K/V per layer for every decode step of the read-back paths, the bf16 cache's included.

    One KV head under one shared mask (MQA: the absorbed MLA attention, 40 query heads over one latent head) is the
    exception. Folding repeats the mask over all ``q_heads`` rows of the fold, so a 512 MiB bias holds ``q_heads``
    times fewer query rows: at 131k keys, 25 rows per SDPA call and 164 calls per 4096-token prefill chunk, against
    1023 rows (5 calls) when the mask is not repeated. ``broadcast`` (default: on CUDA from
    :data:`BROADCAST_MIN_QUERIES` queries) instead hands SDPA the K/V as stride-0 views over the query heads and the
    mask unrepeated (:func:`_broadcast_sdpa`); nothing is copied. On the CPU SDPA's math path is slower with the
    broadcast views at decode (one query), so the fold stays the default there."""
    b, hq, q, _ = query.shape
    limit = MAX_MASK_BYTES if max_mask_bytes is None else check_int("max_mask_bytes", max_mask_bytes, 1)
    one_head = key.shape[1] == 1 and hq > 1 and mask.shape[1] == 1
    if broadcast is None:
        broadcast = query.is_cuda and q >= BROADCAST_MIN_QUERIES
    broadcast = broadcast and one_head
    attend = _broadcast_sdpa if broadcast else _grouped_sdpa
    kv_heads = hq if broadcast else key.shape[1]
    rows = query_rows_per_chunk(b, hq, kv_heads, mask.shape[1], key.shape[2], limit, query.is_cuda)
    if q <= rows:
        return attend(query, key, value, mask, scaling)
    per_row = mask.shape[2] == q  # a mask with one row broadcasts over the queries
    chunks = [attend(query[:, :, s:s + rows], key, value, mask[:, :, s:s + rows] if per_row else mask, scaling)
              for s in range(0, q, rows)]
    return torch.cat(chunks, dim=1)  # [batch, q, q_heads, head_dim]


def query_rows_per_chunk(batch: int, q_heads: int, kv_heads: int, mask_heads: int, kv: int, limit: int,
                         cuda: bool) -> int:
    """Query rows per SDPA call of :func:`masked_attention` so that the float mask stays within ``limit`` bytes.

    SDPA turns the boolean mask into a float bias of the mask's own shape, ``[batch, mask_heads, g * rows, kv]``
    after the fold (``g = q_heads / kv_heads``), so on CUDA a mask shared by every head (``mask_heads`` = 1) allows
    ``kv_heads`` times the rows of per-head masks. On the CPU SDPA's math path materialises the scores of every query
    head, ``[batch, q_heads, rows, kv]`` floats, so the bound counts every query head there."""
    heads = mask_heads * (q_heads // kv_heads) if cuda else q_heads
    return max(1, limit // max(1, batch * heads * kv * 4))


def _grouped_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                  scaling: float | None) -> torch.Tensor:
    """:func:`masked_attention` in one SDPA call: ``query [batch, q_heads, q, head_dim]``, ``key, value [batch,
    kv_heads, kv, head_dim]``, ``mask [batch, P, q or 1, kv]`` -> ``[batch, q, q_heads, head_dim]``.

    Query head ``i`` reads KV head ``i // g`` (``g = q_heads / kv_heads``), so the ``g`` query heads of a KV head
    become ``g * q`` rows of one query (group outermost) over that KV head's unexpanded keys. The mask follows: a
    mask with one row (a decode step) broadcasts over all of them as it is; a mask with ``q`` rows is repeated over
    the group (``g * q * kv`` booleans, against ``2 g kv head_dim`` K/V elements that expanding the K/V copied)."""
    b, hq, q, d = query.shape
    hkv = key.shape[1]
    g = hq // hkv
    qf = query.reshape(b, hkv, g * q, d)
    mf = mask
    if mask.shape[2] > 1 and g > 1:
        p, kv = mask.shape[1], mask.shape[-1]
        mf = mask[:, :, None].expand(b, p, g, q, kv).reshape(b, p, g * q, kv)
    out = F.scaled_dot_product_attention(qf, key, value, attn_mask=mf, scale=scaling).reshape(b, hq, q, -1)
    return out.transpose(1, 2).contiguous()


def _broadcast_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                    scaling: float | None) -> torch.Tensor:
    """:func:`masked_attention` of ``query [batch, q_heads, q, head_dim]`` over one KV head, ``key, value [batch, 1,
    kv, head_dim]``, under one shared ``mask [batch, 1, q or 1, kv]``, in one SDPA call: the K/V are stride-0 views
    over the query heads (no copy) and the mask broadcasts over them as it is -> ``[batch, q, q_heads, head_dim]``."""
    b, hq = query.shape[:2]
    k = key.expand(b, hq, *key.shape[2:])
    v = value.expand(b, hq, *value.shape[2:])
    out = F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scaling)
    return out.transpose(1, 2).contiguous()


class _ExpectedExtraKeysFilter(logging.Filter):
    """Drops transformers' load report when its only complaint is unexpected keys containing ``marker`` (the
    modules a method added, which its own loader restores)."""

    def __init__(self, marker: str | tuple[str, ...], dropped: tuple[str, ...] = ()):
        super().__init__()
        self.markers = (marker,) if isinstance(marker, str) else tuple(marker)
        self.dropped = tuple(dropped)

    def _expected(self, row: str) -> bool:
        if "UNEXPECTED" in row:
            return any(m in row for m in self.markers)
        return "MISSING" in row and any(m in row for m in self.dropped)

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if "LOAD REPORT" not in text:
            return True
        rows = [line for line in text.splitlines() if "|" in line and ("UNEXPECTED" in line or "MISSING" in line
                                                                          or "MISMATCH" in line)]
        return not rows or not all(self._expected(r) for r in rows)


# (attention implementation, its mask function) -> whether that mask function gives None for an unpadded sequence,
# as probed outside any trace or CUDA-graph capture (a memo of a pure function of those two: see unpadded_causal_masks)
_UNPADDED_PROBES: dict[tuple, bool] = {}


def unpadded_causal_masks(model) -> dict | None:
    """The ``attention_mask`` argument for a forward of unpadded sequences from position 0 without a cache (a
    training step): transformers' prepared per-layer-type mapping with every mask ``None``, which the model's attention
    reads as plain causal attention, so the forward does not build it. Building it costs a host sync in an eager
    step: ``find_packed_sequence_indices`` reads a device boolean to rule out packed sequences (transformers skips the
    read only while tracing or capturing a CUDA graph), so the host waits for the GPU to drain before it issues the
    rest of the forward, twice per distillation step (teacher and student).

    ``None`` (transformers builds the mask, as without this) unless it is exact: the model's config lists its
    ``layer_types`` (the forwards of transformers 5.17 that take a prepared mapping: Qwen2, Qwen3; Llama and Mistral
    do not) and every one is full attention (a sliding window needs its mask), and the model's mask function itself
    gives ``None`` for such a sequence (SDPA, flash and kvlearn's training attentions; eager attention needs its
    mask). The last is checked by building that mask for a 2-token sequence on the CPU: no device work.

    That check is only meaningful outside a trace: while a CUDA graph is being captured (or dynamo traces),
    transformers' SDPA mask function never skips the mask (it cannot rule out padding without reading the device), so
    the probe would build one and this would return ``None``: the captured forward would then build the full
    ``[B, 1, T, T]`` mask and run SDPA with it instead of its causal kernel (session 38: why the graphed distillation
    step of ``retrofit --cuda-graph-step``'s reference took 1.5x the eager one). So the probe's answer is kept per
    (attention implementation, its mask function) from a call outside any trace (the trainers' eager steps come before
    the capture), and a call inside one uses it; inside a trace with no earlier answer, ``None``."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, create_causal_mask
    from transformers.utils.import_utils import is_tracing

    config = model.config
    types = getattr(config, "layer_types", None)
    if not types or set(types) != {"full_attention"}:
        return None
    impl = config._attn_implementation
    key = (impl, ALL_MASK_ATTENTION_FUNCTIONS.get(impl))
    if key not in _UNPADDED_PROBES:
        if is_tracing():  # transformers would answer "build the mask" whatever the mask function does
            return None
        probe = create_causal_mask(config=config, inputs_embeds=torch.zeros(1, 2, 1), attention_mask=None,
                                   past_key_values=None, position_ids=None)
        _UNPADDED_PROBES[key] = probe is None
    return {"full_attention": None} if _UNPADDED_PROBES[key] else None


def _reason(err: BaseException) -> str:
    """An exception's cause in one line, without safetensors' generic prefix."""
    text = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return text.removeprefix("Error while deserializing header: ")


def read_model_config(path: str | os.PathLike):
    """The transformers config of the checkpoint folder ``path``, read before any weight loads; one-line
    :class:`KVLearnError` s for no such folder, no ``config.json``, one that is not valid JSON or unreadable, and an
    unsupported model family. The one folder check :func:`load_model`, the CLI and the trainers share."""
    import json

    from transformers import AutoConfig

    check(isinstance(path, (str, os.PathLike)), f"model path {path!r} is invalid: expected a checkpoint folder")
    path = os.fspath(path)
    check(os.path.isdir(path), f"model path {path!r} does not exist or is not a directory: expected a checkpoint folder")
    config_path = os.path.join(path, "config.json")
    check(os.path.isfile(config_path),
          f"model path {path!r} has no config.json: expected a transformers checkpoint folder")
    try:
        with open(config_path, encoding="utf-8") as f:
            json.load(f)
    except (ValueError, UnicodeDecodeError) as err:  # json.JSONDecodeError is a ValueError
        raise KVLearnError(f"config {config_path!r} is not valid JSON ({_reason(err)}): expected the JSON config that "
                           "save_pretrained writes") from None
    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError, KeyError) as err:
        raise KVLearnError(f"config {config_path!r} is unreadable ({_reason(err)}): expected the JSON config that "
                           "save_pretrained writes") from None
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise KVLearnError(
            f"model type {model_type!r} at {path!r} is not supported: expected one of {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return config


def load_model(path: str | os.PathLike, dtype: torch.dtype | None = None, device: str | torch.device = "cpu",
               extra_keys: str | tuple[str, ...] | None = None, dropped_keys: tuple[str, ...] = ()):
    """Load a causal LM checkpoint from a local directory (what ``save_pretrained`` writes), in eval mode.

    Every bad folder is a one-line :class:`KVLearnError` that names the path and what is wrong: no such folder, no
    ``config.json`` or one that is not valid JSON, an unsupported model family, no weights file, or a
    ``*.safetensors`` file that is empty, truncated or garbled.

    This loads the base model only, whatever method saved the checkpoint: :func:`kvlearn.load` also restores the
    modules a method added (KVpop's). ``extra_keys``: a substring (or a tuple of them) of state-dict keys the caller
    will load itself (e.g. ``".kvpop."``); ``dropped_keys``: substrings of keys a method removed (an MLA conversion's
    ``v_proj``), expected missing; transformers' load report is not printed when those are its only complaints.
    """
    from safetensors import SafetensorError, safe_open
    from transformers import AutoModelForCausalLM

    read_model_config(path)
    path = os.fspath(path)
    weight_names = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                    "pytorch_model.bin.index.json")
    check(any(os.path.isfile(os.path.join(path, name)) for name in weight_names),
          f"model path {path!r} has no weights: expected one of {', '.join(weight_names)} next to config.json")
    for name in sorted(os.listdir(path)):
        file = os.path.join(path, name)
        if name.endswith(".safetensors") and os.path.isfile(file):
            try:
                with safe_open(file, "pt"):  # reads the header and checks that the data covers the file exactly
                    pass
            except (SafetensorError, OSError) as err:
                raise KVLearnError(f"weights {file!r} ({os.path.getsize(file)} bytes) are unreadable ({_reason(err)}): "
                                   "expected a complete safetensors file (truncated or garbled?)") from None
    # keys the caller loads itself: keep transformers' load report from listing them as unexpected (only for this
    # call; a report about any other key still shows)
    report_logger = logging.getLogger("transformers.modeling_utils")
    expected_extra = _ExpectedExtraKeysFilter(extra_keys, dropped_keys) if extra_keys else None
    if expected_extra is not None:
        report_logger.addFilter(expected_extra)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, attn_implementation="sdpa")
    except (SafetensorError, OSError) as err:
        raise KVLearnError(f"model path {path!r} could not be loaded ({_reason(err)}): expected a complete "
                           "save_pretrained checkpoint") from None
    finally:
        if expected_extra is not None:
            report_logger.removeFilter(expected_extra)
    return model.to(device).eval()


def checkpoint_tensors(path: str, prefix_filter) -> dict[str, torch.Tensor]:
    """Tensors of the checkpoint folder ``path`` whose names pass ``prefix_filter`` (safetensors or .bin files)."""
    import os

    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    names = sorted(os.listdir(path))
    safetensors = [n for n in names if n.endswith(".safetensors")]
    for name in safetensors:
        with safe_open(os.path.join(path, name), "pt") as f:
            for key in f.keys():
                if prefix_filter(key):
                    out[key] = f.get_tensor(key)
    if not safetensors:
        for name in names:
            if name.startswith("pytorch_model") and name.endswith(".bin"):
                state = torch.load(os.path.join(path, name), map_location="cpu", weights_only=True)
                out.update({k: v for k, v in state.items() if prefix_filter(k)})
    return out


def load_added_weights(module: torch.nn.Module, path: str, select, what: str, mismatch_hint: str,
                       prefix: str = "") -> None:
    """Copy a method's added weights (KVpop's scorers, DMS's gates, Kaizen's selector) from checkpoint ``path`` into
    ``module``: every parameter or buffer ``key`` of ``module`` with ``select(prefix + key)`` gets the checkpoint
    tensor ``prefix + key``. One-line errors naming ``what`` (e.g. "KVpop checkpoint") when the names or shapes
    differ; ``mismatch_hint`` ends the missing/unexpected message (what the user should do)."""
    tensors = {k[len(prefix):]: v for k, v in checkpoint_tensors(path, lambda k: k.startswith(prefix) and select(k)).items()}
    own = {k: v for k, v in module.state_dict().items() if select(prefix + k)}
    missing, unexpected = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    check(not missing and not unexpected,
          f"{what} {path!r}: weights do not match (missing {[prefix + k for k in missing[:2]]}, unexpected "
          f"{[prefix + k for k in unexpected[:2]]}): {mismatch_hint}")
    for key, value in tensors.items():
        check(tuple(value.shape) == tuple(own[key].shape),
              f"{what} {path!r}: {prefix}{key} has shape {tuple(value.shape)} but the model expects "
              f"{tuple(own[key].shape)}: load it onto the base it was trained on")
    with torch.no_grad():
        for key, value in tensors.items():
            own[key].copy_(value.to(own[key].dtype))


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def copy_tokenizer_files(source, dest) -> None:
    """Copy the tokenizer files of checkpoint folder ``source`` (those it has) into folder ``dest``."""
    import os
    import shutil

    for name in TOKENIZER_FILES:
        if os.path.isfile(os.path.join(source, name)):
            shutil.copy2(os.path.join(source, name), os.path.join(dest, name))

