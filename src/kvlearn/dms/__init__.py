"""DMS (Dynamic Memory Sparsification, Łańcucki et al. 2025, arXiv 2506.05345) as a kvlearn method:
:mod:`.gates` (the per-layer eviction gate), :mod:`.attention` (training attention, Gumbel-sigmoid, compression
loss), :mod:`.cache` (the inference policy on the scored-eviction base) and :mod:`.apply` (apply/load, registry)."""
