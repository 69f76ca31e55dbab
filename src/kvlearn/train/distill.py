"""Retrofit KVpop (or the trained baselines StreamingLLM+ and DMS, below) onto a trained model by distillation
(GitHub issue #10, item 2; single process).

Read top to bottom: config, models, losses, schedule, checkpoints, one step (:func:`train_step`; and
:func:`dense_distill_step`, the plain distillation step of the dense model it is timed against), loop.

* **Teacher**: the frozen dense model (:func:`kvlearn.load`, SDPA attention, no gradient).
* **Student**: a copy with :func:`~kvlearn.kvpop.apply.apply_kvpop`, run with the ``"kvpop_train"`` attention
  (:mod:`kvlearn.kvpop.train_attention`): every layer attends under the running top-k cutoff of its own predicted
  static priorities (scorer on detached keys/values, the layer's decay) through the sparse retention attention.
* **Target**: the future-attention target is computed from the *student's* queries and keys with the *sparse* LSE
  its retention attention returned (the paper's approximate target, appendix D.3 / Eq. 9, 34: the normaliser of
  the sparse pass is reused instead of a second dense causal pass). It is detached.
* **Teacher policy and decisions**: :func:`~kvlearn.kvpop.policy.stacked_teacher_policy` (every layer in one pass) on the
  targets with the layers' (detached) decay, :func:`~kvlearn.kvpop.policy.boundary_decisions` at ``queries_per_step`` positions drawn by
  :func:`~kvlearn.kvpop.policy.sample_query_positions` (one draw per step, shared by the layers).
* **Loss** = KL(teacher || student) over the teacher's top-``kd_topk`` tokens (teacher probabilities renormalised
  over its top-k at temperature 1, student log-probabilities of the full vocabulary), averaged over supervised
  tokens, + ``boundary_weight`` × the mean over layers of :func:`~kvlearn.kvpop.loss.boundary_loss`. The
  scorer/decay parameters get only the boundary gradient (their ranks enter the attention as integers); the
  backbone gets only the KD gradient (scorer inputs are detached). Opt-in, ``scorer_kd`` > 0: the KD gradient also
  reaches the scorers and decays through a straight-through soft retention on ``scorer_kd_queries`` rows per step
  drawn after the boundary positions from the same generator (:mod:`kvlearn.kvpop.scorer_kd`; the forward unchanged).
* **Optimiser**: AdamW with three groups: existing weights at a constant ``lr``, the new KVpop weights at ``lr_new``
  with a linear warm-up then a cosine to ``min_lr_ratio`` of it, and the per-head decay parameters ``alpha`` on the
  same schedule at ``lr_decay`` (Adam moves ``alpha`` by at most about the learning rate per step, and the decay's
  range spans ``alpha`` in about [-5, 5]: at ``lr_new`` it could not cross it in a retrofit of ~1000 steps;
  docs/DESIGN.md "The learned decay"). Fused AdamW on CUDA (:func:`make_optimizer`). Gradient clipping; bf16
  autocast on CUDA only. ``freeze_backbone`` (kvpop): the existing weights take no gradient and no update, so only the
  boundary loss trains (the scorers and decays on a fixed backbone, e.g. a trained student's own, ``init_student``);
  the KD term is still computed and logged.
* **Data**: :class:`~kvlearn.testbed.data.TestbedStream` (batch ``b`` of the stream is step ``b``: a resumed run
  sees the batches an uninterrupted run would).
* **Processes**: one, or several under ``torchrun`` (:mod:`kvlearn.train.parallel`): the student and the teacher
  are FSDP2-sharded per decoder layer, each process trains on its share of the rows of the same global batch
  (``batch_size`` is global and must be a multiple of the process count), and every loss statistic is reduced over
  the processes, so ``N`` processes take the same steps as one (tested with gloo on the CPU). Rank 0 logs and
  writes the checkpoints, in the single-process format.
* **Output folder**: ``step-<N>/`` checkpoints every ``save_interval`` steps (a loadable model folder plus
  ``trainer_state.pt``: optimizer state and step; written to a temporary folder, then renamed), the last two
  kept; ``final/`` at the end (loadable by :func:`kvlearn.load`, evaluable with ``kvlearn eval --method kvpop``);
  ``train_log.jsonl`` (one line per step). ``resume=True`` continues from the newest ``step-<N>``.

**The other trained baselines** (``method``, issue #10; docs/DESIGN.md "DMS and StreamingLLM+"), by the same loop,
KD loss, optimiser, data and checkpoints:

* ``streaming_plus``: no new modules; the student attends under the sinks + window mask of ``streaming``
  (:mod:`kvlearn.eviction.streaming_plus`, the ``"streaming_train"`` attention). Loss = KD only.
* ``dms``: :func:`~kvlearn.dms.apply.apply_dms` gates (optimiser group 1, ``lr_new``); the student attends with
  DMS's soft delayed eviction under Gumbel noise drawn from a generator seeded by ``(seed, step)``
  (:mod:`kvlearn.dms.attention`). Loss = KD + ``compression_weight`` × the compression hinge with the target
  closed fraction ramped by :meth:`~kvlearn.config.DMSConfig.target_fraction` over the run.
"""

from __future__ import annotations

import copy
import datetime as _dt
import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

from ..config import DMSConfig, KVpopConfig, StreamingConfig
from ..errors import check, check_int, check_non_negative, check_positive
from ..output_paths import check_output_folder
from ..kvpop.apply import apply_kvpop, model_budget_config
from ..kvpop.loss import boundary_loss
from ..kvpop.policy import BoundaryDecisions, boundary_decisions, sample_query_positions, stacked_teacher_policy
from ..kvpop.scorer_kd import ScorerKD, scorer_kd_rows
from ..kvpop.train_attention import SHARE, TrainForward, use_train_attention
from ..ops import distill_loss
from ..ops.distill_loss import kd_loss
from ..ops.quant import BITS as KV_BITS
from ..testbed.data import TestbedStream, check_mixture, dense_share, shard_rows
from ..hf import copy_tokenizer_files, unpadded_causal_masks
from ..lineage import write_teacher_record
from . import parallel
from .cuda_graph import EAGER_STEPS, CudaGraphStep, check_graph_step, plain_optimizer_groups, prepare_capturable
from .schedule import warmup_cosine
from ..testbed.tasks import FAMILIES, MAX_LENGTH, MIN_LENGTH

METHODS = ("kvpop", "streaming_plus", "dms")
NEW_MODULES = {"kvpop": ".kvpop.", "streaming_plus": None, "dms": ".dms."}  # parameter-name marker of the new weights

__all__ = ["RetrofitConfig", "retrofit", "train_step", "dense_student", "dense_distill_step",
           "distill_losses", "student_forward", "latest_checkpoint"]

STATE_FILE = "trainer_state.pt"
LOG_FILE = "train_log.jsonl"
FINAL = "final"
KEEP_CHECKPOINTS = 2


def default_out() -> str:
    """A new folder per run: ``runs/retrofit-<UTC time>`` (``runs/`` is not tracked)."""
    return "runs/retrofit-" + _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")


