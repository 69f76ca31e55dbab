"""Which layers may share an earlier layer's cache: a sensitivity pass on the dense model before the selector trains
(``kvlearn kaizen-train --share-layers auto``; ``docs/DESIGN.md`` section 8, "Which layers the selector may share").

Why. Sharing removes a layer's cache entirely, the largest saving of any action, so the budget penalty's gradient
pushes hardest toward it; whether it costs nothing or breaks retrieval depends on the layer (on the testbed teacher,
sharing layer 6 is free and sharing layer 2 loses every recall answer). The selector's straight-through gradient
sees only the first-order effect of switching a layer, and the backbone adapts to what it samples, so on the device
every selector settled on a sharing the evaluation format punishes. This pass measures each sharing once, exactly,
before training, and the selector may only share where it is nearly free.

What. On ``rows`` evaluation-format rows of the *training* split (:func:`calibration_rows`; no evaluation example is
drawn), the model's training forward (:class:`~kvlearn.kaizen.sharing.KaizenTrainForward` with one-hot weights:
exactly the configuration's forward) with every layer at 16 bits and one layer ``l`` sharing its predecessor's
cache, against the plain forward:

``increase[l] = KD(share at l) - KD(all 16 bits)``, ``KD`` = :func:`kvlearn.ops.distill_loss.kd_loss` (KL from the
plain forward's top-``k`` logits, in nats per supervised token, the trainer's own loss), ``l = 1 .. L-1``;

``allowed = {l : increase[l] <= threshold}`` (:func:`allowed_share_layers`).
"""

from __future__ import annotations

import torch

from ..errors import check
from ..ops.distill_loss import kd_loss
from .actions import Backbone, LayerAction, action_space

__all__ = ["calibration_rows", "share_increases", "share_sensitivity", "share_row_increases", "increase_stats",
           "allowed_share_layers", "CALIBRATION_BATCH", "DEFAULT_THRESHOLD"]

CALIBRATION_BATCH = (1 << 40) - 1
"""The stream batch number of the calibration rows: the last of a ``TestbedStream`` seed's batches, which a run
never reaches (``seed << 40 | b``, ``b < 2**40``)."""

DEFAULT_THRESHOLD = 0.05
"""Nats per supervised token: sharing a layer may raise the distillation loss by at most this much."""


def calibration_rows(rows: int, length: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, labels)`` ``[rows, length]``: evaluation-format rows of the training split (the batch
    :data:`CALIBRATION_BATCH` of stream ``seed``)."""
    from ..testbed.data import training_batch

    return training_batch(rows, length, (seed << 40) | CALIBRATION_BATCH, dense=False)


def share_increases(model, input_ids: torch.Tensor, labels: torch.Tensor, kd_topk: int = 256,
                    batch_size: int = 4) -> list[float | None]:
    """``increase [L]`` (module docstring; ``None`` at layer 0) of ``model`` (a model with the Kaizen attention
    attached, :func:`kvlearn.kaizen.sharing.attach`) on ``input_ids``, ``labels`` ``[rows, T]`` (labels -100 where
    not supervised), in forwards of ``batch_size`` rows, without gradients."""
    return share_sensitivity(model, input_ids, labels, kd_topk, batch_size)[0]


def share_sensitivity(model, input_ids: torch.Tensor, labels: torch.Tensor, kd_topk: int = 256,
                      batch_size: int = 4) -> tuple[list[float | None], list[float | None]]:
    """``(increase [L], standard_error [L])``: :func:`share_increases` and each increase's standard error over the
    calibration rows (``None`` at layer 0; :func:`increase_stats` of :func:`share_row_increases`). The rows are
    evaluation-format rows of mixed families, whose costs of sharing a layer differ, so a few rows estimate a
    layer's increase only loosely: on the testbed teacher 16 rows put layer 2's at 0.19 with one seed's rows and
    0.29 with another's."""
    return increase_stats(*share_row_increases(model, input_ids, labels, kd_topk, batch_size))


