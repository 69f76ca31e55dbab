"""KV-Kaizen (issue #11): per-layer precision, MLA rank and cross-layer sharing under one budget in bits per token.

- :mod:`~kvlearn.kaizen.actions`: ``Backbone``, ``LayerAction``, ``KaizenConfig``, the action space, the cost model
  and feasible ranges;
- :mod:`~kvlearn.kaizen.budget`: the budget penalty and the adaptive rate multiplier;
- :mod:`~kvlearn.kaizen.cache`: ``KaizenCache``, the heterogeneous cache of a configuration;
- :mod:`~kvlearn.kaizen.sharing`: ``attach(model)`` and the attention function (fake quantization and the
  per-forward anchor dictionary for training, the cache for decoding).

Not built yet: GQA -> MLA conversion and the latent store (rank axis), the selector, training.
"""