@dataclass
class RetrofitConfig:
    model: str  # checkpoint folder of the dense model (the teacher)
    out: str = field(default_factory=default_out)
    overwrite: bool = False  # an existing non-empty ``out`` is refused unless this is set (or resume)
    resume: bool = False  # continue from the newest step-<N> checkpoint in ``out``
    # budget 1024 = 4 sinks + the KVpop paper's window of 256 (its Table 3) + top-764
    kvpop: KVpopConfig = field(default_factory=lambda: KVpopConfig(window=256, topk=764, scorer="mlp"))
    # which trained method: kvpop (the config above), streaming_plus (``streaming``) or dms (``dms``)
    method: str = "kvpop"
    streaming: StreamingConfig | None = None
    dms: DMSConfig | None = None
    compression_weight: float = 1.0  # dms: weight of the compression hinge
    kv_bits: int | tuple[int | str, ...] | None = None  # kvpop: attend K/V at these bits (one, or per layer; "share")
    # kvpop: start the student from this trained KVpop student's weights (backbone, scorers, decays) instead of the
    # teacher's plus fresh scorers, e.g. a full-precision student refined under ``kv_bits``; the teacher stays ``model``
    init_student: str | None = None
    # start the student's backbone (every weight the teacher has) from this model folder of the teacher's shape, e.g.
    # a kaizen-train final/ whose backbone adapted to a configuration; the added modules start fresh, the teacher
    # stays ``model``
    init_backbone: str | None = None
    # kvpop: train the scorers and decays only (boundary loss); the existing weights stay as built (the teacher's, or
    # init_student's): a scorer-only refit on a fixed backbone
    freeze_backbone: bool = False
    # kvpop, mLSTM scorer: weight of ``readout_penalty_term`` (the mean squared norm of the readout weights ``a``)
    # added to the loss. The readout trained by the boundary loss alone costs recall on the testbed (docs/DESIGN.md
    # section 5, "The mLSTM from the MLP student"); this holds it near the skip path's ranking. 0: off
    readout_penalty: float = 0.0
    # kvpop: weight λ of the straight-through scorer distillation (:mod:`kvlearn.kvpop.scorer_kd`): on
    # ``scorer_kd_queries`` query rows per step the KD loss's gradient also reaches the scorers and decays through a
    # soft retention at temperature ``scorer_kd_temperature``, the forward unchanged. 0: off (the boundary loss alone
    # trains the scorers). docs/DESIGN.md section 5, "Scorers through the distillation loss"
    scorer_kd: float = 0.0
    scorer_kd_temperature: float = 1.0
    scorer_kd_queries: int = 256
    # kvpop, scorer_kd > 0: run the soft rows through torch.compile on CUDA (speed only: the same values to float32
    # rounding; a resumed run may change it)
    scorer_kd_compile: bool = False
    # length of the run: ``steps``, or a wall-clock budget in ``minutes`` (then the schedule follows elapsed time)
    steps: int | None = 1000
    minutes: float | None = None
    batch_size: int = 8
    seq_len: int = 4096
    # optimisation
    # existing weights, constant. 1e-4 since session 22: at 1e-5 Table 1's students kept 0.95 / 0.85 / 0.56 of the
    # teacher at CR 88% (MLP / mLSTM / DMS), at 1e-4 and fewer steps 0.98 / 0.88 / 0.74 (docs/DESIGN.md section 5)
    lr: float = 1e-4
    lr_new: float = 1e-3  # KVpop scorer weights (DMS gates): warm-up, then cosine
    # KVpop decays' alpha: the same schedule at this peak (Adam moves alpha ~lr per step; the decay range spans
    # alpha in about [-5, 5], so 1e-2 lets ~1000 steps cross it, lr_new's 1e-3 only ~1/8 of it)
    lr_decay: float = 1e-2
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    kd_topk: int = 256
    boundary_weight: float = 1.0
    queries_per_step: int = 64  # boundary-loss query positions per step (appendix B.6)
    late_fraction: float = 0.5
    dense_fraction: float = 0.75  # testbed rows with in-context Q/A pairs
    family_weights: tuple[float, ...] | None = None  # sampling weights of (trace, niah, vt, recall); None: uniform
    save_interval: int = 200
    seed: int = 0
    device: str = "cpu"
    num_workers: int | None = None  # data-generation worker processes; None: default_num_workers(device)
    # replay each step's device part as one CUDA graph after a few eager steps (one CUDA process; kvpop and
    # streaming_plus): the same updates, fewer host launches (:class:`GraphedRetrofitStep`; speed only, a resumed
    # run may change it)
    cuda_graph_step: bool = False

    def __post_init__(self) -> None:
        check(self.method in METHODS, f"method={self.method!r} is unknown: expected one of {', '.join(METHODS)}")
        if isinstance(self.kvpop, dict):
            self.kvpop = KVpopConfig.from_record(self.kvpop)
        if isinstance(self.streaming, dict):
            self.streaming = StreamingConfig(**self.streaming)
        if isinstance(self.dms, dict):
            self.dms = DMSConfig(**self.dms)
        check(isinstance(self.kvpop, KVpopConfig), f"kvpop of type {type(self.kvpop).__name__} is invalid: expected a KVpopConfig")
        if self.method == "kvpop":
            check(self.kvpop.topk >= 1, f"topk={self.kvpop.topk} is invalid: retrofitting needs a long-range budget >= 1")
            budget = self.kvpop.sinks + self.kvpop.window + self.kvpop.topk
        elif self.method == "streaming_plus":
            check(isinstance(self.streaming, StreamingConfig),
                  f"method 'streaming_plus' needs streaming=StreamingConfig(budget=..., sinks=...), got {self.streaming!r}")
            budget = self.streaming.budget
        else:
            check(isinstance(self.dms, DMSConfig), f"method 'dms' needs dms=DMSConfig(...), got {self.dms!r}")
            budget = self.dms.sinks + self.dms.window if self.dms.budget is None else self.dms.budget
        if self.kv_bits is not None:
            check(self.method == "kvpop", f"kv_bits={self.kv_bits!r} is for method 'kvpop' (a student served under "
                                          f"kaizen+kvpop at that precision), not {self.method!r}")
            single = isinstance(self.kv_bits, int)
            bits = (self.kv_bits,) if single else tuple(self.kv_bits)
            check(len(bits) > 0 and all(b == SHARE or (isinstance(b, int) and not isinstance(b, bool) and b in KV_BITS)
                                        for b in bits) and (single or bits[0] != SHARE),
                  f"kv_bits={self.kv_bits!r} is invalid: expected bit-widths in {{2, 4, 8, 16}} (one, or one per layer, "
                  "where a later layer may be 'share': it reads the nearest earlier layer's keys and values)")
            self.kv_bits = bits[0] if single else bits
        if self.init_student is not None:
            check(self.method == "kvpop", f"init_student={self.init_student!r} is for method 'kvpop' (a trained KVpop "
                                          f"student to continue from), not {self.method!r}")
            check(Path(self.init_student, "config.json").is_file(),
                  f"init_student={self.init_student!r} is not a model folder (no config.json): expected the final/ "
                  "folder of a kvlearn retrofit")
        if self.init_backbone is not None:
            check(self.init_student is None, f"init_backbone={self.init_backbone!r} and init_student="
                                             f"{self.init_student!r} exclude each other: init_student already holds a "
                                             "backbone; give one of them")
            check(Path(self.init_backbone, "config.json").is_file(),
                  f"init_backbone={self.init_backbone!r} is not a model folder (no config.json): expected e.g. the "
                  "final/ folder of a kvlearn kaizen-train or retrofit run")
        check(isinstance(self.freeze_backbone, bool),
              f"freeze_backbone={self.freeze_backbone!r} is invalid: expected True or False")
        check(not self.freeze_backbone or self.method == "kvpop",
              f"freeze_backbone=True is for method 'kvpop' (its scorers train by the boundary loss alone), not "
              f"{self.method!r}")
        check_non_negative("readout_penalty", self.readout_penalty)
        check(not self.readout_penalty or (self.method == "kvpop" and self.kvpop.scorer == "mlstm"),
              f"readout_penalty={self.readout_penalty!r} is for method 'kvpop' with scorer 'mlstm' (it penalises the "
              f"memory readout's weights), not method {self.method!r} with scorer {self.kvpop.scorer!r}")
        check_non_negative("scorer_kd", self.scorer_kd)
        check(not self.scorer_kd or self.method == "kvpop",
              f"scorer_kd={self.scorer_kd!r} is for method 'kvpop' (it trains KVpop's scorers through the "
              f"distillation loss), not {self.method!r}")
        check_positive("scorer_kd_temperature", self.scorer_kd_temperature)
        check_int("scorer_kd_queries", self.scorer_kd_queries, 1)
        for name in ("scorer_kd_temperature", "scorer_kd_queries"):  # settings of a path that is off: a mistake
            check(self.scorer_kd or getattr(self, name) == SCORER_KD_OFF[name],
                  f"{name}={getattr(self, name)!r} sets the scorer distillation, which is off (scorer_kd=0): give "
                  "scorer_kd > 0 (--scorer-kd WEIGHT) too")
        check(isinstance(self.scorer_kd_compile, bool),
              f"scorer_kd_compile={self.scorer_kd_compile!r} is invalid: expected True or False")
        check(self.scorer_kd or not self.scorer_kd_compile,
              "scorer_kd_compile=True compiles the scorer distillation, which is off (scorer_kd=0): give scorer_kd > 0 "
              "(--scorer-kd WEIGHT) too")
        check(isinstance(self.cuda_graph_step, bool),
              f"cuda_graph_step={self.cuda_graph_step!r} is invalid: expected True or False")
        if self.cuda_graph_step:
            check_graphed_method(self.method)
            check(not self.scorer_kd, f"cuda_graph_step=True with scorer_kd={self.scorer_kd!r} is not supported: the "
                                      "scorer distillation's rows are drawn per step outside the graph's inputs; "
                                      "expected scorer_kd=0")
            check(self.kvpop.mlstm_compile_mode == "default" or self.method != "kvpop",
                  f"cuda_graph_step=True with mlstm_compile_mode={self.kvpop.mlstm_compile_mode!r}: the scorer's own "
                  "CUDA graphs would be nested in the step's; expected mlstm_compile_mode='default'")
            check(self.device.startswith("cuda"),
                  f"cuda_graph_step=True on device={self.device!r}: a CUDA graph needs a CUDA device (device='cuda')")
        check_non_negative("compression_weight", self.compression_weight)
        check((self.steps is None) != (self.minutes is None),
              f"steps={self.steps!r}, minutes={self.minutes!r}: expected exactly one of them")
        if self.steps is not None:
            check_int("steps", self.steps, 1)
        else:
            check_positive("minutes", self.minutes)
        check_int("batch_size", self.batch_size, 1)
        check_int("seq_len", self.seq_len, MIN_LENGTH, MAX_LENGTH, hint=" (the testbed's example lengths)")
        check(budget < self.seq_len,
              f"budget = {budget} is invalid for seq_len={self.seq_len}: expected < seq_len "
              "(else nothing is evicted and nothing is learned)")
        for name in ("lr", "lr_new", "lr_decay", "grad_clip"):
            check_positive(name, getattr(self, name))
        for name in ("weight_decay", "boundary_weight"):
            check_non_negative(name, getattr(self, name))
        check(0 <= self.late_fraction <= 1, f"late_fraction={self.late_fraction!r} is invalid: expected a number in [0, 1]")
        check_int("queries_per_step", self.queries_per_step, 1)
        check_trainer_fields(self)
        check_out_folder(self)


