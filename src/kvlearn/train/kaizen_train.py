"""Train a KV-Kaizen selector and the backbone jointly by distillation (GitHub issue #11; one process, or FSDP2 under
``torchrun``).

Read top to bottom: config, models, one step's losses, one optimizer step (:func:`kaizen_train_step`), checkpoints,
loop. ``docs/DESIGN.md`` section 8, "Training".

* **Teacher**: the frozen dense model (:func:`kvlearn.load`, no gradient).
* **Student**: a float32 copy with :func:`~kvlearn.kaizen.apply.apply_kaizen` (the selector as ``kaizen_selector``,
  the ``kvlearn_kaizen`` attention).
* **Step**: per sequence a target compression ``ρ*`` (``targets``: one factor, or several sampled per sequence, the
  selector being conditioned on ``log2 ρ*``); the selector reads the sequence and gives logits ``[B, L, A]``;
  :func:`~kvlearn.kaizen.selector.gumbel_straight_through` at temperature ``τ`` (geometric from 2.0 to 0.1 over the
  run) gives hard one-hot weights; the student runs the mixture forward
  (:class:`~kvlearn.kaizen.sharing.KaizenTrainForward`: every layer attends the fake-quantized K/V of its sampled
  bit-width, or its anchor's K/V for ``share``, exactly the sampled configuration's forward).
* **Loss** = KD (:func:`kvlearn.ops.distill_loss.kd_loss`: KL to the teacher's top-``kd_topk`` logits) + the budget
  penalty ``β · mean relu(Ĉ / C* - 1)`` (:class:`~kvlearn.kaizen.budget.BudgetMultiplier`; ``Ĉ`` the selector's
  expected cost in bits per token without metadata, or with ``penalty_cost="sampled"`` the one-hots' cost:
  :func:`penalised_cost`; ``C* = C_ref / ρ*``), plus with ``underuse_weight`` w > 0 the under-use term
  ``w · mean relu(1 - Ĉ / C*)`` (:func:`underuse_penalty`: a loose target is a budget to spend, what a
  budget-conditioned selector needs); with ``budget_scope="batch"`` both hinges hold the batch's mean ratio
  ``mean Ĉ / C*`` instead of each sequence's (:func:`budget_terms`). Gradients reach the selector through the weights (KD:
  straight-through) and its softmax (the penalty), and the backbone through the attention (KD).
* **Multiplier**: after each step ``β`` is updated from the *realised* cost, the argmax configuration of each
  sequence (what evaluation runs): up while over budget, slowly down once under it, capped at ``budget_cap``.
* **Optimiser**: AdamW, group 0 the backbone (``lr``, constant, or with ``lr_schedule="cosine"`` a cosine over the
  run down to ``min_lr_ratio`` of it, :func:`backbone_lr_at`), group 1 the selector (``lr_new``, warm-up then
  cosine, :func:`kvlearn.train.distill.new_lr_at`). Gradient clipping; bf16 autocast on CUDA.
* **Output**: as :mod:`kvlearn.train.distill`: atomic ``step-<N>/`` checkpoints (model folder + ``trainer_state.pt``
  with the optimizer, the multiplier and the step), ``final/`` (loadable by :func:`kvlearn.load`, evaluable with
  ``kvlearn eval --method kaizen``), ``train_log.jsonl`` (``kd``, ``penalty``, ``beta``, ``tau``, ``bits``: the
  realised bits per token, ``factor``: the realised compression ``C_ref / C``, ``target``, ``sampled_factor``).
  ``resume=True`` continues from the newest ``step-<N>``. ``init_student`` starts the student from a trained
  selector's folder instead of the teacher (a refinement, e.g. a second device call's more steps: backbone and
  selector weights, with a new optimizer and schedules; the selector's sharing mask is the trained one's,
  :func:`recorded_selector`; the budget multiplier starts where that run left it when the folder records it for the
  same targets, :func:`initial_beta`, else at 0). Every checkpoint folder records its multiplier in
  ``kaizen_budget.json`` (:data:`BUDGET_RECORD`). With ``select_every`` (checkpoint selection,
  :func:`select_iterate`) the iterates are validated on prompts disjoint from the evaluation's, each result a line of
  ``selection.jsonl``, the best so far kept as ``best/``, and ``final/`` takes its weights (the validations' time
  counts toward ``minutes``). With ``ema_decay`` instead (weight averaging, :class:`WeightAverage`) ``final/``
  holds an exponential moving average of the iterates from ``ema_from`` of the run on.
* **Processes**: one, or several under ``torchrun --nproc_per_node N -m kvlearn.cli kaizen-train ...``
  (:mod:`kvlearn.train.parallel`, as :func:`kvlearn.train.distill.retrofit`). ``batch_size`` is the global batch:
  process ``r`` trains on rows :func:`~kvlearn.testbed.data.shard_rows` ``(batch_size, r, N)`` of the same stream
  batches (one-line error unless ``N`` divides it). The per-sequence targets and Gumbel noise are drawn for the
  whole batch from the step's generator on every process and sliced to its rows, so each row is sampled as one
  process would sample it. **Sharding**: the teacher as in the retrofit (each decoder layer, then the root); the
  student with its selector as one unit tree: each decoder layer of the student is an FSDP2 unit and the root unit
  is :class:`KaizenStep`, a module holding the student whose forward is the whole training forward (selector,
  Gumbel straight-through, student, losses). The selector is a submodule of the student (``kaizen_selector``,
  where checkpoints and :func:`kvlearn.load` expect it) but is called outside the student's own forward, so the
  student cannot be the root (its parameters would still be sharded when the selector runs); with
  :class:`KaizenStep` as the root, the selector's parameters belong to the root unit (with the embeddings, final
  norm and head), are gathered for its forward and get FSDP's averaged gradients like every other weight: no
  replicated copy to keep in sync, one optimizer, one gradient clip over one kind of parameter (DTensors).
  **Losses** are this process's share of the global-batch value: KD divided by the global count of supervised
  tokens (``kd_loss(reduce_sum=all_reduce_sum)``), the penalty's mean over this process's rows divided by ``N``
  (every process holds as many rows); the backward runs on ``N x share``, which FSDP's gradient averaging turns
  into the global-batch gradient. **Multiplier**: the realised (argmax) bits, sampled bits and target bits of
  every row are gathered (:func:`~kvlearn.train.parallel.all_gather_rows`, rank order = row order), and every
  process updates ``β`` from the same global rows with the same arithmetic as one process; after each update the
  processes check (one all-reduce) that they hold the same ``β``. A ``minutes`` run uses rank 0's elapsed fraction
  (broadcast), so ``τ``, the learning rates and the last step agree. Rank 0 logs (global values: summed loss
  shares, means over the global batch) and writes the checkpoints; every process takes part in gathering the
  state dicts (:func:`~kvlearn.train.distill.save_checkpoint`), which are in the single-process format, so a
  checkpoint resumes with any process count. Tested with gloo on the CPU
  (``tests/train/test_kaizen_train_fsdp.py``): 2 processes log the loss terms of one process on the same global
  batch, hold the same ``β`` sequence, and save a final checkpoint with the same selector choices; 2 processes
  resumed from a single-process ``step-<N>`` end where the single process ends.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..errors import KVLearnError, check, check_int, check_non_negative, check_positive
from ..hf import unpadded_causal_masks
from ..kaizen.actions import Backbone
from ..kaizen.apply import CONFIG_KEY, KaizenMethodConfig, apply_kaizen, selector_of
from ..kaizen.budget import BudgetMultiplier
from ..kaizen.share_sensitivity import DEFAULT_THRESHOLD, allowed_share_layers, calibration_rows, share_sensitivity
from ..kaizen.selector import SELECTOR_NAME, TAU_END, TAU_START, gumbel_straight_through
from ..kaizen.sharing import KaizenTrainForward
from ..testbed.data import IGNORE_INDEX, TestbedStream, shard_rows
from ..testbed.tasks import MAX_LENGTH, MIN_LENGTH
from . import parallel
from .schedule import warmup_cosine
from .distill import (FINAL, LOG_FILE, STATE_FILE, check_out_folder, check_trainer_fields, clear_run_outputs,
                      drop_log_lines_after, folder_weights, init_backbone, kd_loss, latest_checkpoint,
                      load_student_weights, new_lr_at, prune_checkpoints, read_trainer_state, save_checkpoint)

__all__ = ["KaizenTrainConfig", "kaizen_train", "kaizen_train_step", "build_models", "step_losses", "temperature",
           "KaizenStep", "make_optimizer", "make_multiplier", "penalised_cost", "PENALTY_COSTS", "validate",
           "select_iterate", "initial_beta", "BUDGET_RECORD"]

LR_SCHEDULES = ("constant", "cosine")  # the backbone's learning rate over the run (backbone_lr_at)
PENALTY_COSTS = ("expected", "sampled")  # which cost the budget penalty reads (penalised_cost)
BUDGET_SCOPES = ("sequence", "batch")  # what the budget hinges hold to the target (budget_terms)


def default_out() -> str:
    import datetime as _dt

    return "runs/kaizen-" + _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")


@dataclass
class KaizenTrainConfig:
    model: str  # checkpoint folder of the dense model (the teacher)
    out: str = field(default_factory=default_out)
    overwrite: bool = False
    resume: bool = False
    targets: tuple[float, ...] = (4.0,)  # target compression factor(s); several: sampled per sequence
    axes: tuple[str, ...] | None = None  # None: precision + depth on GQA
    width: int = 64
    heads: int = 2
    blocks: int = 2
    init_margin: float = 2.0
    steps: int | None = 1000
    minutes: float | None = None
    batch_size: int = 8
    seq_len: int = 4096
    lr: float = 1e-5  # backbone: constant, or the peak of a cosine (lr_schedule)
    lr_schedule: str = "constant"  # backbone: "constant" or "cosine" (no warm-up, down to min_lr_ratio * lr)
    lr_new: float = 1e-3  # selector: warm-up then cosine
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    kd_topk: int = 256
    tau_start: float = TAU_START
    tau_end: float = TAU_END
    beta: float | None = None  # initial multiplier; None: 0, or a refinement's carried one (initial_beta)
    eta: float = 0.01  # multiplier step (0: constant beta)
    delta: float = 0.1
    budget_cap: float = 1e4
    dense_fraction: float = 0.75
    family_weights: tuple[float, ...] | None = None  # sampling weights of (trace, niah, vt, recall); None: uniform
    penalty_cost: str = "expected"  # the cost the budget penalty reads: "expected" (softmax) or "sampled" (Gumbel)
    underuse_weight: float = 0.0  # weight of the penalty on compressing more than asked (budget conditioning)
    budget_scope: str = "sequence"  # the hinges hold each sequence to its target, or the batch's mean (budget_terms)
    target_head: bool | None = None  # the selector's direct target term (None: when there are several targets)
    share_layers: tuple[int, ...] | str | None = None  # layers that may share: None all, "auto" the sensitivity pass
    share_threshold: float = DEFAULT_THRESHOLD  # "auto": nats per token a sharing may cost
    share_rows: int = 64  # "auto": calibration rows (16 before session 41: too few to settle layer 2 at 0.2)
    share_seed: int | None = 0  # "auto": the calibration rows' stream seed, the same for every training seed; None:
    # ``seed`` (the rule before session 41, which a resumed older run keeps: RESUME_DEFAULTS)
    save_interval: int = 200
    seed: int = 0
    device: str = "cpu"
    num_workers: int | None = None  # data-generation worker processes; None: default_num_workers(device)
    # checkpoint selection (select_iterate): every select_every steps from select_from of the run on, and at its end,
    # the student's accuracy under its own selector on select_n validation prompts per family; final/ holds the best
    select_every: int = 0  # 0: off (final/ is the last iterate)
    select_n: int = 16
    select_from: float = 0.5
    # weight averaging (WeightAverage): from ema_from of the run on, an exponential moving average of every parameter
    # (backbone and selector) with decay ema_decay per step; final/ holds the average instead of the last iterate
    ema_decay: float = 0.0  # 0: off
    ema_from: float = 0.5
    # a refinement: the student starts from this trained selector's folder (kaizen-train final/ or its export) instead
    # of the teacher's weights; its selector settings and sharing mask are kept (recorded_selector, check_init_fits)
    init_student: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.targets, (int, float)):
            self.targets = (self.targets,)
        self.targets = tuple(self.targets)
        check(len(self.targets) > 0, "targets is empty: expected one or more compression factors, e.g. 4.0")
        for t in self.targets:
            check_positive("target", t)
        self.targets = tuple(float(t) for t in self.targets)
        if self.axes is not None:
            self.axes = tuple(self.axes)
        check((self.steps is None) != (self.minutes is None),
              f"steps={self.steps!r}, minutes={self.minutes!r}: expected exactly one of them")
        if self.steps is not None:
            check_int("steps", self.steps, 1)
        else:
            check_positive("minutes", self.minutes)
        check_int("batch_size", self.batch_size, 1)
        check_int("seq_len", self.seq_len, MIN_LENGTH, MAX_LENGTH, hint=" (the testbed's example lengths)")
        for name in ("lr", "lr_new", "grad_clip", "tau_start", "tau_end"):
            check_positive(name, getattr(self, name))
        for name in ("weight_decay", "eta", "delta", "budget_cap", "underuse_weight"):
            check_non_negative(name, getattr(self, name))
        if self.beta is not None:  # None: initial_beta decides at the start of the run
            check_non_negative("beta", self.beta)
            check(self.beta <= self.budget_cap, f"beta={self.beta} is invalid: expected beta <= budget_cap={self.budget_cap}")
        if self.target_head is None:
            self.target_head = len(self.targets) > 1
        check(isinstance(self.target_head, bool), f"target_head={self.target_head!r} is invalid: expected True, False or None")
        if self.share_layers is not None and self.share_layers != "auto":
            check(isinstance(self.share_layers, (list, tuple)),
                  f"share_layers={self.share_layers!r} is invalid: expected layer indices >= 1, 'auto' or None")
            self.share_layers = tuple(self.share_layers)
        check(self.share_layers is None or self.axes is None or "depth" in self.axes,
              f"share_layers={self.share_layers!r} needs the depth axis: axes={self.axes!r} has no sharing to restrict "
              "(add depth to the axes, or leave share_layers out)")
        check_non_negative("share_threshold", self.share_threshold)
        check_int("share_rows", self.share_rows, 1)
        if self.share_seed is not None:
            check_int("share_seed", self.share_seed, 0)
        check(self.lr_schedule in LR_SCHEDULES,
              f"lr_schedule={self.lr_schedule!r} is invalid: expected one of {', '.join(LR_SCHEDULES)}")
        check(self.penalty_cost in PENALTY_COSTS,
              f"penalty_cost={self.penalty_cost!r} is invalid: expected one of {', '.join(PENALTY_COSTS)}")
        check(self.budget_scope in BUDGET_SCOPES,
              f"budget_scope={self.budget_scope!r} is invalid: expected one of {', '.join(BUDGET_SCOPES)}")
        check_int("select_every", self.select_every, 0)
        check_int("select_n", self.select_n, 1)
        check(0 <= self.select_from <= 1, f"select_from={self.select_from!r} is invalid: expected a fraction of the "
                                          "run in [0, 1]")
        check(0 <= self.ema_decay < 1, f"ema_decay={self.ema_decay!r} is invalid: expected 0 (off) or a decay per step "
                                       "in (0, 1), e.g. 0.998")
        check(0 <= self.ema_from < 1, f"ema_from={self.ema_from!r} is invalid: expected a fraction of the run in [0, 1)")
        check(not (self.ema_decay and self.select_every),
              f"ema_decay={self.ema_decay} with select_every={self.select_every}: final/ holds either the weight "
              "average or the best-validated iterate; expected one of them")
        check(not self.select_every or len(self.targets) == 1,
              f"select_every={self.select_every} with targets={self.targets}: checkpoint selection validates one "
              "target; expected a single target")
        check_trainer_fields(self)
        from ..hf import read_model_config

        if self.init_student is not None:
            check_init_fits(self, recorded_selector(self.init_student))
        self.method_config(self.init_share_layers()).check_targets(Backbone.from_config(read_model_config(self.model)))
        check_out_folder(self)

    def init_share_layers(self) -> tuple[int, ...] | None:
        """The sharing mask of ``init_student``'s selector (``None``: every layer may share, or no ``init_student``)."""
        if self.init_student is None:
            return None
        mask = recorded_selector(self.init_student).get("share_layers")
        return None if mask is None else tuple(mask)

    def method_config(self, share_layers=None) -> KaizenMethodConfig:
        """The selector's recorded config; ``share_layers``: the resolved layers when ``self.share_layers`` is
        ``"auto"`` (before resolution ``None``: every layer, for the range checks) or there is an ``init_student``
        (its mask)."""
        layers = share_layers if self.share_layers == "auto" or self.init_student is not None else self.share_layers
        return KaizenMethodConfig(target=None, axes=self.axes, width=self.width, heads=self.heads, blocks=self.blocks,
                                  max_positions=max(self.seq_len, 8192), init_margin=self.init_margin,
                                  train_targets=self.targets, target_head=self.target_head, share_layers=layers)


