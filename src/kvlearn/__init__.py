"""kvlearn: learned KV-cache compression for Hugging Face transformers models.

The public API: configs, :func:`attach` (make a model run with kvlearn caches), the compact cache base and the
streaming cache. Method-specific modules live in ``kvlearn.kvpop``, ``kvlearn.eviction``, ``kvlearn.ops``.
"""

from .cache import CompactCache, CompactLayer
from .config import KVpopConfig, StreamingConfig
from .errors import KVLearnError
from .eviction.streaming import StreamingCache
from .hf import attach, load_model

__version__ = "0.1.0"

__all__ = [
    "CompactCache",
    "CompactLayer",
    "KVLearnError",
    "KVpopConfig",
    "StreamingCache",
    "StreamingConfig",
    "attach",
    "load_model",
    "__version__",
]