def check_out_folder(config) -> None:
    """A trainer's ``out`` folder (retrofit, kaizen-train): a folder, not a file; with ``resume`` it must hold a
    ``step-<N>`` checkpoint; otherwise it must be new or empty unless ``overwrite``. One-line errors."""
    out = Path(config.out)
    check_output_folder(out, "out")
    if config.resume:
        check(latest_checkpoint(out) is not None,
              f"resume: out={config.out!r} holds no step-<N> checkpoint: expected the folder of an earlier run")
    else:
        check(config.overwrite or not out.exists() or not any(out.iterdir()),
              f"out={config.out!r} already holds files: pass overwrite (--overwrite) to replace them, resume "
              "(--resume) to continue, or choose a new folder")


GPU_DATA_WORKERS = 3  # data-generation workers of a trainer on a CUDA device unless num_workers is given


def default_num_workers(device: str) -> int:
    """A trainer's data-generation workers when ``num_workers`` is None: :data:`GPU_DATA_WORKERS` on a CUDA device,
    capped at the CPU cores less one, shared among the host's processes under ``torchrun`` (``LOCAL_WORLD_SIZE``;
    one process when it is unset or not a number), and 0 on the CPU, where workers would take the cores the training
    step uses. Without workers the data generation held a GPU trainer back (one kaizen-train alone on an H100: 8.9
    steps/s with none, 10.3 with 3; docs/FINDINGS.md, "KV-Kaizen"). The testbed stream deals its batches round robin
    over the workers, so the batches do not depend on the number."""
    if not device.startswith("cuda"):
        return 0
    local = os.environ.get("LOCAL_WORLD_SIZE", "1")
    processes = max(int(local), 1) if local.isdigit() else 1
    return min(GPU_DATA_WORKERS, max((os.cpu_count() or 1) - 1, 0) // processes)


def check_trainer_fields(config) -> None:
    """The checks every distillation trainer's config shares (retrofit, kaizen-train): schedule and loop integers
    (``num_workers`` None becomes :func:`default_num_workers` of the device), the share of dense-format rows
    (``dense_fraction``, made a float in [0, 1]), the family mixture (``family_weights``: None, or one weight per
    testbed family, made a tuple of floats by the stream's own check), the device, and the model folder against
    ``seq_len``; one-line errors."""
    check(0 <= config.min_lr_ratio <= 1, f"min_lr_ratio={config.min_lr_ratio!r} is invalid: expected a number in [0, 1]")
    config.dense_fraction = dense_share(config.dense_fraction, "dense_fraction")
    if config.family_weights is not None:
        config.family_weights = tuple(check_mixture(FAMILIES, tuple(config.family_weights))[1])
    check(isinstance(config.device, str) and (config.device == "cpu" or config.device.startswith("cuda")),
          f"device={config.device!r} is invalid: expected cpu or cuda[:N]")
    if config.num_workers is None:
        config.num_workers = default_num_workers(config.device)
    for name, low in (("warmup_steps", 0), ("kd_topk", 1), ("save_interval", 1), ("seed", 0), ("num_workers", 0)):
        check_int(name, getattr(config, name), low)
    check(config.device == "cpu" or torch.cuda.is_available(),
          f"device={config.device!r} requested but CUDA is not available: use device='cpu'")
    check_model_folder(config.model, config.seq_len)


def check_model_folder(path: str, seq_len: int) -> None:
    """One-line errors for a missing checkpoint folder, an unsupported family or a too long ``seq_len``."""
    from ..hf import read_model_config

    limit = getattr(read_model_config(path), "max_position_embeddings", None)
    check(limit is None or seq_len <= limit,
          f"seq_len={seq_len} exceeds the model's max_position_embeddings={limit}: expected seq_len <= {limit}")


# ----------------------------------------------------------------------------------------------------------------
# models


def build_models(config: RetrofitConfig, device: torch.device):
    """``(teacher, student)``: the frozen dense model (eval mode, no gradient) and a float32 copy with KVpop applied,
    switched to the ``"kvpop_train"`` attention, in train mode (unsharded: see :func:`parallel.shard_model`)."""
    from ..checkpoint import load as load_model

    teacher = load_model(config.model, dtype=torch.float32, device=device)
    teacher.requires_grad_(False)
    student = copy.deepcopy(teacher)
    if config.init_backbone is not None:
        init_backbone(student, config.init_backbone)
    if config.method == "kvpop":
        bits = layer_kv_bits(config, student.config.num_hidden_layers)  # one-line error for a list of another length
        apply_kvpop(student, config.kvpop)
        if config.init_student is not None:
            init_from_student(student, config.init_student)
        if bits is not None:  # recorded in config.json: kaizen+kvpop serves the student under it
            from ..kaizen.actions import Backbone, KaizenConfig
            from ..kvpop.apply import KV_CONFIGURATION_KEY

            text = " ".join("share" if b == SHARE else f"b{b}" for b in bits)
            choice = KaizenConfig.parse(Backbone.from_config(student.config), text)  # checks layer 0, the bits
            setattr(student.config, KV_CONFIGURATION_KEY, str(choice))
        use_train_attention(student)
    elif config.method == "streaming_plus":
        from ..eviction import streaming_plus

        streaming_plus.apply(student, config.streaming)
        streaming_plus.use_train_attention(student)
    else:
        from ..dms.apply import apply_dms
        from ..dms.attention import use_train_attention as use_dms_attention

        apply_dms(student, config.dms)
        use_dms_attention(student)
    student.requires_grad_(True)
    student.train()
    return teacher, student


def init_backbone(student, path: str, option: str = "init_backbone") -> None:
    """Copy every weight of ``student`` (still the teacher's copy, before any method's modules) from the safetensors
    of model folder ``path``, in place. The folder may hold more (a selector, scorers: left out); each of the
    student's weights must be there with its shape, except a tied ``lm_head`` (saved once, as the embeddings). One-line
    error otherwise, naming ``option`` (the setting that gave ``path``)."""
    state = folder_weights(path)
    check(len(state) > 0, f"{option}={path!r} holds no *.safetensors weights: expected a saved model folder")
    target = student.state_dict()
    tied = bool(getattr(student.config, "tie_word_embeddings", False))
    missing = sorted(k for k in target if k not in state and not (tied and k.startswith("lm_head")))
    misfit = sorted(k for k in target if k in state and state[k].shape != target[k].shape)
    check(not (missing or misfit),
          f"{option}={path!r} does not fit the teacher's shape: "
          + "; ".join(f"{what} {keys[0]}" + (f" (+{len(keys) - 1} more)" if len(keys) > 1 else "")
                      for what, keys in (("missing", missing), ("other shape", misfit)) if keys)
          + " (expected a model of the teacher's architecture, e.g. one trained from it)")
    with torch.no_grad():
        for k, v in target.items():
            if k in state:
                v.copy_(state[k].to(v.dtype))


def init_from_student(student, path: str) -> None:
    """Copy a trained KVpop student's weights (backbone, scorers, decays) into ``student`` (the teacher's copy with
    KVpop applied under the run's config), in place. The run's config decides the pattern (window, top-k, bits), so a
    student trained at one budget may be refined at another; the weights must fit exactly: a folder without KVpop,
    another scorer or another backbone shape is a one-line error."""
    from ..checkpoint import load as load_model
    from ..kvpop.apply import recorded_config

    trained = load_model(path, dtype=torch.float32)
    recorded = recorded_config(trained)
    check(recorded is not None, f"init_student={path!r} has no KVpop modules (its config.json records no kvpop): "
                                "expected the final/ folder of a kvlearn retrofit with method kvpop")
    ours = recorded_config(student)
    check(recorded.scorer == ours.scorer, f"init_student={path!r} has scorer {recorded.scorer!r}, this run "
                                          f"{ours.scorer!r}: expected the same scorer (--scorer {recorded.scorer})")
    state, target = trained.state_dict(), student.state_dict()
    missing = sorted(set(target) - set(state))
    extra = sorted(set(state) - set(target))
    misfit = sorted(k for k in set(state) & set(target) if state[k].shape != target[k].shape)
    check(not (missing or extra or misfit),
          f"init_student={path!r} does not fit this run's student: "
          + "; ".join(f"{what} {keys[0]}" + (f" (+{len(keys) - 1} more)" if len(keys) > 1 else "")
                      for what, keys in (("missing", missing), ("unexpected", extra), ("other shape", misfit)) if keys)
          + " (expected a student retrofitted from the same teacher with the same scorer settings)")
    with torch.no_grad():
        for k, v in target.items():
            v.copy_(state[k].to(v.dtype))


def method_forward(config: RetrofitConfig, student, input_ids: torch.Tensor, step: int, fraction: float):
    """``(logits [B, T, V], loss, log)`` of one student forward of a non-KVpop method: ``loss`` its own term
    (a float32 scalar, 0 for streaming_plus) and ``log`` its detached metrics. dms: Gumbel noise from a CPU
    generator seeded by ``(seed, step)`` (a resumed run draws the same noise); target closed fraction at
    ``fraction`` of the run."""
    if config.method == "streaming_plus":
        logits = student(input_ids=input_ids, attention_mask=unpadded_causal_masks(student),
                         streaming_train=config.streaming, use_cache=False).logits
        return logits, torch.zeros((), device=logits.device), {}
    from ..dms.attention import DMSTrainForward, compression_loss

    gen = torch.Generator().manual_seed(config.seed * 1_000_003 + step + 7)
    state = DMSTrainForward(config.dms, generator=gen, backend=config.dms.train_attention)
    logits = student(input_ids=input_ids, attention_mask=unpadded_causal_masks(student), dms_train=state,
                     use_cache=False).logits
    target = config.dms.target_fraction(fraction)
    loss, closed, per_head = compression_loss(state.records, target, config.dms.compression_scope)
    # how unevenly the heads close: the batch's closed fraction of each (layer, KV head), its least and most (0-d
    # tensors, read back with the step's other values)
    lowest, highest = torch.aminmax(per_head.mean(dim=1))  # over [layers, kv_heads]
    return logits, loss, {"compression": float(loss.detach()), "closed_fraction": closed, "target_fraction": target,
                          "closed_head_min": lowest, "closed_head_max": highest}


def layer_kv_bits(config: RetrofitConfig, num_layers: int) -> tuple[int | str, ...] | None:
    """``config.kv_bits`` as one entry per decoder layer, a bit-width or ``"share"`` (``None``: unquantized);
    one-line error for a list of another length."""
    if config.kv_bits is None:
        return None
    if isinstance(config.kv_bits, int):
        return (config.kv_bits,) * num_layers
    check(len(config.kv_bits) == num_layers,
          f"kv_bits lists {len(config.kv_bits)} bit-widths for a model of {num_layers} layers: expected one, or one "
          "per layer")
    return tuple(config.kv_bits)


def student_forward(student, input_ids: torch.Tensor, kvpop: KVpopConfig,
                    kv_bits: tuple[int | str, ...] | None = None, scorer_kd: ScorerKD | None = None):
    """``(logits [B, T, V], TrainForward)``: one student forward under its running top-k retention, attending keys
    and values at ``kv_bits`` (per layer; ``None``: unquantized), with the straight-through scorer distillation
    ``scorer_kd`` on its rows (``None``: off; the logits are the same either way)."""
    state = TrainForward(kvpop, kv_bits, scorer_kd)
    logits = student(input_ids=input_ids, attention_mask=unpadded_causal_masks(student), kvpop_train=state,
                     use_cache=False).logits
    return logits, state


# the scorer-distillation settings of a run without it: RetrofitConfig's defaults (a run that is off must keep them),
# and those of checkpoints written before the settings existed
SCORER_KD_OFF = {"scorer_kd": 0.0, "scorer_kd_temperature": 1.0, "scorer_kd_queries": 256}


# ----------------------------------------------------------------------------------------------------------------
# losses


def distill_losses(state: TrainForward, query_positions: torch.Tensor, reduce_sum=None) -> dict:
    """Boundary loss and retention metrics of one student forward, averaged over its layers.

    ``query_positions``: int64 ``[n]`` (:func:`sample_query_positions`). Returns ``boundary`` (scalar, gradient into
    the scorer/decay parameters only), and detached float32 scalars on the records' device ``boundary_accuracy``,
    ``keep_fraction`` (share of valid teacher decisions that keep the new token) and ``recall`` (share of the
    teacher's retained eligible tokens the student also retains, at the sampled queries): tensors, not floats, so
    that a step reads nothing back from the GPU per layer (the caller reads them once). ``reduce_sum``: global-batch
    statistics under data parallelism (:func:`~kvlearn.kvpop.loss.boundary_loss`); the metrics stay this
    process's.

    Every layer at once: the teacher policies in one pass (:func:`~kvlearn.kvpop.policy.stacked_teacher_policy`,
    layers along the batch), the decisions of all layers in one call, and one
    :func:`~kvlearn.kvpop.loss.boundary_loss` with the layers along the head axis (``groups`` = layers: each layer
    weighted and normalised as alone), so a step launches these kernels once rather than once per layer. Each
    term is the mean over the layers of that layer's own value (the same numbers as a loop over the layers, up to
    the summation order of the loss; tested against that loop)."""
    cfg = state.config
    s, w, k = cfg.sinks, cfg.window, cfg.topk
    records = [state.records[layer] for layer in sorted(state.records)]
    layers = len(records)
    b, h, _ = records[0].priorities.shape
    teacher = stacked_teacher_policy([r.target for r in records], [r.log_gamma for r in records], s, w, k)
    # one host-to-device copy a step, non_blocking: from pageable memory CUDA stages the bytes at once and the host
    # does not wait for the stream (a blocking copy here made the host wait for the whole forward, mid-step)
    queries = query_positions.to(teacher.ranks.device, non_blocking=True)
    dec = boundary_decisions(teacher, queries, s, w, k)  # [layers * b, h, n]

    def along_heads(x: torch.Tensor) -> torch.Tensor:  # [layers * b, h, ...] (layer-major) -> [b, layers * h, ...]
        return x.reshape(layers, b, h, *x.shape[2:]).transpose(0, 1).reshape(b, layers * h, *x.shape[2:])

    folded = BoundaryDecisions(*(along_heads(getattr(dec, f)) for f in ("query", "t_new", "t_bnd", "y", "valid")))
    pred = torch.stack([r.priorities for r in records], dim=1).reshape(b, layers * h, -1)
    result = boundary_loss(pred, along_heads(teacher.priorities), folded, temperature=cfg.loss_temperature,
                           margin_weighting=cfg.margin_weighting, margin_min_weight=cfg.margin_min_weight,
                           margin_temperature=cfg.margin_temperature, balance=cfg.balance,
                           balance_clip=tuple(cfg.balance_clip), reduce_sum=reduce_sum, groups=layers)
    with torch.no_grad():
        valid = dec.valid.reshape(layers, -1)
        keep = ((dec.y.reshape(layers, -1) > 0) & valid).sum(1) / valid.sum(1).clamp(min=1)  # [layers]
        recall = retention_recall(torch.stack([r.ranks for r in records]), torch.stack([r.cutoffs for r in records]),
                                  teacher.ranks.view(layers, b, h, -1), teacher.cutoffs.view(layers, b, h, -1),
                                  queries, s, w)
    return {"boundary": result.loss, "boundary_accuracy": result.accuracy.detach().float(),
            "keep_fraction": keep.float().mean(), "recall": recall}


@torch.no_grad()
def retention_recall(ranks, cutoffs, t_ranks, t_cutoffs, queries: torch.Tensor, sinks: int, window: int
                     ) -> torch.Tensor:
    """Share of the teacher's retained eligible tokens that the student retains too, at ``queries [n]`` (ranks and
    cutoffs int32 ``[B, H, T]``; eligible ``t``: ``sinks <= t <= q - window``, retained iff rank <= cutoff[q]): a
    float32 scalar tensor on their device (no read-back). ``[L, B, H, T]`` (``L`` layers at once): the mean over the
    layers of each layer's share."""
    T = ranks.shape[-1]
    t = torch.arange(T, device=ranks.device)
    q = queries.long()
    eligible = (t[None, :] >= sinks) & (t[None, :] <= q[:, None] - window)  # [n, T]

    def kept(r, c):  # [..., n, T]
        return (r[..., None, :] <= c[..., q][..., None]) & eligible

    teacher, student = kept(t_ranks, t_cutoffs), kept(ranks, cutoffs)
    if ranks.dim() == 3:
        return ((teacher & student).sum() / teacher.sum().clamp(min=1)).float()
    dims = tuple(range(1, teacher.dim()))
    return ((teacher & student).sum(dims) / teacher.sum(dims).clamp(min=1)).float().mean()


# ----------------------------------------------------------------------------------------------------------------
# schedule


def new_lr_at(config: RetrofitConfig, step: int, fraction: float) -> float:
    """Learning rate of the new weights: linear warm-up over ``warmup_steps``, then a cosine over the run (``fraction``
    of it done) down to ``min_lr_ratio`` of ``lr_new`` (:func:`kvlearn.train.schedule.warmup_cosine`)."""
    return warmup_cosine(config.lr_new, step, fraction, config.warmup_steps, config.min_lr_ratio)


def decay_lr_at(config: RetrofitConfig, step: int, fraction: float) -> float:
    """Learning rate of the KVpop decays' ``alpha``: :func:`new_lr_at`'s schedule with peak ``lr_decay``."""
    return new_lr_at(config, step, fraction) * config.lr_decay / config.lr_new


def is_decay_parameter(name: str) -> bool:
    """Whether a parameter name is a KVpop decay's ``alpha`` (``...self_attn.kvpop.decay.alpha``)."""
    return name.endswith(".kvpop.decay.alpha")


def fused_adamw_applies(params) -> bool:
    """Whether :func:`make_optimizer` runs AdamW's fused CUDA kernel for ``params``: every one a plain CUDA
    floating-point tensor (no tensor subclass: FSDP2's DTensor parameters keep the default ``foreach``
    implementation, as do CPU parameters)."""
    params = list(params)
    return bool(params) and all(type(p) in (torch.nn.Parameter, torch.Tensor) and p.is_cuda and p.is_floating_point()
                                for p in params)


def freeze_existing_weights(student) -> None:
    """``requires_grad=False`` on every parameter of a KVpop ``student`` but its scorers and decays (the
    ``NEW_MODULES['kvpop']`` modules). :func:`make_optimizer` then leaves them out of its first group, so they get
    neither a gradient nor an update."""
    for name, p in student.named_parameters():
        if NEW_MODULES["kvpop"] not in name:
            p.requires_grad_(False)


def make_optimizer(config: RetrofitConfig, student, device: torch.device, fused: bool | None = None,
                   capturable: bool = False) -> torch.optim.AdamW:
    """AdamW with group 0 = the existing weights (constant ``lr``), group 1 = the method's new modules (``lr_new``;
    empty for ``streaming_plus``) but the KVpop decays, group 2 = the KVpop decays' ``alpha`` (``lr_decay``; empty
    for the other methods).

    ``fused``: None (default) takes the fused kernel (``fused=True``: the whole update in one multi-tensor kernel
    per list of tensors instead of a dozen ``foreach`` kernels; the same update up to float rounding) when
    :func:`fused_adamw_applies`, else torch's default (``foreach`` on CUDA, the per-tensor loop on the CPU);
    True/False force it on/off (``benchmarks/retrofit_step_speed.py --variants foreach_adamw``). A state dict
    loads into either kind (torch moves the ``step`` counters where the kind keeps them). ``capturable``: the step
    may be captured in a CUDA graph (``--variants graphed_step``)."""
    marker = NEW_MODULES[config.method]
    named = list(student.named_parameters())
    decay = [p for n, p in named if config.method == "kvpop" and is_decay_parameter(n)]
    new = [p for n, p in named if marker is not None and marker in n and not any(p is d for d in decay)]
    old = [p for n, p in named if (marker is None or marker not in n) and p.requires_grad]  # none: freeze_backbone
    if fused is None:
        fused = fused_adamw_applies(p for _, p in named)
    return torch.optim.AdamW([{"params": old, "lr": config.lr}, {"params": new, "lr": config.lr_new},
                              {"params": decay, "lr": config.lr_decay}],
                             weight_decay=config.weight_decay, betas=(0.9, 0.95), **({"fused": True} if fused else {}),
                             **({"capturable": True} if capturable else {}))


# ----------------------------------------------------------------------------------------------------------------
# checkpoints


def latest_checkpoint(out: str | os.PathLike) -> Path | None:
    """The newest ``step-<N>`` folder of ``out`` that holds a trainer state (None if there is none)."""
    out = Path(out)
    if not out.is_dir():
        return None
    steps = [(int(p.name[5:]), p) for p in out.iterdir()
             if p.name.startswith("step-") and p.name[5:].isdigit() and (p / STATE_FILE).is_file()]
    return max(steps)[1] if steps else None


def save_checkpoint(config: RetrofitConfig, student, optimizer, step: int, name: str, extra: dict | None = None,
                    main: bool = True, records: dict[str, dict] | None = None) -> Path:
    """Write ``out/<name>/`` atomically: a loadable model folder (float32 safetensors, ``config.json`` with the
    KVpop config, ``teacher.json`` naming the teacher and its weights' digest: :mod:`kvlearn.lineage`), ``records``
    (file name -> a JSON-able dict, written beside them: e.g. kaizen-train's budget multiplier) and
    ``trainer_state.pt`` (optimizer state keyed by parameter name, step). Written to a temporary folder, then renamed.
    Under data parallelism every process calls it (the state is gathered collectively) and only ``main`` writes."""
    weights = parallel.full_state_dict(student)
    optimizer_state = plain_optimizer_groups(parallel.full_optimizer_state_dict(student, optimizer))
    out = Path(config.out)
    if not main:
        return out / name
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".tmp-{name}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    student.save_pretrained(tmp, state_dict=weights, safe_serialization=True)
    copy_tokenizer_files(config.model, tmp)
    write_teacher_record(tmp, config.model)
    for file_name, record in (records or {}).items():
        (tmp / file_name).write_text(json.dumps(record, indent=1) + "\n")
    torch.save({"step": step, "optimizer": optimizer_state, "config": asdict(config), **(extra or {})},
               tmp / STATE_FILE)
    dest = out / name
    if dest.exists():  # replace: move the old one aside first, so a crash leaves one complete copy
        old = out / f".old-{name}"
        if old.exists():
            shutil.rmtree(old)
        os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old)
    else:
        os.replace(tmp, dest)
    return dest