def penalised_cost(sel, logits: torch.Tensor, weights: torch.Tensor, penalty_cost: str = "expected") -> torch.Tensor:
    """``Ĉ [batch]``, the cost in bits per token the budget penalty reads, differentiable in the selector's logits.

    ``"sampled"`` (the default before 78345ed; every selector in ``results/`` trained so): the cost of the Gumbel
    sample ``weights [batch, L, A]`` (straight-through one-hots: the sample's cost forward, the tempered softmax's
    gradient backward). ``"expected"`` (the default): the cost under the selector's own distribution,
    ``Σ_l Σ_a softmax(logits)_{l,a} c(a)``, the mean of the sampled cost over the Gumbel draws (Gumbel-argmax
    samples follow that softmax), with no noise. The penalty is a hinge, so on samples it is
    ``E[relu(C / C* - 1)] >= relu(E[C] / C* - 1)``: it keeps pushing while any sample lies over budget, and the argmax
    settles below the target (the 4.57x of a 4x selector, ``docs/DESIGN.md`` section 8); the expected cost has no such
    gap. On the shipped teacher (CPU, 200 steps, target 4) it ends at 4.0x where the sampled cost ends at 5.33x
    (``results/raw/kaizen_penalty_cost_*_cpu_78345ed.*``)."""
    if penalty_cost == "expected":
        return sel.cost(torch.softmax(logits.float(), dim=-1))
    check(penalty_cost == "sampled",
          f"penalty_cost={penalty_cost!r} is invalid: expected one of {', '.join(PENALTY_COSTS)}")
    return sel.cost(weights.float())


