"""The distillation loss every trainer of this project uses: KL from the teacher's top-``k`` next-token distribution
to the student's, per supervised token (:func:`kd_loss`). A pure tensor function of logits and labels, used by the
retrofit and Kaizen trainers (:mod:`kvlearn.train`) and by Kaizen's sharing sensitivity pass
(:mod:`kvlearn.kaizen.share_sensitivity`), which measures each sharing in the trainer's own loss."""

from __future__ import annotations

import torch

__all__ = ["IGNORE_INDEX", "KD_DENSE_ELEMENTS", "kd_loss"]

IGNORE_INDEX = -100
"""The label of a position that is not supervised (the Hugging Face convention; the testbed's rows use it)."""

# kd_loss computes every position's KL (no host sync) up to this many logits B (T-1) V, 2^28 (1 GiB of float32
# logits per copy); above it, only the supervised positions' (the testbed vocabulary of 733 at 8 x 4096: 24 M)
KD_DENSE_ELEMENTS = 1 << 28


def kd_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, labels: torch.Tensor, topk: int,
            reduce_sum=None) -> torch.Tensor:
    """KL(teacher top-``topk`` || student) per supervised token, averaged (scalar float32).

    ``student_logits``/``teacher_logits [B, T, V]`` predict the next token; ``labels [B, T]`` (-100 = not
    supervised, the Hugging Face convention: position ``i - 1`` predicts label ``i``). The teacher's distribution
    is renormalised over its ``topk`` most likely tokens (temperature 1); the student's log-probabilities are over
    the full vocabulary. 0 (still differentiable) when no token is supervised. ``reduce_sum`` (data parallelism,
    :func:`kvlearn.train.parallel.all_reduce_sum`): divide by the supervised tokens of the global batch, so the
    processes' values add up to the loss of the whole batch.

    Two evaluations of the same sum: up to :data:`KD_DENSE_ELEMENTS` logits (``B (T-1) V``) every position's KL is
    computed and the unsupervised ones are zeroed (no host sync: selecting the supervised rows by a boolean mask
    waits for the GPU to count them, which stalls the step's queue); above it only the supervised rows are
    gathered (the mask path: less memory at large ``V``). The value and gradient are the same up to float rounding
    for finite logits (a non-finite logit at an unsupervised position, which the mask path skips, makes the dense
    path's gradient NaN)."""
    mask = labels[:, 1:] != IGNORE_INDEX  # [B, T-1]
    s, t = student_logits[:, :-1], teacher_logits[:, :-1]  # [B, T-1, V]
    dense = s.numel() <= KD_DENSE_ELEMENTS
    if not dense:
        s, t = s[mask], t[mask]  # [N, V]: only the supervised positions
    s, t = s.float(), t.float()
    k = min(topk, t.shape[-1])
    t_top, idx = t.topk(k, dim=-1)  # [..., k]
    t_logp = torch.log_softmax(t_top, dim=-1)
    s_logp = torch.gather(torch.log_softmax(s, dim=-1), -1, idx)
    kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1)  # [B, T-1] (dense) or [N]
    if dense:
        kl = torch.where(mask, kl, torch.zeros((), dtype=kl.dtype, device=kl.device))
    count = mask.sum() if reduce_sum is None else reduce_sum(mask.sum())
    return kl.sum() / count.clamp(min=1)