def prune_checkpoints(out: Path) -> None:
    steps = sorted((int(p.name[5:]), p) for p in out.iterdir() if p.name.startswith("step-") and p.name[5:].isdigit())
    for _, p in steps[:-KEEP_CHECKPOINTS]:
        shutil.rmtree(p)


def _config_field(method: str) -> str:
    """The RetrofitConfig field holding ``method``'s config."""
    return {"kvpop": "kvpop", "streaming_plus": "streaming", "dms": "dms"}[method]


def read_trainer_state(path: Path, expected: dict, defaults: dict | None = None) -> dict:
    """The trainer state of checkpoint ``path`` (``trainer_state.pt``); a one-line error when a setting in ``expected``
    (``{config field: this run's value}``) differs from the one the checkpoint was trained with (``defaults``: the
    value of a field an older checkpoint did not record; a recorded KVpop config is read with
    :meth:`~kvlearn.config.KVpopConfig.from_record`, and a recorded DMS config's missing fields take
    :class:`~kvlearn.config.DMSConfig`'s defaults, so fields added since take the values they stood for). Values
    compare after a JSON round trip (tuples = lists)."""
    trainer = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
    saved = dict(trainer.get("config", {}))
    if isinstance(saved.get("kvpop"), dict):  # fields added to KVpopConfig since the run started take their old value
        saved["kvpop"] = asdict(KVpopConfig.from_record(saved["kvpop"]))
    if isinstance(saved.get("dms"), dict):  # and DMSConfig's (compression_scope: "model", what every run did before)
        saved["dms"] = {**asdict(DMSConfig()), **saved["dms"]}
    for name, want in expected.items():
        have = saved.get(name, (defaults or {}).get(name))
        check(json.loads(json.dumps(have)) == json.loads(json.dumps(want)),
              f"resume: {str(path)!r} was trained with {name}={have!r} but this run has {name}={want!r}: "
              "resume with the same settings, or start a new run")
    return trainer