# the fields of a trained selector's recorded config that decide its weights' shapes and meaning (init_student)
INIT_FIELDS = ("axes", "width", "heads", "blocks", "max_positions", "target_head")


def recorded_selector(path: str) -> dict:
    """The KV-Kaizen config recorded in model folder ``path``'s ``config.json`` (``kaizen``: the selector's settings
    and ``share_layers``, its sharing mask); one-line error when ``path`` is no model folder or has no selector."""
    cfg = Path(path, "config.json")
    check(cfg.is_file(), f"init_student={path!r} is not a model folder (no config.json): expected the final/ folder of "
                         "a kvlearn kaizen-train run, or its export")
    recorded = json.loads(cfg.read_text()).get(CONFIG_KEY)
    check(isinstance(recorded, dict), f"init_student={path!r} has no KV-Kaizen selector (its config.json records no "
                                      "kaizen): expected the final/ folder of a kvlearn kaizen-train run, or its export")
    return recorded


def check_init_fits(config: KaizenTrainConfig, recorded: dict) -> None:
    """One-line errors unless ``config.init_student`` (whose recorded selector config is ``recorded``) can start this
    run: the selector's settings (``INIT_FIELDS``) and, unless left to it (``None`` or ``"auto"``), the sharing mask
    must be the trained selector's. Its training targets may differ (a refinement toward another budget): they enter
    the losses, not the weights' shapes, unless the selector has a target head. The backbone's shape is checked on
    the weights when they are loaded (:func:`build_models`, through :func:`kvlearn.train.distill.init_backbone`)."""
    path = config.init_student
    mask = recorded.get("share_layers")
    mask = None if mask is None else tuple(mask)
    check(config.share_layers in (None, "auto") or tuple(config.share_layers) == mask,
          f"share_layers={config.share_layers!r} with init_student={path!r}, whose selector may share layers "
          f"{'all' if mask is None else list(mask)}: a refinement keeps the trained selector's mask; leave "
          "share_layers out (or 'auto')")
    mine = json.loads(json.dumps(asdict(config.method_config(mask))))
    for name in INIT_FIELDS:
        have = json.loads(json.dumps(recorded.get(name)))
        check(have == mine[name], f"init_student={path!r} was trained with {name}={have!r}, this run has "
                                  f"{name}={mine[name]!r}: expected the same (the selector's weights depend on it)")
    if mine["target_head"]:
        have = [float(t) for t in recorded.get("train_targets") or []]
        check(have == list(config.targets), f"init_student={path!r} was trained with targets {have}, this run has "
                                            f"{list(config.targets)}: a selector with a target head refines at its "
                                            "own targets")


