"""kvlearn: learned KV-cache compression for Hugging Face transformers models.

The public API: configs, :func:`attach` (make a model run with kvlearn caches), the compact cache base, the
streaming cache, :func:`apply_kvpop` / :func:`make_kvpop_cache` (KVpop's learned modules and cache),
:func:`apply_dms` / :func:`make_dms_cache` with :class:`DMSConfig` (DMS's learned gates and cache) and
:func:`load` (= :func:`load_model`: a checkpoint folder, with KVpop or DMS re-applied when it was saved with it;
:mod:`kvlearn.checkpoint`); training (:func:`retrofit` with :class:`RetrofitConfig`,
:func:`kaizen_train` with :class:`KaizenTrainConfig`, a recipe of record from :func:`kaizen_recipe`), evaluation (:func:`evaluate` with :class:`EvalConfig`) and
the method registry (:func:`get_method`, :func:`make_config`). Method-specific modules live in ``kvlearn.kvpop``,
``kvlearn.eviction``, ``kvlearn.ops``. Every name is imported on first use.
"""

__version__ = "0.1.0"

# Every public name is imported on first use (``kvlearn.apply_kvpop``, ``from kvlearn import load``): ``import kvlearn``
# itself imports neither torch nor transformers, so that the JSON-only tools (``python -m kvlearn.eval.report``,
# ``kvlearn.eval.acceptance``, the ``python -m kvlearn.results`` merges of the device scripts) start in a fraction of a
# second instead of the seconds torch, dynamo and the transformers model code take: name -> (module, attribute).
LAZY = {
    "CompactCache": ("kvlearn.cache.layer", "CompactCache"),
    "CompactLayer": ("kvlearn.cache.layer", "CompactLayer"),
    "DMSConfig": ("kvlearn.config", "DMSConfig"),
    "KVpopConfig": ("kvlearn.config", "KVpopConfig"),
    "StreamingConfig": ("kvlearn.config", "StreamingConfig"),
    "KVLearnError": ("kvlearn.errors", "KVLearnError"),
    "StreamingCache": ("kvlearn.eviction.streaming", "StreamingCache"),
    "load": ("kvlearn.checkpoint", "load"),
    "load_model": ("kvlearn.checkpoint", "load"),
    "attach": ("kvlearn.hf", "attach"),
    "apply_dms": ("kvlearn.dms.apply", "apply_dms"),
    "make_dms_cache": ("kvlearn.dms.apply", "make_dms_cache"),
    "apply_kvpop": ("kvlearn.kvpop.apply", "apply_kvpop"),
    "make_kvpop_cache": ("kvlearn.kvpop.apply", "make_kvpop_cache"),
    # training and evaluation
    "RetrofitConfig": ("kvlearn.train.distill", "RetrofitConfig"),
    "retrofit": ("kvlearn.train.distill", "retrofit"),
    "KaizenTrainConfig": ("kvlearn.train.kaizen_train", "KaizenTrainConfig"),
    "kaizen_train": ("kvlearn.train.kaizen_train", "kaizen_train"),
    "kaizen_recipe": ("kvlearn.train.kaizen_recipes", "kaizen_recipe"),
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


__all__ = ["__version__", *LAZY]