def folder_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files of model folder ``path`` (on the CPU; empty when there are none)."""
    from safetensors.torch import load_file

    state = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(f))
    return state


def load_student_weights(path: Path, student) -> None:
    """Load checkpoint ``path``'s weights into the (unsharded) ``student``; one-line error when they do not match."""
    state = folder_weights(path)
    missing, unexpected = student.load_state_dict(state, strict=False)
    # tied embeddings are saved once: the only keys allowed missing are tied copies
    check(not unexpected and all("lm_head" in k for k in missing),
          f"checkpoint {str(path)!r} does not match the student (missing {missing[:2]}, unexpected {unexpected[:2]})")


def drop_log_lines_after(path: Path, step: int) -> None:
    """Keep the lines of the JSON-lines log ``path`` whose ``step`` is at most ``step`` (a resumed run logs the
    later ones again); nothing when the file does not exist."""
    if path.exists():
        lines = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
        path.write_text("".join(ln + "\n" for ln in lines))


def clear_run_outputs(out: Path) -> None:
    """Remove what an earlier run of a trainer wrote into ``out`` (its log, ``final/``, ``step-<N>/`` and temporary
    folders), nothing else."""
    for p in out.iterdir():
        if p.name == LOG_FILE:
            p.unlink()
        elif p.is_dir() and (p.name == FINAL or p.name.startswith(("step-", ".tmp-", ".old-"))):
            shutil.rmtree(p)