def backbone_lr_at(config: KaizenTrainConfig, fraction: float) -> float:
    """The backbone's learning rate ``fraction`` of the way through the run: ``lr`` throughout (``"constant"``), or
    a cosine from ``lr`` to ``min_lr_ratio * lr`` with no warm-up (``"cosine"``, so that the final weights are not
    one noisy iterate of a constant high rate: the 8x selectors' spread over seeds, docs/DESIGN.md section 8)."""
    if config.lr_schedule == "constant":
        return config.lr
    return warmup_cosine(config.lr, 0, fraction, 0, config.min_lr_ratio)


def temperature(config: KaizenTrainConfig, fraction: float) -> float:
    """Gumbel temperature ``fraction`` of the way through the run: geometric from ``tau_start`` to ``tau_end``."""
    f = min(1.0, max(0.0, fraction))
    return config.tau_start * (config.tau_end / config.tau_start) ** f


SHARE_REPORT = "share_sensitivity.json"  # the out folder's record of the "auto" sensitivity pass


def resolve_share_layers(config: KaizenTrainConfig, model, device: torch.device) -> tuple[tuple[int, ...] | None, dict | None]:
    """``(share_layers, report)``: ``config.share_layers`` itself, or for ``"auto"`` the layers the sensitivity pass
    on ``model`` (the dense model with the Kaizen attention attached) allows (:mod:`kvlearn.kaizen.share_sensitivity`:
    ``share_rows`` evaluation-format training rows of ``seq_len`` tokens, stream ``seed``) and its report
    (``increases``, ``threshold``, ``allowed``, ``rows``, ``seq_len``)."""
    if config.init_student is not None:  # a refinement keeps the trained selector's mask (check_init_fits)
        return config.init_share_layers(), None
    if config.share_layers != "auto":
        return config.share_layers, None
    seed = config.seed if config.share_seed is None else config.share_seed
    ids, labels = calibration_rows(config.share_rows, config.seq_len, seed)
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        increases, errors = share_sensitivity(model, ids, labels, config.kd_topk, batch_size=min(config.batch_size, 8))
    allowed = allowed_share_layers(increases, config.share_threshold)
    report = {"increases": [None if v is None else round(v, 6) for v in increases],
              "standard_errors": [None if v is None else round(v, 6) for v in errors], "threshold": config.share_threshold,
              "allowed": list(allowed), "near_threshold": near_threshold(increases, errors, config.share_threshold),
              "rows": config.share_rows, "seq_len": config.seq_len, "seed": seed}
    return allowed, report


def near_threshold(increases: list[float | None], errors: list[float | None], threshold: float) -> list[int]:
    """The layers whose increase lies within two standard errors of ``threshold``: other calibration rows could
    well put them on the other side of it, so the mask is not settled for them (more ``share_rows`` narrow it)."""
    return [l for l, (v, e) in enumerate(zip(increases, errors)) if v is not None and abs(v - threshold) <= 2 * e]


def build_models(config: KaizenTrainConfig, device: torch.device):
    """``(teacher, student, share_report)``: the frozen dense model, a float32 copy with the selector applied (in
    train mode; with ``init_student`` holding that trained selector's weights, backbone and selector) and, for
    ``share_layers="auto"``, the sensitivity pass's report (:func:`resolve_share_layers`; run on the copy before the
    selector exists) else ``None``."""
    from ..checkpoint import load as load_model
    from ..kaizen.sharing import attach

    teacher = load_model(config.model, dtype=torch.float32, device=device)
    teacher.requires_grad_(False)
    student = copy.deepcopy(teacher)
    if config.init_student is not None:  # the backbone, checked against the teacher's shape (one-line error)
        init_backbone(student, config.init_student, "init_student")
    share_layers, report = resolve_share_layers(config, attach(student), device)
    apply_kaizen(student, config.method_config(share_layers))  # checks the targets against the allowed sharing
    if config.init_student is not None:  # then the selector (its settings were checked: check_init_fits)
        prefix = SELECTOR_NAME + "."
        selector_of(student).load_state_dict({k[len(prefix):]: v for k, v in folder_weights(config.init_student).items()
                                              if k.startswith(prefix)})
    student.requires_grad_(True)
    student.train()
    return teacher, student, report


def sample_targets(config: KaizenTrainConfig, batch: int, generator: torch.Generator) -> torch.Tensor:
    """``ρ*`` per sequence ``[batch]``: the single target, or one of ``targets`` drawn uniformly per sequence."""
    choices = torch.tensor(config.targets, dtype=torch.float32)
    return choices[torch.randint(len(choices), (batch,), generator=generator)]


def gumbel_uniforms(batch: int, layers: int, actions: int, generator: torch.Generator) -> torch.Tensor:
    """The uniform draws ``[batch, layers, actions]`` (float32, CPU) behind a step's Gumbel noise, for the whole
    global batch: what :func:`~kvlearn.kaizen.selector.gumbel_straight_through` draws from ``generator`` for logits
    of that shape. A data-parallel process passes its rows of them to :func:`step_losses` (``uniforms``)."""
    return torch.rand((batch, layers, actions), generator=generator, dtype=torch.float32)


def underuse_penalty(cost: torch.Tensor, target_bits: torch.Tensor, weight: float) -> torch.Tensor:
    """``w · mean relu(1 - Ĉ / C*)``: the penalty on a configuration cheaper than its target ``C*`` (``cost``,
    ``target_bits``: ``[batch]`` bits per token). The budget multiplier's hinge pushes only down (over budget) and the
    KD loss alone barely tells 4 bits from 16 on a jointly trained backbone, so a budget-conditioned selector
    otherwise answers a loose target (1x) with the configuration its tight ones (4x) taught it
    (``results/raw/kaizen_table_factors2_16_compose32_64_7822af1.json``); with ``w > 0`` the target is a budget to
    spend, not only a cap. Zero (a constant) when ``w = 0``."""
    if weight == 0:
        return cost.new_zeros(())
    return weight * torch.relu(1 - cost / target_bits.to(cost.dtype)).mean()


def budget_terms(penalised: torch.Tensor, target_bits: torch.Tensor, multiplier: BudgetMultiplier,
                 underuse_weight: float, scope: str = "sequence") -> torch.Tensor:
    """The budget penalty plus the under-use term on ``penalised`` (``Ĉ [batch]``, bits per token) against
    ``target_bits`` (``C* [batch]``). ``scope="sequence"``: each sequence's ratio ``r = Ĉ / C*`` is hinged alone,
    ``β · mean relu(r - 1) + w · mean relu(1 - r)``, so every prompt is held to its target. ``scope="batch"``: the
    hinges hold the batch's mean ratio, ``β · relu(mean r - 1) + w · relu(1 - mean r)``: one budget in bits per
    token over the prompts (the paper's wording), which lets the selector give one prompt more bits than its target
    and another fewer; under data parallelism the mean is this process's rows'. Differentiable in ``penalised``."""
    check(scope in BUDGET_SCOPES, f"scope={scope!r} is invalid: expected one of {', '.join(BUDGET_SCOPES)}")
    if scope == "sequence":
        return multiplier.penalty(penalised, target_bits) + underuse_penalty(penalised, target_bits, underuse_weight)
    ratio = (penalised / target_bits.to(penalised.dtype)).mean()
    one = torch.ones((), dtype=ratio.dtype, device=ratio.device)
    return multiplier.penalty(ratio, one) + underuse_penalty(ratio, one, underuse_weight)


