"""kvlearn: learned KV-cache compression for Hugging Face transformers models.

The public API: configs, :func:`attach` (make a model run with kvlearn caches), the compact cache base, the
streaming cache, :func:`apply_kvpop` / :func:`make_kvpop_cache` (KVpop's learned modules and cache),
:func:`apply_dms` / :func:`make_dms_cache` with :class:`DMSConfig` (DMS's learned gates and cache) and
:func:`load` (= :func:`load_model`: a checkpoint folder, with KVpop or DMS re-applied when it was saved with it;
:mod:`kvlearn.checkpoint`). Method-specific modules live in ``kvlearn.kvpop``, ``kvlearn.eviction``, ``kvlearn.ops``.
"""

from .cache import CompactCache, CompactLayer
from .config import DMSConfig, KVpopConfig, StreamingConfig
from .errors import KVLearnError
from .eviction.streaming import StreamingCache
from .checkpoint import load
from .hf import attach
from .dms.apply import apply_dms, make_dms_cache
from .kvpop.apply import apply_kvpop, make_kvpop_cache

load_model = load

__version__ = "0.1.0"

__all__ = [
    "CompactCache",
    "CompactLayer",
    "DMSConfig",
    "KVLearnError",
    "KVpopConfig",
    "StreamingCache",
    "StreamingConfig",
    "apply_dms",
    "apply_kvpop",
    "attach",
    "load",
    "load_model",
    "make_dms_cache",
    "make_kvpop_cache",
    "__version__",
]