def load_trainer_state(path: Path, student, config: RetrofitConfig) -> dict:
    """Load the student weights of checkpoint ``path`` (into the unsharded student) and return its trainer state
    (``step``, ``optimizer``: load it with :func:`parallel.load_optimizer_state_dict` once the optimizer exists).
    One-line error when the checkpoint was trained with another method, method config or run length."""
    method_config = {"kvpop": config.kvpop, "streaming_plus": config.streaming, "dms": config.dms}[config.method]
    expected = {"method": config.method, _config_field(config.method): asdict(method_config), "steps": config.steps,
                "minutes": config.minutes, "seq_len": config.seq_len, "batch_size": config.batch_size,
                "seed": config.seed, "kv_bits": config.kv_bits, "family_weights": config.family_weights,
                "freeze_backbone": config.freeze_backbone, "readout_penalty": config.readout_penalty,
                **{k: getattr(config, k) for k in SCORER_KD_OFF}}
    trainer = read_trainer_state(path, expected, defaults={"method": "kvpop", "kv_bits": None, "family_weights": None,
                                                           "freeze_backbone": False, "readout_penalty": 0.0,
                                                           **SCORER_KD_OFF})
    load_student_weights(path, student)
    return trainer


# ----------------------------------------------------------------------------------------------------------------
# one step


def training_kvpop(config: RetrofitConfig, student) -> KVpopConfig:
    """The KVpop config of the training pattern: the top-k the student's bf16 cache will hold (``state_in_budget``:
    the mLSTM state's bytes take top-k slots; ``config.kvpop`` unchanged otherwise, and for the other methods)."""
    return model_budget_config(student, config.kvpop, torch.bfloat16) if config.method == "kvpop" else config.kvpop


def scorer_kd_of(config: RetrofitConfig, kv: KVpopConfig, generator: torch.Generator,
                 device: torch.device) -> ScorerKD | None:
    """This step's :class:`~kvlearn.kvpop.scorer_kd.ScorerKD` (rows drawn from ``generator``, the weight ``λ N / n``)
    under the training pattern ``kv``, or None when ``config.scorer_kd`` is 0."""
    if not config.scorer_kd:
        return None
    rows, scale = scorer_kd_rows(config.seq_len, kv.sinks, kv.window, kv.topk, config.scorer_kd_queries, generator)
    kd = ScorerKD(rows, config.scorer_kd * scale, config.scorer_kd_temperature, config.seq_len,  # checked on the CPU
                  compile=config.scorer_kd_compile)
    return replace(kd, rows=rows.to(device))


@dataclass(frozen=True)
class StepDraws:
    """The host's random draws of one KVpop step, made before the forward from one generator seeded by the run's
    seed and the step: the boundary loss's ``queries`` (int64 ``[n]``, CPU) and the scorer distillation's rows
    (``scorer_kd``: None when off)."""

    queries: torch.Tensor
    scorer_kd: ScorerKD | None


def step_draws(config: RetrofitConfig, kv: KVpopConfig, step: int, device: torch.device) -> StepDraws:
    """This step's :class:`StepDraws` (the query positions first, then the scorer-distillation rows)."""
    gen = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
    queries = sample_query_positions(config.seq_len, kv.sinks, kv.window, kv.topk, config.queries_per_step,
                                     config.late_fraction, generator=gen)  # [n]
    return StepDraws(queries, scorer_kd_of(config, kv, gen, device))


def step_tensors(config: RetrofitConfig, teacher, student, optimizer, input_ids: torch.Tensor, labels: torch.Tensor,
                 kv: KVpopConfig, draws: StepDraws | None, step: int, fraction: float,
                 d: parallel.DistInfo = parallel.DistInfo(), set_to_none: bool = True) -> tuple[dict, dict, torch.Tensor]:
    """The device's part of one optimizer step, reading nothing back: the teacher (no gradient) and the student
    under the method's training attention (bf16 autocast on CUDA), the loss (KD + the method's term), backward,
    clipping, the AdamW step and ``zero_grad(set_to_none)``. ``draws``: :func:`step_draws` (kvpop; None otherwise).
    Returns ``(summed, means, grad_norm)``: this process's loss shares (``loss``, ``kd``, and ``boundary``,
    ``readout_penalty`` where they apply) and metrics as 0-d tensors, and the gradient norm; :func:`train_step` reads
    them back once. A CUDA graph can capture this function with the same ``draws`` and batch each replay
    (``benchmarks/retrofit_step_speed.py --variants graphed_step``)."""
    reduce_sum = parallel.all_reduce_sum if d.world > 1 else None
    with torch.autocast(device_type=input_ids.device.type, dtype=torch.bfloat16, enabled=input_ids.device.type == "cuda"):
        with torch.no_grad():
            teacher_logits = teacher(input_ids=input_ids, attention_mask=unpadded_causal_masks(teacher),
                                     use_cache=False).logits  # [B, T, V]
        if config.method == "kvpop":
            bits = layer_kv_bits(config, student.config.num_hidden_layers)
            logits, state = student_forward(student, input_ids, kv, bits, draws.scorer_kd)
        else:
            logits, extra_loss, extra_log = method_forward(config, student, input_ids, step, fraction)
    # float32; under data parallelism each loss is this process's share of the global-batch value
    kd = kd_loss(logits, teacher_logits, labels, config.kd_topk, reduce_sum=reduce_sum)
    if config.method == "kvpop":
        parts = distill_losses(state, draws.queries, reduce_sum=reduce_sum)
        loss = kd + config.boundary_weight * parts["boundary"]
        shares = {"boundary": parts["boundary"].detach()}
        if config.readout_penalty:  # each process's share of it, as every loss term here
            penalty = config.readout_penalty * readout_penalty_term(student) / d.world
            loss = loss + penalty
            shares["readout_penalty"] = penalty.detach()
        means = {k: parts[k] for k in ("boundary_accuracy", "keep_fraction", "recall")}
    else:  # the compression term is a mean over rows: every process holds as many rows
        loss = kd + config.compression_weight * extra_loss / d.world
        shares, means = {}, dict(extra_log)
    (loss * d.world).backward()  # FSDP averages the gradients over the processes: the shares' sum
    grad_norm = torch.nn.utils.clip_grad_norm_(student.parameters(), config.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=set_to_none)
    return {"loss": loss.detach(), "kd": kd.detach(), **shares}, means, grad_norm


