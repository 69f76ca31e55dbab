"""KV-Kaizen (issue #11): per-layer precision, MLA rank and cross-layer sharing under one budget in bits per token.

- :mod:`~kvlearn.kaizen.actions`: ``Backbone``, ``LayerAction``, ``KaizenConfig``, the action space, the cost model
  and feasible ranges;
- :mod:`~kvlearn.kaizen.budget`: the budget penalty and the adaptive rate multiplier;
- :mod:`~kvlearn.kaizen.cache`: ``KaizenCache``, the heterogeneous cache of a configuration;
- :mod:`~kvlearn.kaizen.sharing`: ``attach(model)`` and the attention function (fake quantization and the
  per-forward anchor dictionary for training, the cache for decoding).

- :mod:`~kvlearn.kaizen.selector`: the per-prompt selector (Gumbel straight-through, budget-conditioned);
- :mod:`~kvlearn.kaizen.apply`: the ``kaizen`` method (apply, save/load, per-prompt choices and caches);
  :mod:`~kvlearn.kaizen.fixed`: the ``kaizen_static`` and ``kaizen_random`` baselines;
  :mod:`~kvlearn.kaizen.prompt`: the per-prompt contract the harness batches by (one choice per row, read alone);
  :mod:`~kvlearn.kaizen.dp_search` and :mod:`~kvlearn.kaizen.dp_method`: the ``kaizen_dp`` baseline (per-layer loss
  increases on calibration rows, an exact DP under the budget);
  :mod:`~kvlearn.kaizen.compose` (with :mod:`~kvlearn.kaizen.compose_snapkv`, :mod:`~kvlearn.kaizen.compose_kvpop`):
  ``kaizen+snapkv`` and ``kaizen+kvpop``, eviction over a Kaizen configuration at one total factor;
- training: :mod:`kvlearn.train.kaizen_train` (``kvlearn kaizen-train``).

- :mod:`~kvlearn.kaizen.mla`: ``convert_to_mla`` (GQA -> MLA: shared decoupled RoPE key, balanced joint SVD / CARE);
  :mod:`~kvlearn.kaizen.mla_attention`: ``MLAAttention`` (prefix-truncated latent, absorbed or decompressed decode);
  the latent store is :class:`kvlearn.cache.LatentStore`.

The ``kaizen`` method and trainer take the rank axis on a model converted and saved beforehand (no CLI verb converts
yet). Not built yet for MLA: evicting policies.
"""