def step_losses(student, teacher_logits, input_ids, labels, targets: torch.Tensor, tau: float,
                multiplier: BudgetMultiplier, kd_topk: int, generator: torch.Generator | None = None, *,
                uniforms: torch.Tensor | None = None, reduce_sum=None, world: int = 1,
                penalty_cost: str = "expected", underuse_weight: float = 0.0, budget_scope: str = "sequence") -> dict:
    """One training forward: ``{"loss", "kd", "penalty"}`` (differentiable) and detached ``bits`` (realised, argmax,
    ``[batch]``), ``sampled_bits [batch]``, ``target_bits [batch]``, ``logits`` (the selector's).

    Gumbel noise: from ``generator`` for these rows, or from ``uniforms [batch, layers, actions]`` (this process's
    rows of :func:`gumbel_uniforms`; the same arithmetic as the generator path). Under data parallelism
    (``world`` processes, ``reduce_sum`` = :func:`kvlearn.train.parallel.all_reduce_sum`) ``loss``, ``kd`` and
    ``penalty`` are this process's shares of the global-batch values (module docstring, "Processes").
    ``penalty_cost``: which cost the penalty reads (:func:`penalised_cost`); ``sampled_bits`` is the sample's cost
    either way. ``underuse_weight`` ``w``: the penalty also holds ``w · mean relu(1 - Ĉ / C*)`` (the same cost
    ``Ĉ``), so that a sequence compressed more than its target asks is pushed back up (:func:`underuse_penalty`).
    ``budget_scope``: each sequence held to its target, or the batch's mean (:func:`budget_terms`)."""
    sel = selector_of(student)
    # the selector reads what it reads at evaluation, the prompt: supervised tokens (answers) are masked out
    logits = sel(input_ids, labels == IGNORE_INDEX, targets)  # [B, L, A]
    if uniforms is None:
        weights = gumbel_straight_through(logits, tau, generator=generator)
    else:  # gumbel_straight_through's noise, from the given draws
        u = uniforms.to(logits.device, logits.dtype)
        g = -torch.log(-torch.log(u.clamp(1e-10, 1 - 1e-7)))
        weights = gumbel_straight_through(logits + g, tau, noise=False)
    state = KaizenTrainForward(sel.space, weights)
    out = student(input_ids=input_ids, attention_mask=unpadded_causal_masks(student), kaizen_train=state,
                  use_cache=False).logits
    kd = kd_loss(out, teacher_logits, labels, kd_topk, reduce_sum=reduce_sum)
    cost = sel.cost(weights.float())  # [B] bits per token (no metadata), hard forward
    target_bits = sel.target_bits(targets).to(cost.device)
    # a mean over rows: every process holds as many
    penalised = penalised_cost(sel, logits, weights, penalty_cost)
    penalty = budget_terms(penalised, target_bits, multiplier, underuse_weight, budget_scope) / world
    with torch.no_grad():
        hard = torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        bits = sel.cost(hard)
    return {"loss": kd + penalty, "kd": kd, "penalty": penalty, "bits": bits, "sampled_bits": cost.detach(),
            "target_bits": target_bits, "logits": logits.detach()}


class KaizenStep(torch.nn.Module):
    """The student (with its selector) as one module whose forward is one training forward
    (:func:`step_losses`): under data parallelism the FSDP2 root unit (module docstring, "Processes"), so the
    selector, called outside the student's own forward, runs on gathered parameters. With one process a plain
    wrapper. Arguments are tensors and numbers only (FSDP's hooks rebuild dicts and dataclasses found in module
    arguments): the multiplier is an attribute, read at call time."""

    def __init__(self, student, multiplier: BudgetMultiplier, kd_topk: int, world: int = 1,
                 penalty_cost: str = "expected", underuse_weight: float = 0.0, budget_scope: str = "sequence"):
        super().__init__()
        self.student = student
        self.multiplier = multiplier
        self.kd_topk = kd_topk
        self.world = world
        self.penalty_cost = penalty_cost
        self.underuse_weight = underuse_weight
        self.budget_scope = budget_scope

    def forward(self, teacher_logits, input_ids, labels, targets, tau: float, uniforms) -> dict:
        return step_losses(self.student, teacher_logits, input_ids, labels, targets, tau, self.multiplier,
                           self.kd_topk, uniforms=uniforms, world=self.world,
                           reduce_sum=parallel.all_reduce_sum if self.world > 1 else None,
                           penalty_cost=self.penalty_cost, underuse_weight=self.underuse_weight,
                           budget_scope=self.budget_scope)


def make_optimizer(config: KaizenTrainConfig, student) -> torch.optim.AdamW:
    """AdamW: group 0 the backbone (``lr``), group 1 the selector (``lr_new``)."""
    prefix = SELECTOR_NAME + "."
    new = [p for n, p in student.named_parameters() if n.startswith(prefix)]
    old = [p for n, p in student.named_parameters() if not n.startswith(prefix)]
    return torch.optim.AdamW([{"params": old, "lr": config.lr}, {"params": new, "lr": config.lr_new}],
                             weight_decay=config.weight_decay, betas=(0.9, 0.95))


BUDGET_RECORD = "kaizen_budget.json"  # in every checkpoint folder: the multiplier there, where a refinement starts


def budget_record(config: KaizenTrainConfig, beta: float, step: int) -> dict:
    """What a checkpoint folder records of the budget (:data:`BUDGET_RECORD`): the multiplier ``beta`` after ``step``
    and the targets it was reached for."""
    return {"beta": float(beta), "step": step, "targets": list(config.targets)}


def initial_beta(config: KaizenTrainConfig) -> tuple[float, str | None]:
    """``(the multiplier a run starts at, where it comes from)``: ``config.beta`` when given (``"--beta"``); else,
    for a refinement (``init_student``) whose folder records the multiplier its run had reached (:data:`BUDGET_RECORD`,
    written by kaizen-train since session 51 and copied by ``benchmarks/export_checkpoint.py``) for the same targets,
    that one, capped at ``budget_cap`` (the folder's path); else 0 (None). Started at 0 instead, a refinement of an
    8x selector trained its first 264 steps partly under budget (down to 7.11x) until the multiplier rose again
    (``docs/DESIGN.md`` section 8). A record that is not a number >= 0 is a one-line error naming the file."""
    if config.beta is not None:
        return config.beta, "--beta"
    path = None if config.init_student is None else Path(config.init_student) / BUDGET_RECORD
    if path is None or not path.is_file():
        return 0.0, None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise KVLearnError(f"{str(path)!r} is not a readable budget record ({e}): expected JSON with 'beta' and "
                           "'targets' (delete it, or pass --beta, to start the multiplier at 0)") from None
    beta = record.get("beta") if isinstance(record, dict) else None
    check(isinstance(beta, (int, float)) and not isinstance(beta, bool) and math.isfinite(beta) and beta >= 0,
          f"{str(path)!r} records beta={beta!r}: expected a number >= 0 (delete it, or pass --beta)")
    targets = record.get("targets")
    check(isinstance(targets, list) and all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in targets),
          f"{str(path)!r} records targets={targets!r}: expected a list of compression factors (delete it, or pass "
          "--beta)")
    if [float(t) for t in targets] != [float(t) for t in config.targets]:
        return 0.0, None  # a refinement toward another budget starts its multiplier afresh
    return min(float(beta), config.budget_cap), str(path.parent)