def read_back(summed: dict, means: dict, device: torch.device, d: parallel.DistInfo = parallel.DistInfo(),
              grad_norm: torch.Tensor | None = None) -> dict:
    """:func:`step_tensors`' values as floats in one read-back (one host sync): losses summed and metrics averaged
    over the processes, and ``grad_norm`` (the clipped gradients' global norm, the same on every process; a DTensor
    under FSDP) as it is, under ``"grad_norm"`` when given."""
    logged = torch.stack([torch.as_tensor(v, device=device).float().reshape(()) for v in (*summed.values(), *means.values())])
    if d.world > 1:
        logged = parallel.all_reduce_sum(logged)
    parts = [logged.detach().float()]
    if grad_norm is not None:
        full = getattr(grad_norm, "full_tensor", None)
        parts.append((full() if full is not None else grad_norm).detach().float().reshape(1).to(device))
    values = torch.cat(parts).cpu()  # the one host sync
    totals, averaged = values[:len(summed)], values[len(summed):len(summed) + len(means)] / d.world
    out = {**{k: float(v) for k, v in zip(summed, totals)}, **{k: float(v) for k, v in zip(means, averaged)}}
    if grad_norm is not None:
        out["grad_norm"] = float(values[-1])
    return out


def train_step(config: RetrofitConfig, teacher, student, optimizer, input_ids: torch.Tensor, labels: torch.Tensor,
               step: int, fraction: float, kv: KVpopConfig | None = None,
               d: parallel.DistInfo = parallel.DistInfo()) -> dict:
    """One optimizer step of the retrofit: step ``step`` (0-based) with ``fraction`` of the run done.

    ``input_ids``, ``labels``: int64 ``[B, T]`` on the models' device, this process's rows of the global batch
    (``labels`` -100 where not supervised). Sets the three learning rates, draws the step's query positions
    (:func:`step_draws`), runs :func:`step_tensors` and reads its values back once. ``kv``: :func:`training_kvpop`
    (computed when None). Returns the step's log values as floats, losses summed and metrics averaged over the
    processes: ``loss``, ``kd``; kvpop: ``boundary``, ``boundary_accuracy``, ``keep_fraction``, ``recall``; dms:
    ``compression``, ``closed_fraction``, ``target_fraction``, ``closed_head_min`` / ``closed_head_max`` (the least
    and most closed (layer, KV head) of the batch); then ``grad_norm``, ``lr``, ``lr_new``, ``lr_decay``."""
    device = input_ids.device
    kv = training_kvpop(config, student) if kv is None else kv
    lr_new = new_lr_at(config, step, fraction)
    optimizer.param_groups[0]["lr"] = config.lr
    optimizer.param_groups[1]["lr"] = lr_new
    optimizer.param_groups[2]["lr"] = lr_decay = decay_lr_at(config, step, fraction)
    draws = step_draws(config, kv, step, device) if config.method == "kvpop" else None
    summed, means, grad_norm = step_tensors(config, teacher, student, optimizer, input_ids, labels, kv, draws, step,
                                            fraction, d)
    return {**read_back(summed, means, device, d, grad_norm=grad_norm), "lr": config.lr, "lr_new": lr_new,
            "lr_decay": lr_decay}


# the methods whose step draws nothing on the host but what GraphedRetrofitStep writes into the graph's inputs
GRAPHED_METHODS = ("kvpop", "streaming_plus")


def check_graphed_method(method: str) -> None:
    """One-line error unless ``method``'s step can be replayed as a CUDA graph (:data:`GRAPHED_METHODS`)."""
    check(method in GRAPHED_METHODS, f"cuda_graph_step=True is for methods {', '.join(GRAPHED_METHODS)}, not "
                                     f"{method!r} (DMS draws its Gumbel noise and its compression target on the host "
                                     "every step)")


class GraphedRetrofitStep:
    """:func:`train_step` for one CUDA process (``RetrofitConfig.cuda_graph_step``), its device part
    (:func:`step_tensors`) replayed as one CUDA graph after ``eager_steps`` eager steps
    (:class:`~kvlearn.train.cuda_graph.CudaGraphStep`). Call it as ``train_step`` is called, without ``kv`` and ``d``:
    ``step(input_ids, labels, step, fraction) -> dict`` of the same logged values.

    Before each call the graph's static inputs are written: the batch (int64 ``[B, T]``, copied into device buffers
    of the first batch's shape), the boundary loss's query positions (int64 ``[queries_per_step]``, drawn on the host
    by :func:`step_draws` exactly as the eager step draws them) and the three learning rates (0-d device tensors read
    by the run's ``optimizer``, made with ``capturable=True``: :func:`~kvlearn.train.cuda_graph.prepare_capturable`).
    One-line errors for a method whose step draws on the host (DMS), a batch whose KD loss would select positions
    (``B (T-1) V >`` :data:`kvlearn.ops.distill_loss.KD_DENSE_ELEMENTS`: a data-dependent shape) and a batch of a new shape. ``capture``: see
    ``CudaGraphStep`` (the CPU tests replay by running the step again)."""

    def __init__(self, config, teacher, student, optimizer, kv, device: torch.device,
                 eager_steps: int = EAGER_STEPS, capture: Callable | None = None):
        check_graphed_method(config.method)
        vocab = student.config.vocab_size
        elements = config.batch_size * (config.seq_len - 1) * vocab
        limit = distill_loss.KD_DENSE_ELEMENTS  # read at each call (a test lowers it)
        check(elements <= limit,
              f"cuda_graph_step=True with batch_size x (seq_len - 1) x vocab = {config.batch_size} x "
              f"{config.seq_len - 1} x {vocab} = {elements} logits: expected <= {limit} (above it "
              "the KD loss selects the supervised positions, a shape a CUDA graph cannot replay); lower batch_size")
        self.config, self.teacher, self.student, self.optimizer, self.kv = config, teacher, student, optimizer, kv
        self.device = device
        self.lrs = prepare_capturable(optimizer, device)
        self.input_ids: torch.Tensor | None = None  # [B, T] int64, allocated on the first call
        self.labels: torch.Tensor | None = None
        self.queries = torch.zeros(config.queries_per_step, dtype=torch.int64, device=device)  # [n]
        self.graph = CudaGraphStep(self._device_part, device, eager_steps, capture)

    def _device_part(self):
        draws = StepDraws(self.queries, None) if self.config.method == "kvpop" else None
        return step_tensors(self.config, self.teacher, self.student, self.optimizer, self.input_ids, self.labels,
                            self.kv, draws, 0, 0.0, set_to_none=False)

    def __call__(self, input_ids: torch.Tensor, labels: torch.Tensor, step: int, fraction: float) -> dict:
        if self.input_ids is None:
            self.input_ids = torch.empty_like(input_ids, device=self.device)
            self.labels = torch.empty_like(labels, device=self.device)
        check(input_ids.shape == self.input_ids.shape and labels.shape == self.labels.shape,
              f"cuda_graph_step: a batch of shape {tuple(input_ids.shape)} after batches of "
              f"{tuple(self.input_ids.shape)}: a CUDA graph replays one shape; expected every batch alike")
        self.input_ids.copy_(input_ids, non_blocking=True)
        self.labels.copy_(labels, non_blocking=True)
        config = self.config
        if config.method == "kvpop":
            self.queries.copy_(step_draws(config, self.kv, step, self.device).queries, non_blocking=True)
        lr_new, lr_decay = new_lr_at(config, step, fraction), decay_lr_at(config, step, fraction)
        for lr, value in zip(self.lrs, (config.lr, lr_new, lr_decay)):
            lr.fill_(value)
        summed, means, grad_norm = self.graph()
        return {**read_back(summed, means, self.device, grad_norm=grad_norm), "lr": config.lr,
                "lr_new": lr_new, "lr_decay": lr_decay}