def increase_stats(row_increases: torch.Tensor, tokens: torch.Tensor) -> tuple[list[float | None], list[float | None]]:
    """``(increase [L], standard_error [L])`` from ``row_increases [L, rows]`` (row 0 of layer 0 unused) and the
    rows' supervised ``tokens [rows]``: with ``d_r`` a layer's increase on row ``r`` and ``w_r`` the row's share of
    the tokens, the increase is ``sum_r w_r d_r`` (the token-weighted KD difference of the whole set) and its
    standard error ``sqrt(n / (n - 1) * sum_r w_r^2 (d_r - increase)^2)`` (``n`` rows; 0 for one row)."""
    rows = tokens.numel()
    w = tokens.double() / tokens.double().sum().clamp(min=1)
    increases, errors = [None], [None]
    for d in row_increases[1:].double():
        mean = float((w * d).sum())
        var = float((w.square() * (d - mean).square()).sum()) * rows / (rows - 1) if rows > 1 else 0.0
        increases.append(mean)
        errors.append(var ** 0.5)
    return increases, errors


@torch.no_grad()
def share_row_increases(model, input_ids: torch.Tensor, labels: torch.Tensor, kd_topk: int = 256,
                        batch_size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """``(row_increases [L, rows], tokens [rows])``: each row's KD per supervised token with layer ``l`` sharing
    its predecessor's cache minus the same with every layer at 16 bits (row 0: zeros, layer 0 cannot share), and
    each row's supervised tokens; :func:`increase_stats` reduces them. Forwards of ``batch_size`` rows, no
    gradients; ``model`` has the Kaizen attention attached (:func:`kvlearn.kaizen.sharing.attach`)."""
    from .sharing import KaizenTrainForward

    check(input_ids.dim() == 2 and input_ids.shape == labels.shape,
          f"input_ids {tuple(input_ids.shape)} and labels {tuple(labels.shape)} are invalid: expected [rows, seq] each")
    check(bool((labels != -100).any()), "the calibration rows have no supervised token")
    backbone = Backbone.from_model(model)
    space = action_space(backbone, ("precision", "depth"))
    L, device = backbone.num_layers, next(model.parameters()).device
    full = space.index(LayerAction(bits=16))
    share = space.index(LayerAction.shared())
    configs = [[full] * L] + [[share if j == l else full for j in range(L)] for l in range(1, L)]
    rows = input_ids.shape[0]
    kd = torch.zeros(len(configs), rows, dtype=torch.float64)  # [config, row]: KD per supervised token of each row
    for start in range(0, rows, batch_size):
        ids = input_ids[start:start + batch_size].to(device)
        lab = labels[start:start + batch_size].to(device)
        plain = model(input_ids=ids, use_cache=False).logits.float()
        for i, config in enumerate(configs):
            weights = torch.nn.functional.one_hot(torch.tensor(config, device=device), len(space)).float()
            weights = weights.expand(ids.shape[0], -1, -1)
            logits = model(input_ids=ids, kaizen_train=KaizenTrainForward(space, weights), use_cache=False).logits
            for r in range(ids.shape[0]):  # a row without a supervised token has KD 0 and weight 0
                kd[i, start + r] = float(kd_loss(logits[r:r + 1].float(), plain[r:r + 1], lab[r:r + 1], kd_topk))
    tokens = (labels[:, 1:] != -100).sum(dim=1)
    return kd - kd[0], tokens


def allowed_share_layers(increases, threshold: float = DEFAULT_THRESHOLD) -> tuple[int, ...]:
    """The layers ``l >= 1`` whose ``increases[l]`` is at most ``threshold`` (nats per supervised token)."""
    check(isinstance(threshold, (int, float)) and not isinstance(threshold, bool) and threshold >= 0,
          f"share threshold={threshold!r} is invalid: expected a number of nats per token >= 0")
    return tuple(l for l, v in enumerate(increases) if l >= 1 and v is not None and v <= threshold)