def make_multiplier(config: KaizenTrainConfig, beta: float | None = None) -> BudgetMultiplier:
    """The budget multiplier at the start of a run: ``beta`` (default :func:`initial_beta`), ``eta``, ``delta``,
    ``budget_cap``."""
    beta = initial_beta(config)[0] if beta is None else beta
    return BudgetMultiplier(eta=config.eta, delta=config.delta, cap=config.budget_cap, beta=beta)


def kaizen_train_step(config: KaizenTrainConfig, teacher, joint: KaizenStep, optimizer, input_ids: torch.Tensor,
                      labels: torch.Tensor, step: int, fraction: float,
                      d: parallel.DistInfo = parallel.DistInfo()) -> dict:
    """One optimizer step of the KV-Kaizen training: step ``step`` (0-based) with ``fraction`` of the run done.

    ``joint``: the :class:`KaizenStep` holding the student (``joint.student``, with its selector) and the budget
    multiplier (``joint.multiplier``, updated in place); ``optimizer``: :func:`make_optimizer`'s. ``input_ids``,
    ``labels``: int64 ``[B, T]`` on the models' device, this process's rows (:func:`~kvlearn.testbed.data.shard_rows`
    of ``config.batch_size``) of the global batch, ``labels`` -100 where not supervised. Sets the two learning rates,
    draws the targets ``ρ* [batch_size]`` and Gumbel uniforms ``[batch_size, L, A]`` of the whole global batch from
    the step's generator (then slices this process's rows), runs the teacher (no gradient) and ``joint`` (selector
    logits ``[B, L, A]``, straight-through weights, the student's mixture forward, KD + penalty) under bf16 autocast
    on CUDA, backward, clipping, the AdamW step and ``zero_grad``, then gathers every row's realised / sampled /
    target bits (``[batch_size, 3]``) and updates the multiplier from them (module docstring, "Multiplier").

    Returns the step's log values (global values: losses summed over the processes, the rest over the global batch),
    what :func:`kaizen_train` writes to ``train_log.jsonl`` but ``step`` and ``seconds``: ``loss``, ``kd``,
    ``penalty``, ``beta`` (used by this step), ``beta_next`` (after the update), ``tau``, ``bits``, ``factor``,
    ``sampled_factor``, ``target``, ``grad_norm``, ``lr``, ``lr_new`` (floats)."""
    device = input_ids.device
    student, multiplier = joint.student, joint.multiplier
    sel = selector_of(student)
    reference, shape = sel.backbone.reference_bits, (sel.backbone.num_layers, sel.num_actions)
    rows = shard_rows(config.batch_size, d.rank, d.world)
    lr_new, lr = new_lr_at(config, step, fraction), backbone_lr_at(config, fraction)
    optimizer.param_groups[0]["lr"] = lr
    optimizer.param_groups[1]["lr"] = lr_new
    # targets and Gumbel draws of the whole global batch (one process's sequence of draws), then our rows
    gen = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
    targets = sample_targets(config, config.batch_size, gen)  # [batch_size]
    uniforms = gumbel_uniforms(config.batch_size, *shape, gen)  # [batch_size, L, A]
    tau = temperature(config, fraction)
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        with torch.no_grad():
            teacher_logits = teacher(input_ids=input_ids, attention_mask=unpadded_causal_masks(teacher),
                                     use_cache=False).logits  # [B, T, V]
        parts = joint(teacher_logits, input_ids, labels, targets[rows.start:rows.stop], tau,
                      uniforms[rows.start:rows.stop])
    (parts["loss"] * d.world).backward()  # FSDP averages the gradients over the processes: the shares' sum
    grad_norm = torch.nn.utils.clip_grad_norm_(student.parameters(), config.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    # the global batch's rows [B, 3] (realised, sampled and target bits), the loss totals and the gradient norm, on
    # every process, read back in one transfer (the step's one host sync)
    rows = parallel.all_gather_rows(
        torch.stack([parts["bits"], parts["sampled_bits"], parts["target_bits"]], dim=1).float())
    totals = parallel.all_reduce_sum(torch.stack([parts[k].detach().float() for k in ("loss", "kd", "penalty")]))
    full = getattr(grad_norm, "full_tensor", None)  # a DTensor under FSDP
    norm = (full() if full is not None else grad_norm).detach().float().reshape(1).to(rows.device)
    host = torch.cat([rows.reshape(-1), totals.to(rows.device), norm]).cpu()
    per_row = host[:rows.numel()].reshape(rows.shape)
    bits, sampled_bits, target_bits = per_row.unbind(1)
    beta_used = multiplier.beta
    multiplier.update(bits, target_bits)
    _check_same_beta(multiplier.beta, d, device)
    loss, kd, penalty, grad_norm_value = host[rows.numel():].tolist()
    return {"loss": loss, "kd": kd, "penalty": penalty, "beta": beta_used, "beta_next": multiplier.beta, "tau": tau,
            "bits": float(bits.mean()), "factor": float((reference / bits.clamp(min=1)).mean()),
            "sampled_factor": float((reference / sampled_bits.clamp(min=1)).mean()),
            "target": float(targets.mean()), "grad_norm": grad_norm_value, "lr": lr, "lr_new": lr_new}


RESUME_FIELDS = ("targets", "axes", "width", "heads", "blocks", "steps", "minutes", "seq_len", "batch_size", "seed",
                 "share_layers", "share_threshold", "share_rows", "share_seed", "family_weights", "budget_scope",
                 "select_every", "select_n", "select_from", "ema_decay", "ema_from", "init_student")
RESUME_DEFAULTS = {"share_layers": None, "share_threshold": DEFAULT_THRESHOLD,  # checkpoints from before the fields
                   "share_rows": 16, "share_seed": None,
                   "family_weights": None, "budget_scope": "sequence", "select_every": 0, "select_n": 16,
                   "select_from": 0.5, "ema_decay": 0.0, "ema_from": 0.5, "init_student": None}
BEST = "best"  # out/best/: the best-validated iterate so far (checkpoint selection)
SELECT_LOG = "selection.jsonl"  # out/selection.jsonl: one line per validation
SELECT_SEED_OFFSET = 1_000_000  # validation prompts: the eval split's generator from this example index on
VALIDATE_DIR = ".validate"  # out/.validate/: the iterate as served during one validation, removed after it


def validate(config: KaizenTrainConfig, student, device: torch.device) -> dict:
    """``{"accuracy", "per_task", "factor"}``: greedy exact-match accuracy of the iterate ``student`` served as
    ``kvlearn eval`` serves a checkpoint (method ``kaizen``: its selector's choice per prompt, the compact cache of
    that choice) on ``select_n`` prompts per family of the eval split's format, at ``seq_len``, drawn from example
    index :data:`SELECT_SEED_OFFSET` on: disjoint from the evaluation's first million prompts and from the held-out
    split. ``factor``: the mean realised compression.

    Served, not run in place: the iterate is written to ``out/.validate/`` and loaded back by :func:`kvlearn.load` in
    :func:`~kvlearn.checkpoint.serving_dtype` (on CUDA bf16 weights and activations, with the selector as loading
    attaches it, where the training copy is float32 under autocast; on the CPU float32 either way), then the folder
    is removed. Until session 39 the training copy itself was evaluated under autocast, and on CUDA it read trace
    higher than the tables did (docs/DESIGN.md section 8, "Checkpoint selection"). The student is not touched: its
    mode, weights and recorded config stay as they were."""
    from ..checkpoint import load, serving_dtype
    from ..eval.accuracy import EvalConfig, evaluate

    path = Path(config.out) / VALIDATE_DIR
    if path.exists():
        shutil.rmtree(path)
    student.save_pretrained(path, safe_serialization=True)
    try:
        served = load(path, dtype=serving_dtype(device), device=device)
        rows = evaluate(served, EvalConfig(method="kaizen", n_per_task=config.select_n, context=config.seq_len,
                                           batch_size=min(config.select_n, 16), split="eval",
                                           seed_offset=SELECT_SEED_OFFSET), progress=False)
        del served
    finally:
        shutil.rmtree(path, ignore_errors=True)
    per_task = {r["task"]: r["accuracy"] for r in rows}
    return {"accuracy": sum(per_task.values()) / len(per_task), "per_task": per_task,
            "factor": sum(r["factor"] for r in rows) / len(rows)}


def select_iterate(config: KaizenTrainConfig, student, optimizer, step: int, device: torch.device, extra: dict,
                   best: dict | None) -> tuple[dict, dict]:
    """Validate the current iterate (:func:`validate`), log it to ``out/selection.jsonl`` and, when its accuracy beats
    ``best`` (the record of ``out/best/``; ties keep the earlier one), write it as ``out/best/`` with its record
    (``trainer_state.pt``'s ``selected``). Returns ``(the best record after this step, this step's record)``. One
    process only."""
    result = {"step": step, **validate(config, student, device)}
    out = Path(config.out)
    with open(out / SELECT_LOG, "a") as f:
        f.write(json.dumps(result) + "\n")
    if best is not None and result["accuracy"] <= best["accuracy"]:
        return best, result
    save_checkpoint(config, student, optimizer, step, BEST, {**extra, "selected": result},
                    records={BUDGET_RECORD: budget_record(config, extra["multiplier"]["beta"], step)})
    return result, result


class WeightAverage:
    """An exponential moving average of a student's parameters, ``avg <- decay * avg + (1 - decay) * param`` after
    each step from the first :meth:`update` on (the average starts as that step's iterate, so the weights from before
    ``ema_from`` never enter it). Float32 copies on the parameters' device, keyed by parameter name; one process.
    ``state_dict`` / ``load_state_dict`` carry it through a checkpoint, so a resumed run continues the same average."""

    def __init__(self, student, decay: float) -> None:
        self.decay = decay
        self.params = dict(student.named_parameters())
        self.average: dict[str, torch.Tensor] | None = None
        self.since: int | None = None  # the step it started at

    @torch.no_grad()
    def update(self, step: int) -> None:
        if self.average is None:
            self.average = {k: p.detach().float().clone() for k, p in self.params.items()}
            self.since = step
            return
        names = list(self.average)
        torch._foreach_lerp_([self.average[k] for k in names], [self.params[k].detach().float() for k in names],
                             1.0 - self.decay)

    @torch.no_grad()
    def copy_to_student(self) -> None:
        """Put the average into the student's parameters (nothing when no step was averaged)."""
        for k, v in (self.average or {}).items():
            self.params[k].copy_(v)

    def state_dict(self) -> dict:
        return {"decay": self.decay, "since": self.since,
                "average": None if self.average is None else {k: v.cpu() for k, v in self.average.items()}}

    def load_state_dict(self, state: dict) -> None:
        self.since = state["since"]
        device = next(iter(self.params.values())).device
        self.average = None if state["average"] is None else {k: v.to(device) for k, v in state["average"].items()}


def load_trainer_state(path: Path, student, config: KaizenTrainConfig) -> dict:
    """Load the student weights of checkpoint ``path`` and return its trainer state; one-line error when it was
    trained with other settings."""
    mine = asdict(config)
    unread = () if config.share_layers == "auto" else ("share_rows", "share_seed")  # only the pass reads them
    trainer = read_trainer_state(path, {name: mine[name] for name in RESUME_FIELDS if name not in unread},
                                 RESUME_DEFAULTS)
    load_student_weights(path, student)
    return trainer


def kaizen_train(config: KaizenTrainConfig, stop_after: int | None = None, progress: bool = True) -> dict:
    """Run the training (one process, or one of ``torchrun``'s: module docstring, "Processes"); returns ``{"step",
    "final", "log", "betas", "selected", "averaged_since"}`` (``final`` None when ``stop_after`` ended it early; ``log`` the last step's
    log line, global values; ``betas`` the multiplier this process held after each step of this call; ``selected``
    the validation record of the iterate ``final/`` holds under checkpoint selection, else None; ``averaged_since``
    the first step of the weight average ``final/`` holds, else None)."""
    d = parallel.init_distributed(config.device)
    device = torch.device(f"cuda:{d.local_rank}" if d.world > 1 and config.device.startswith("cuda") else config.device)
    rows = shard_rows(config.batch_size, d.rank, d.world)  # one-line error unless batch_size % world == 0
    check(d.world == 1 or not config.select_every,
          f"select_every={config.select_every} with {d.world} processes (FSDP) is not supported: checkpoint selection "
          "evaluates the whole student on one process; expected one process, or select_every=0")
    check(d.world == 1 or not config.ema_decay,
          f"ema_decay={config.ema_decay} with {d.world} processes (FSDP) is not supported: the weight average keeps "
          "whole parameters on one process; expected one process, or ema_decay=0")
    torch.manual_seed(config.seed)
    out = Path(config.out)
    if d.main:
        out.mkdir(parents=True, exist_ok=True)
        if config.overwrite and not config.resume:
            clear_run_outputs(out)
            _reset_selection(out, None)
    teacher, student, share_report = build_models(config, device)
    if d.main and share_report is not None:
        (out / SHARE_REPORT).write_text(json.dumps(share_report, indent=1) + "\n")
        if progress:
            print(f"kaizen-train: sharing allowed at layers {share_report['allowed'] or 'none'} (increase in KD per "
                  f"layer {share_report['increases']}, threshold {config.share_threshold})", flush=True)
            if share_report["near_threshold"]:
                print(f"kaizen-train: layer(s) {share_report['near_threshold']} lie within two standard errors of the "
                      f"threshold on these {config.share_rows} calibration rows (standard errors "
                      f"{share_report['standard_errors']}): other rows may well decide them otherwise; --share-rows "
                      "more rows narrows the estimate", flush=True)
    beta, carried_from = initial_beta(config)
    multiplier = make_multiplier(config, beta)
    if progress and d.main and not config.resume and carried_from is not None:
        print(f"kaizen-train: the budget multiplier starts at {beta:.4g}, where {carried_from}'s run left it "
              "(--beta sets another)", flush=True)
    step, trainer_state = 0, None
    if config.resume:  # into the unsharded student, on every process
        trainer_state = load_trainer_state(latest_checkpoint(out), student, config)
        step = int(trainer_state["step"])
        multiplier.load_state_dict(trainer_state["multiplier"])
    joint = KaizenStep(student, multiplier, config.kd_topk, d.world, penalty_cost=config.penalty_cost,
                       underuse_weight=config.underuse_weight, budget_scope=config.budget_scope)
    if d.world > 1:
        parallel.shard_model(teacher)
        parallel.shard_model(student, root=joint)
    optimizer = make_optimizer(config, student)
    if trainer_state is not None:
        parallel.load_optimizer_state_dict(student, optimizer, trainer_state["optimizer"])
    average = WeightAverage(student, config.ema_decay) if config.ema_decay else None
    if average is not None and trainer_state is not None and trainer_state.get("weight_average") is not None:
        average.load_state_dict(trainer_state["weight_average"])
    log_path = out / LOG_FILE
    if d.main:  # drop the lines of steps that the resumed run will redo
        drop_log_lines_after(log_path, step)
    best = _reset_selection(out, step if config.resume else None) if config.select_every and d.main else None
    validated = None  # the step whose iterate was last validated
    stream = TestbedStream(length=config.seq_len, batch_size=config.batch_size, seed=config.seed,
                           weights=config.family_weights, dense=config.dense_fraction, start_batch=step, rows=rows)
    batches = iter(torch.utils.data.DataLoader(stream, batch_size=None, num_workers=config.num_workers,
                                               pin_memory=device.type == "cuda"))
    from tqdm import tqdm

    bar = tqdm(total=config.steps, initial=step, disable=not progress or not d.main, desc="kaizen-train", unit="step")
    t0 = time.time()
    seconds_done = float(trainer_state.get("seconds", 0.0)) if trainer_state is not None else 0.0
    last, finished, betas = {}, False, []
    with open(log_path if d.main else os.devnull, "a") as log_file:
        while True:
            seconds = seconds_done + time.time() - t0
            fraction = step / config.steps if config.steps else parallel.agreed_fraction(seconds / (60 * config.minutes), d, device)
            finished = fraction >= 1
            if finished or (stop_after is not None and step >= stop_after):
                break
            input_ids, labels = next(batches)
            input_ids, labels = input_ids.to(device), labels.to(device)
            values = kaizen_train_step(config, teacher, joint, optimizer, input_ids, labels, step, fraction, d)
            betas.append(values["beta_next"])
            step += 1
            last = {"step": step, **values, "seconds": round(seconds_done + time.time() - t0, 3)}
            log_file.write(json.dumps(last) + "\n")
            log_file.flush()
            bar.update(1)
            bar.set_postfix(kd=f"{last['kd']:.3f}", factor=f"{last['factor']:.2f}", beta=f"{multiplier.beta:.3g}")
            if average is not None and fraction >= config.ema_from:
                average.update(step)
            if config.select_every and step % config.select_every == 0 and fraction >= config.select_from:
                best, validated = _select(config, student, optimizer, step, device, multiplier, last, best, bar,
                                          progress), step
            if step % config.save_interval == 0:  # every process gathers, the main one writes
                save_checkpoint(config, student, optimizer, step, f"step-{step}",
                                {"seconds": last["seconds"], "multiplier": multiplier.state_dict(),
                                 **({} if average is None else {"weight_average": average.state_dict()})}, d.main,
                                records={BUDGET_RECORD: budget_record(config, multiplier.beta, step)})
                if d.main:
                    prune_checkpoints(out)
    final = None
    if finished:
        extra = {"seconds": last.get("seconds", 0.0), "multiplier": multiplier.state_dict()}
        if config.select_every:  # the last iterate is validated too, then final/ takes the best one's weights
            if validated != step:
                best = _select(config, student, optimizer, step, device, multiplier, last, best, bar, progress)
            load_student_weights(out / BEST, student)
            extra["selected"] = best
        if average is not None:  # final/ holds the average; its record says since which step (no tensors)
            average.copy_to_student()
            extra["weight_average"] = {"decay": average.decay, "since": average.since, "average": None}
        final = save_checkpoint(config, student, optimizer, step, FINAL, extra, d.main,
                                records={BUDGET_RECORD: budget_record(config, multiplier.beta, step)})
    bar.close()
    del teacher, student, joint, optimizer, batches  # the sharded modules go before their process group
    parallel.close_distributed(d)
    return {"step": step, "final": None if final is None else str(final), "log": last, "betas": betas,
            "selected": best if finished and config.select_every else None,
            "averaged_since": average.since if finished and average is not None else None}


def _select(config: KaizenTrainConfig, student, optimizer, step: int, device: torch.device, multiplier, last: dict,
            best: dict | None, bar, progress: bool) -> dict:
    """:func:`select_iterate` at ``step``, with a line under the progress bar."""
    extra = {"seconds": last.get("seconds", 0.0), "multiplier": multiplier.state_dict()}
    best, result = select_iterate(config, student, optimizer, step, device, extra, best)
    if progress:
        bar.write(f"kaizen-train: step {step}: validation accuracy {result['accuracy']:.3f} (best: step {best['step']}, "
                  f"{best['accuracy']:.3f})")
    return best


def _reset_selection(out: Path, resumed_step: int | None) -> dict | None:
    """The checkpoint selection's files at the start of a run. A new run (``resumed_step`` None) removes ``best/``
    and ``selection.jsonl``. A run resumed from step ``s`` drops the ``selection.jsonl`` lines after ``s`` (it
    validates those steps again) and keeps ``best/``, an iterate of this same run even when it is newer than ``s``;
    returns that record (``None`` when there is none)."""
    if resumed_step is None:
        (out / SELECT_LOG).unlink(missing_ok=True)
        shutil.rmtree(out / BEST, ignore_errors=True)
        return None
    drop_log_lines_after(out / SELECT_LOG, resumed_step)
    state = out / BEST / STATE_FILE
    return torch.load(state, map_location="cpu", weights_only=False)["selected"] if state.is_file() else None


def _check_same_beta(beta: float, d, device: torch.device) -> None:
    """Every process holds the same multiplier (one all-reduce of ``(β, -β)`` by max); a no-op for one process.
    It holds by construction (the same global rows, the same arithmetic): this guards that invariant."""
    if d.world == 1:
        return
    import torch.distributed as dist

    t = torch.tensor([beta, -beta], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if float(t[0]) != -float(t[1]):
        raise RuntimeError(f"the budget multiplier differs between processes (from {-float(t[1])} to {float(t[0])}): "
                           "they must update it from the same global rows")