def dense_student(teacher):
    """A plain float32 copy of ``teacher`` to distil into (default attention, gradients on, train mode): the
    reference a retrofit step's cost is measured against (``benchmarks/retrofit_step_speed.py``)."""
    student = copy.deepcopy(teacher)
    student.requires_grad_(True)
    return student.train()


def dense_distill_step(config: RetrofitConfig, teacher, student, optimizer, input_ids: torch.Tensor,
                       labels: torch.Tensor) -> dict:
    """One plain distillation step of a dense ``student`` (:func:`dense_student`): teacher forward (no gradient),
    student forward with its default attention, :func:`kd_loss` (``kd_topk``), backward, clipping at ``grad_clip``,
    optimizer step and ``zero_grad``, under :func:`train_step`'s bf16 autocast on CUDA; one process, no learning-rate
    schedule. ``input_ids``, ``labels``: int64 ``[B, T]``. Returns ``{"loss", "kd", "grad_norm"}`` floats (loss =
    kd: 0 on the first step when ``student`` equals the teacher)."""
    return dense_read_back(*dense_step_tensors(config, teacher, student, optimizer, input_ids, labels))


def dense_read_back(kd: torch.Tensor, grad_norm: torch.Tensor) -> dict:
    """:func:`dense_step_tensors`' two 0-d tensors as ``{"loss", "kd", "grad_norm"}`` floats, in one host sync."""
    value, norm = torch.stack([kd.float(), grad_norm.float()]).tolist()
    return {"loss": value, "kd": value, "grad_norm": norm}


def dense_step_tensors(config: RetrofitConfig, teacher, student, optimizer, input_ids: torch.Tensor,
                       labels: torch.Tensor, set_to_none: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`dense_distill_step`'s device part, reading nothing back: ``(kd, grad_norm)`` as 0-d tensors (``kd``
    detached); ``zero_grad(set_to_none)``."""
    device = input_ids.device
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
        with torch.no_grad():
            teacher_logits = teacher(input_ids=input_ids, attention_mask=unpadded_causal_masks(teacher),
                                     use_cache=False).logits  # [B, T, V]
        logits = student(input_ids=input_ids, attention_mask=unpadded_causal_masks(student),
                         use_cache=False).logits  # [B, T, V]
    kd = kd_loss(logits, teacher_logits, labels, config.kd_topk)
    kd.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(student.parameters(), config.grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=set_to_none)
    return kd.detach(), grad_norm


# ----------------------------------------------------------------------------------------------------------------
# the loop


def retrofit(config: RetrofitConfig, stop_after: int | None = None, progress: bool = True) -> dict:
    """Run the distillation; returns ``{"step", "final", "log"}`` (``final``: the final checkpoint folder, None when
    ``stop_after`` ended the run early: that simulates a killed run, for tests)."""
    d = parallel.init_distributed(config.device)
    graphs = config.method == "kvpop" and config.kvpop.scorer == "mlstm" and config.kvpop.mlstm_compile_mode != "default"
    check(d.world == 1 or not graphs,
          f"mlstm_compile_mode={config.kvpop.mlstm_compile_mode!r} with {d.world} processes (FSDP) is not supported: "
          "the scorer's CUDA graphs were measured on one process only; expected mlstm_compile_mode='default' "
          "(--mlstm-compile-mode default) under torchrun")
    check(d.world == 1 or not config.freeze_backbone,
          f"freeze_backbone=True with {d.world} processes (FSDP) is not supported: a sharded unit mixing frozen and "
          "trained parameters was never run; expected one process (the scorers of the testbed teacher fit one GPU)")
    device = torch.device(f"cuda:{d.local_rank}" if d.world > 1 and config.device.startswith("cuda") else config.device)
    rows = shard_rows(config.batch_size, d.rank, d.world)  # one-line error unless batch_size % world == 0
    torch.manual_seed(config.seed)
    out = Path(config.out)
    if d.main:
        out.mkdir(parents=True, exist_ok=True)
        if config.overwrite and not config.resume:  # remove only what an earlier run of this trainer wrote
            clear_run_outputs(out)
    teacher, student = build_models(config, device)
    if config.freeze_backbone:
        freeze_existing_weights(student)
    kv = training_kvpop(config, student)  # before sharding
    step, trainer_state = 0, None
    if config.resume:
        trainer_state = load_trainer_state(latest_checkpoint(out), student, config)
        step = int(trainer_state["step"])
    if d.world > 1:
        parallel.shard_model(teacher)
        parallel.shard_model(student)
    optimizer = make_optimizer(config, student, device, capturable=config.cuda_graph_step)
    if trainer_state is not None:
        parallel.load_optimizer_state_dict(student, optimizer, trainer_state["optimizer"])
    graphed = None
    if config.cuda_graph_step:  # after the state is loaded: its learning rates become device tensors
        check_graph_step(device, d.world)
        graphed = GraphedRetrofitStep(config, teacher, student, optimizer, kv, device)
    log_path = out / LOG_FILE
    if d.main:  # drop the lines of steps that the resumed run will redo
        drop_log_lines_after(log_path, step)

    stream = TestbedStream(length=config.seq_len, batch_size=config.batch_size, seed=config.seed,
                           weights=config.family_weights, dense=config.dense_fraction, start_batch=step, rows=rows)
    batches = iter(torch.utils.data.DataLoader(stream, batch_size=None, num_workers=config.num_workers,
                                               pin_memory=device.type == "cuda"))
    from tqdm import tqdm

    total = config.steps
    bar = tqdm(total=total, initial=step, disable=not progress or not d.main, desc="retrofit", unit="step")
    t0 = time.time()
    seconds_done = float(trainer_state.get("seconds", 0.0)) if trainer_state is not None else 0.0
    last, finished = {}, False
    with open(log_path if d.main else os.devnull, "a") as log_file:
        while True:
            seconds = seconds_done + time.time() - t0
            fraction = step / config.steps if config.steps else parallel.agreed_fraction(seconds / (60 * config.minutes), d, device)
            finished = fraction >= 1
            if finished or (stop_after is not None and step >= stop_after):
                break
            input_ids, labels = next(batches)
            input_ids, labels = input_ids.to(device), labels.to(device)
            if graphed is not None:
                values = graphed(input_ids, labels, step, fraction)
            else:
                values = train_step(config, teacher, student, optimizer, input_ids, labels, step, fraction, kv, d)
            step += 1
            last = {"step": step, **values, "seconds": round(seconds_done + time.time() - t0, 3)}
            log_file.write(json.dumps(last) + "\n")
            log_file.flush()
            bar.update(1)
            bar.set_postfix(kd=f"{last['kd']:.3f}", **{k: f"{last[k]:.3f}" for k in ("boundary", "recall",
                                                                                     "closed_fraction") if k in last})
            if step % config.save_interval == 0:
                save_checkpoint(config, student, optimizer, step, f"step-{step}", {"seconds": last["seconds"]}, d.main)
                if d.main:
                    prune_checkpoints(out)
    bar.close()
    final = None
    if finished:
        final = save_checkpoint(config, student, optimizer, step, FINAL, {"seconds": last.get("seconds", 0.0)}, d.main)
    del teacher, student, optimizer, batches  # the sharded modules go before their process group (close_distributed)
    parallel.close_distributed(d)
    return {"step": step, "final": None if final is None else str(final), "log": last}


def readout_penalty_term(student) -> torch.Tensor:
    """Mean over the layers and KV heads of ``||a_h||^2``, the squared norm of each head's mLSTM readout weight
    ``a [H, Dv]`` (float32 scalar, differentiable in ``a``). Under FSDP2 ``a`` is a sharded DTensor outside the
    forward: it is gathered whole (``full_tensor``, whose backward hands each process the gradient of its own shard),
    so every process computes the same value."""
    from ..kvpop.apply import kvpop_modules

    scorers, _ = kvpop_modules(student)
    weights = [sc.a.full_tensor() if hasattr(sc.a, "full_tensor") else sc.a for sc in scorers]
    return torch.stack([a.float().pow(2).sum(-1).mean() for a in weights]).mean()

