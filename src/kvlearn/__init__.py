"""kvlearn: learned KV-cache compression for Hugging Face transformers models.

The public API: configs, :func:`attach` (make a model run with kvlearn caches), the compact cache base, the
streaming cache, :func:`apply_kvpop` / :func:`make_kvpop_cache` (KVpop's learned modules and cache),
:func:`apply_dms` / :func:`make_dms_cache` with :class:`DMSConfig` (DMS's learned gates and cache) and
:func:`load` (= :func:`load_model`: a checkpoint folder, with KVpop or DMS re-applied when it was saved with it;
:mod:`kvlearn.checkpoint`); and, imported on first use, training (:func:`retrofit` with :class:`RetrofitConfig`,
:func:`kaizen_train` with :class:`KaizenTrainConfig`), evaluation (:func:`evaluate` with :class:`EvalConfig`) and
the method registry (:func:`get_method`, :func:`make_config`). Method-specific modules live in ``kvlearn.kvpop``,
``kvlearn.eviction``, ``kvlearn.ops``.
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

# Training and evaluation, imported on first use (``kvlearn.retrofit``, ...) so that ``import kvlearn`` stays light:
# name -> (module, attribute).
LAZY = {
    "RetrofitConfig": ("kvlearn.train.distill", "RetrofitConfig"),
    "retrofit": ("kvlearn.train.distill", "retrofit"),
    "KaizenTrainConfig": ("kvlearn.train.kaizen_train", "KaizenTrainConfig"),
    "kaizen_train": ("kvlearn.train.kaizen_train", "kaizen_train"),
    "EvalConfig": ("kvlearn.eval.accuracy", "EvalConfig"),
    "evaluate": ("kvlearn.eval.accuracy", "evaluate"),
    "get_method": ("kvlearn.methods", "get_method"),
    "make_config": ("kvlearn.methods", "make_config"),
}


def __getattr__(name: str):
    if name in LAZY:
        import importlib

        module, attribute = LAZY[name]
        return getattr(importlib.import_module(module), attribute)
    raise AttributeError(f"module 'kvlearn' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(LAZY))

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
    *LAZY,
]
