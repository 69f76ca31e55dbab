"""Train the testbed teacher: a small ``Qwen3ForCausalLM`` from scratch on the task mixture, with a length curriculum.

Read top to bottom: config, model, data, schedule, loop. One GPU (``kvlearn pretrain``) or several with DDP
(``torchrun --nproc_per_node N -m kvlearn.cli pretrain ...``). The budget is wall-clock minutes: the curriculum
stages and the cosine learning-rate schedule are functions of the elapsed fraction of it, so a run of any length
follows the same recipe, and the defaults train the shipped teacher from scratch in one run. With ``steps`` the
budget is that many optimizer steps instead (the fraction is ``step / steps``): a model of another size then sees the
same tokens as a run it is compared with (the smaller model of the KV-Kaizen table, trained on the shipped teacher's
9,162 steps with its realised stage shares; docs/DESIGN.md section 8). At the end of every
stage the teacher-forced answer accuracy of each family is measured at that stage's length on both evaluation
splits (``eval``: the training haystack styles and depth regimes on unseen seeds; ``heldout``: a haystack style and
a depth regime training never sees), so a recipe that does not learn retrieval, or learns the filler, shows it
early. The output folder gets the checkpoint, ``pretrain_log.json`` and a model card ``README.md``.
"""

from __future__ import annotations

import datetime as _dt
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import Qwen3Config, Qwen3ForCausalLM

from ..errors import check, check_int, check_positive
from ..hf import unpadded_causal_masks
from ..output_paths import check_output_folder
from ..testbed import tasks as testbed_tasks
from ..testbed.data import TestbedStream, check_haystack_subset, dense_share
from ..testbed.filler import TRAIN_STYLES
from ..testbed.tokenizer import build_tokenizer, save_tokenizer
from . import parallel
from .schedule import warmup_cosine


def default_out() -> str:
    """A new folder per run: ``runs/testbed-teacher-<UTC time>`` (``runs/`` is not tracked)."""
    return "runs/testbed-teacher-" + _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")


EVAL_SPLITS = ("eval", "heldout")


@dataclass
class PretrainConfig:
    out: str = field(default_factory=default_out)
    overwrite: bool = False  # an existing non-empty ``out`` is refused unless this is set
    minutes: float = 18.0
    # a step budget instead of ``minutes``: the curriculum and the learning rate follow ``step / steps`` (None: wall clock)
    steps: int | None = None
    # model
    hidden_size: int = 256
    num_layers: int = 8
    num_heads: int = 8
    num_kv_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 768
    context: int = 4096
    rope_theta: float = 20000.0
    # curriculum: example length per stage, and the fraction of the time budget each stage gets
    stages: tuple[int, ...] = (256, 512, 1024, 2048, 4096)
    stage_fractions: tuple[float, ...] = (0.06, 0.08, 0.12, 0.24, 0.5)  # half the time at 4096 (docs/TESTBED.md)
    tokens_per_step: int = 131072
    # share of rows in the dense training format (in-context Q/A pairs); the rest are in the evaluation format, so
    # the teacher also answers prompts with no earlier answer to copy the format from (docs/TESTBED.md)
    dense_fraction: float = 0.75
    # sampling weight of each family (testbed FAMILIES order: trace, niah, vt, recall); None = uniform. One tuple
    # for every stage, or one tuple per stage (e.g. trace-heavy short stages, so that its lookup forms early), or
    # "adaptive": uniform in the first stage, then each stage weights family f by ADAPTIVE_FLOOR + 1 - acc_f, its
    # teacher-forced eval-split accuracy at the previous stage check (a family whose retrieval has not formed gets up
    # to five times the rows of one that has; docs/TESTBED.md, "Adaptive family weights")
    family_weights: tuple[float, ...] | tuple[tuple[float, ...], ...] | str | None = "adaptive"
    # narrow the training haystack to these styles / depth regimes (None: every training one, drawn by the seed)
    train_styles: tuple[str, ...] | None = None
    train_regimes: tuple[str, ...] | None = None
    # the first ``plain_stages`` curriculum stages (all of them if there are fewer) train on the plain haystack only
    # (style ``svo``, depths ``uniform``), the later ones on ``train_styles`` / ``train_regimes``. Default 0: the
    # recipe of the shipped teachers (68c180d, 1880c5c); 3 formed no lookup in 2 of 2 runs (docs/TESTBED.md, "The previous
    # teacher (68c180d) and the search for trace")
    plain_stages: int = 0
    # the curriculum stage length from which the dense rows' niah probes may give their key several needles (a share
    # testbed.tasks.MULTIVALUE_PROBE_SHARE of them, answered in document order); None = never, the rows of 1880c5c:
    # the recipe of the shipped teacher. Opt-in, because the one from-scratch run with them from 512 on (the
    # generator's default since e1df32b) formed no retrieval by the 2048 stage check (recall 0.00, trace 0.03; the
    # shipped teacher's run 0.97 / 0.98 there; b6634e3). One run proves no cause; the defaults keep the shipped recipe
    multivalue_from: int | None = None
    # optimisation
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 200
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.98)
    grad_clip: float = 1.0
    seed: int = 0
    # checks and plumbing
    eval_n: int = 64  # examples per family and split in every stage check
    num_workers: int = 6
    resume: str | None = None
    device: str = "cuda"
    log_every: int = 50

    def __post_init__(self) -> None:
        check(self.minutes > 0, f"minutes={self.minutes} is invalid: expected > 0")
        check(self.steps is None or (isinstance(self.steps, int) and not isinstance(self.steps, bool) and self.steps >= 1),
              f"steps={self.steps!r} is invalid: expected None (the minutes budget) or an integer >= 1")
        check(len(self.stages) == len(self.stage_fractions) and len(self.stages) > 0,
              f"stages {self.stages} and stage_fractions {self.stage_fractions} must have the same non-zero length")
        check(abs(sum(self.stage_fractions) - 1.0) < 1e-6, f"stage_fractions {self.stage_fractions} must sum to 1")
        check(all(256 <= s <= self.context for s in self.stages), f"stages {self.stages} must lie in [256, context={self.context}]")
        check_int("num_layers", self.num_layers, 1)
        check(self.num_heads % self.num_kv_heads == 0 and self.num_heads // self.num_kv_heads >= 2 and self.num_kv_heads >= 2,
              f"num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}: expected >= 2 KV heads and >= 2 query heads per KV head")
        self.dense_fraction = dense_share(self.dense_fraction, "dense_fraction")
        check_int("tokens_per_step", self.tokens_per_step, max(self.stages),
                  hint=f" (a multiple of the longest stage {max(self.stages)})")
        check(self.tokens_per_step % max(self.stages) == 0, f"tokens_per_step={self.tokens_per_step} must be a multiple of the longest stage {max(self.stages)}")
        check_positive("lr", self.lr)
        check_int("warmup_steps", self.warmup_steps, 0)
        check_int("seed", self.seed, 0)
        check_int("eval_n", self.eval_n, 1)
        if isinstance(self.family_weights, str):
            check(self.family_weights in FAMILY_WEIGHT_MODES,
                  f"family_weights={self.family_weights!r} is invalid: expected numbers or one of "
                  f"{', '.join(FAMILY_WEIGHT_MODES)}")
            if self.family_weights == "uniform":
                self.family_weights = None
        elif self.family_weights is not None:
            self.family_weights = _check_family_weights(self.family_weights, len(self.stages))
        check_int("num_workers", self.num_workers, 0)
        self.train_styles = check_haystack_subset(self.train_styles, TRAIN_STYLES, "train_styles")
        self.train_regimes = check_haystack_subset(self.train_regimes, testbed_tasks.TRAIN_REGIMES, "train_regimes")
        check_int("plain_stages", self.plain_stages, 0)
        check(self.multivalue_from is None or (isinstance(self.multivalue_from, int) and not isinstance(self.multivalue_from, bool)
                                                and self.multivalue_from in self.stages),
              f"multivalue_from={self.multivalue_from!r} is invalid: expected None (never) or one of the stage lengths "
              f"{', '.join(str(s) for s in self.stages)}")
        check(self.resume is None or Path(self.resume, "config.json").is_file(),
              f"resume={self.resume!r} is not a model folder (no config.json): expected the checkpoint folder of an "
              "earlier kvlearn pretrain run")
        out = Path(self.out)
        check_output_folder(out, "out")
        check(self.overwrite or not out.exists() or not any(out.iterdir()) or out == Path(self.resume or "\0"),
              f"out={self.out!r} already holds files: pass --overwrite to replace them, or choose a new folder")


def _check_family_weights(weights, n_stages: int):
    """``weights`` as one tuple of ``len(FAMILIES)`` floats, or a tuple of ``n_stages`` such tuples; a one-line error
    otherwise."""
    n = len(testbed_tasks.FAMILIES)
    per_stage = len(weights) > 0 and all(isinstance(w, (tuple, list)) for w in weights)
    groups = [tuple(w) for w in weights] if per_stage else [tuple(weights)]

    def ok(w) -> bool:
        try:
            w = [float(x) for x in w]
        except (TypeError, ValueError):
            return False
        return len(w) == n and all(x >= 0 for x in w) and sum(w) > 0

    check(all(ok(w) for w in groups) and (not per_stage or len(groups) == n_stages),
          f"family_weights={weights!r} is invalid: expected {n} non-negative numbers ({', '.join(testbed_tasks.FAMILIES)}) "
          f"with a positive sum, or {n_stages} such groups (one per stage)")
    groups = [tuple(float(x) for x in w) for w in groups]
    return tuple(groups) if per_stage else groups[0]


FAMILY_WEIGHT_MODES = ("adaptive", "uniform")
ADAPTIVE_FLOOR = 0.25  # a family at accuracy 1 keeps this much weight; one at 0 gets 1 + ADAPTIVE_FLOOR


def adaptive_family_weights(accuracy: dict[str, float] | None) -> tuple[float, ...] | None:
    """Family weights from the previous stage check's eval-split accuracy: ``ADAPTIVE_FLOOR + 1 - acc_f`` per family
    in FAMILIES order (None: no check yet, uniform). A family missing from ``accuracy`` counts as accuracy 0."""
    if not accuracy:
        return None
    return tuple(round(ADAPTIVE_FLOOR + 1.0 - min(1.0, max(0.0, float(accuracy.get(f, 0.0)))), 4)
                 for f in testbed_tasks.FAMILIES)


def stage_family_weights(config: PretrainConfig, stage: int, last_accuracy: dict[str, float] | None = None
                         ) -> tuple[float, ...] | None:
    """The family sampling weights of curriculum stage ``stage`` (None: uniform); ``last_accuracy`` is the eval-split
    accuracy of the previous stage check, which the "adaptive" mode reads."""
    w = config.family_weights
    if w == "adaptive":
        return adaptive_family_weights(last_accuracy if stage > 0 else None)
    if w is None or not isinstance(w[0], tuple):
        return w
    return w[stage]


PLAIN_STYLE, PLAIN_REGIME = "svo", "uniform"


def stage_haystack(config: PretrainConfig, stage: int) -> tuple[tuple[str, ...] | None, tuple[str, ...] | None]:
    """``(styles, regimes)`` the training rows of curriculum stage ``stage`` draw from (None: every training one):
    the plain haystack in the first ``plain_stages`` stages, ``train_styles`` / ``train_regimes`` after."""
    if stage < config.plain_stages:
        return (PLAIN_STYLE,), (PLAIN_REGIME,)
    return config.train_styles, config.train_regimes


def stage_multivalue_share(config: PretrainConfig, stage: int) -> float:
    """The share of dense niah probes with several needles in curriculum stage ``stage``'s rows:
    ``tasks.MULTIVALUE_PROBE_SHARE`` from the stage of length ``multivalue_from`` on, else 0 (the rows of 1880c5c)."""
    length = config.stages[stage]
    on = config.multivalue_from is not None and length >= config.multivalue_from
    return testbed_tasks.MULTIVALUE_PROBE_SHARE if on else 0.0


def build_model(config: PretrainConfig, tokenizer) -> Qwen3ForCausalLM:
    """A fresh GQA ``Qwen3ForCausalLM`` sized by ``config`` for the testbed vocabulary."""
    model_config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=2 * config.context,
        rope_theta=config.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attn_implementation="sdpa",
    )
    return Qwen3ForCausalLM(model_config)


def stage_at(config: PretrainConfig, fraction: float) -> int:
    """Index of the curriculum stage at this elapsed fraction of the time budget."""
    edge = 0.0
    for i, f in enumerate(config.stage_fractions):
        edge += f
        if fraction < edge:
            return i
    return len(config.stages) - 1


def lr_at(config: PretrainConfig, step: int, fraction: float) -> float:
    """Linear warm-up over ``warmup_steps``, then cosine decay over the elapsed time fraction
    (:func:`kvlearn.train.schedule.warmup_cosine`)."""
    return warmup_cosine(config.lr, step, fraction, config.warmup_steps, config.min_lr_ratio)


def checked_answer_positions(example) -> list[int]:
    """Answer positions checked by the teacher-forced accuracy: the whole answer, except for ``trace`` the
    free "thinking" sentences between steps (only the step lines and the final answer are determined)."""
    if example.family != "trace":
        return list(range(len(example.answer_ids)))
    from ..testbed.tokenizer import WORD_TO_ID

    starts, dot = {WORD_TO_ID["step"], WORD_TO_ID["answer"]}, WORD_TO_ID["."]
    checked, inside = [], False
    for j, tok in enumerate(example.answer_ids):
        inside = inside or tok in starts
        if inside:
            checked.append(j)
            if tok == dot:
                inside = False
    checked.append(len(example.answer_ids) - 1)  # <eos>
    return sorted(set(checked))


@torch.no_grad()
def answer_predictions(model, examples, device, batch_size: int = 16):
    """Teacher-forced argmax at every answer position of ``examples`` (all of one length), bf16 autocast on CUDA:
    yields ``(example, predicted)``, ``predicted[j]`` the model's argmax for ``example.answer_ids[j]`` given every
    token before it (a list of ints)."""
    for s in range(0, len(examples), batch_size):
        batch = examples[s : s + batch_size]
        ids = torch.tensor([ex.prompt_ids + ex.answer_ids for ex in batch], dtype=torch.long, device=device)
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            pred = model(input_ids=ids).logits.argmax(-1)
        for i, ex in enumerate(batch):
            p = len(ex.prompt_ids)
            yield ex, pred[i, p - 1 : p - 1 + len(ex.answer_ids)].tolist()


def answer_accuracy(model, length: int, n: int, device, families=testbed_tasks.FAMILIES, batch_size: int = 16,
                    split: str = "eval") -> dict:
    """Teacher-forced accuracy of each family at ``length`` on ``split`` (examples 10000.. of it, never those of the
    greedy evaluation): an example counts when every checked answer token is the argmax (for ``trace`` the checked
    tokens are the step lines and the final answer, for the others the whole answer)."""
    model.eval()
    acc = {}
    for family in families:
        examples = [testbed_tasks.generate(family, testbed_tasks.example_seed(family, split, 10_000 + i), length) for i in range(n)]
        correct = 0
        for ex, pred in answer_predictions(model, examples, device, batch_size):
            checked = checked_answer_positions(ex)
            correct += [pred[j] for j in checked] == [ex.answer_ids[j] for j in checked]
        acc[family] = correct / n
    model.train()
    return acc


# teacher-forced stage-check accuracy that a finished run must reach on these families (both splits) before a chain
# of device jobs measures methods on it; trace is left out: its teacher-forced check stays near 0 even for teachers
# that solve it greedily (the whole executed trace must match), so only the greedy evaluation judges it
STAGE_GATE_FAMILIES = ("niah", "vt", "recall")


def stage_check_passed(log: dict, threshold: float = 0.8, families: tuple[str, ...] = STAGE_GATE_FAMILIES) -> bool:
    """Whether a pretrain log's last stage check reached ``threshold`` on every family of ``families`` on every
    split it measured (a run with no stage check fails). ``log``: ``pretrain_log.json`` of a checkpoint."""
    stages = log.get("stages") or []
    if not stages:
        return False
    accuracy = stages[-1].get("accuracy") or {}
    return bool(accuracy) and all(
        split.get(f, 0.0) >= threshold for split in accuracy.values() for f in families)


def save_checkpoint(model, tokenizer, out: str | Path, log: dict) -> None:
    """bf16 safetensors + tokenizer + training log, loadable with ``AutoModelForCausalLM.from_pretrained``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.bfloat16).cpu() for k, v in model.state_dict().items()}
    model.config.dtype = "bfloat16"
    model.save_pretrained(out, state_dict=state, safe_serialization=True)
    save_tokenizer(out)
    (out / "pretrain_log.json").write_text(json.dumps(log, indent=2) + "\n")
    (out / "README.md").write_text(model_card(log))


def model_card(log: dict) -> str:
    """The model card of a teacher checkpoint: architecture, recipe, time and the stage checks on both splits."""
    c = log["config"]
    lines = [
        "# testbed teacher", "",
        "A `Qwen3ForCausalLM` trained from scratch by `kvlearn pretrain` on the kvlearn synthetic long-context testbed",
        "(word-level tokenizer bundled here). Load it with `kvlearn.load_model(path)` or",
        "`AutoModelForCausalLM.from_pretrained(path)`.", "",
        f"- Architecture: {c['num_layers']} layers, hidden {c['hidden_size']}, {c['num_heads']} query heads / "
        f"{c['num_kv_heads']} KV heads of dim {c['head_dim']}, MLP {c['intermediate_size']}, RoPE theta "
        f"{c['rope_theta']:g}, tied embeddings, {log['parameters']:,} parameters, bf16 weights, context {c['context']}.",
        f"- Recipe: one run of {log.get('minutes', '?')} minutes"
        + (f" (a budget of {c['steps']:,} steps)" if c.get("steps") is not None else "") + f" on {log.get('device', '?')} (world size "
        f"{log['world_size']}), {log.get('steps', '?')} steps, {log.get('tokens', 0):,} tokens; curriculum "
        + ", ".join(f"{L}: {f:g}" for L, f in zip(c["stages"], c["stage_fractions"]))
        + f" (example length: share of the {'steps' if c.get('steps') is not None else 'time'}); AdamW {tuple(c['betas'])}, peak LR {c['lr']:g}, cosine to "
        f"{c['min_lr_ratio']:g} of it, {c['tokens_per_step']:,} tokens per step, dense-format share "
        f"{c['dense_fraction']:g}"
        + (f", multi-needle niah probes (a share {testbed_tasks.MULTIVALUE_PROBE_SHARE:g} of the dense rows' probes) "
           f"from the {c['multivalue_from']} stage on" if c.get("multivalue_from") is not None else "")
        + f", seed {c['seed']}. Command: `{log.get('command', 'kvlearn pretrain')}`, code of "
        f"commit {log.get('commit', '?')} (its testbed generator made the training data).",
        "- Haystacks: training styles and depth regimes only (`kvlearn.testbed.filler.TRAIN_STYLES`"
        + (f" narrowed to {', '.join(c['train_styles'])}" if c.get("train_styles") else "")
        + (f"; regimes narrowed to {', '.join(c['train_regimes'])}" if c.get("train_regimes") else "") + ",",
        "  `kvlearn.testbed.tasks.TRAIN_REGIMES`); the `heldout` split's style and regime were never seen."
        + (f" The first {min(c.get('plain_stages', 0), len(c['stages']))} stage(s) train on the plain haystack only "
           f"({PLAIN_STYLE}, {PLAIN_REGIME} depths)." if c.get("plain_stages") else ""),
        "- Family sampling weights (" + ", ".join(testbed_tasks.FAMILIES) + ") per stage"
        + (" (adaptive: ADAPTIVE_FLOOR + 1 - the previous stage check's eval accuracy)"
           if c.get("family_weights") == "adaptive" else "")
        + ": " + "; ".join(f"{L}: " + (", ".join(f"{x:g}" for x in w) if w else "uniform")
                            for L, w in zip(c["stages"], log.get("family_weights", []))) + ".", "",
        "Teacher-forced answer accuracy at the end of each stage (64 examples per family unless the log says",
        "otherwise; greedy accuracy through the caches is in the repository's `results/testbed_teacher.json`):", "",
        "| stage length | minutes | split | " + " | ".join(testbed_tasks.FAMILIES) + " |",
        "|---|---|---|" + "---|" * len(testbed_tasks.FAMILIES),
    ]
    for st in log["stages"]:
        for split, acc in st["accuracy"].items():
            lines.append(f"| {st['length']} | {st['minutes']} | {split} | "
                         + " | ".join(f"{acc.get(f, float('nan')):.2f}" for f in testbed_tasks.FAMILIES) + " |")
    return "\n".join(lines) + "\n"


def pretrain(config: PretrainConfig) -> dict:
    """Run the time-budgeted curriculum; returns the training log (also written next to the checkpoint)."""
    d = parallel.init_distributed(config.device)
    device = torch.device(config.device if config.device == "cpu" else f"cuda:{d.local_rank}")
    torch.manual_seed(config.seed)
    tokenizer = build_tokenizer()
    if config.resume:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(config.resume, dtype=torch.float32, attn_implementation="sdpa")
    else:
        model = build_model(config, tokenizer)
    model.to(device).train()
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr, betas=config.betas, fused=device.type == "cuda",
    )
    ddp_model = model
    if d.world > 1:
        ddp_model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[d.local_rank] if device.type == "cuda" else None)

    def loader(stage: int, weights):
        length = config.stages[stage]
        rows = config.tokens_per_step // length // d.world
        styles, regimes = stage_haystack(config, stage)
        stream = TestbedStream(length=length, batch_size=rows, seed=config.seed * 1000 + length, rank=d.rank, world_size=d.world,
                              dense=config.dense_fraction, weights=weights, styles=styles, regimes=regimes,
                              multivalue_share=stage_multivalue_share(config, stage))
        return iter(torch.utils.data.DataLoader(stream, batch_size=None, num_workers=config.num_workers,
                                                pin_memory=device.type == "cuda", persistent_workers=False,
                                                prefetch_factor=4 if config.num_workers else None))

    from ..results import command_line, device_name, git_commit

    log = {"config": asdict(config), "parameters": n_params, "stages": [], "world_size": d.world,
           "device": device_name(str(device)), "command": command_line(), "commit": git_commit()}
    budget_s = config.minutes * 60
    t0 = time.time()
    step, tokens, stage, batches = 0, 0, -1, None
    loss_ema = None
    while True:
        fraction = step / config.steps if config.steps is not None else (time.time() - t0) / budget_s
        if d.world > 1 and config.steps is None:  # every rank follows rank 0's clock, so stage changes and the end happen in lockstep
            f = torch.tensor([fraction], device=device)
            dist.broadcast(f, 0)
            fraction = float(f)
        new_stage = stage_at(config, fraction) if fraction < 1 else None
        if new_stage != stage:
            if stage >= 0:  # close the finished stage with an accuracy check
                acc = {split: answer_accuracy(model, config.stages[stage], config.eval_n, device, split=split)
                       for split in EVAL_SPLITS} if d.main else {}
                entry = {"stage": stage, "length": config.stages[stage], "end_step": step, "tokens": tokens * d.world,
                         "minutes": round((time.time() - t0) / 60, 2), "loss": loss_ema, "accuracy": acc}
                log["stages"].append(entry)
                if d.main:
                    print(json.dumps(entry), flush=True)
                    save_checkpoint(model, tokenizer, config.out, log)
            if new_stage is None:
                break
            stage = new_stage
            last = log["stages"][-1]["accuracy"].get("eval") if log["stages"] else None
            weights = stage_family_weights(config, stage, last)
            if d.world > 1 and config.family_weights == "adaptive" and stage > 0:  # only rank 0 ran the check
                w = torch.tensor(weights or [0.0] * len(testbed_tasks.FAMILIES), device=device, dtype=torch.float64)
                dist.broadcast(w, 0)
                weights = tuple(w.tolist())
            log.setdefault("family_weights", []).append(list(weights) if weights is not None else None)
            if d.main:
                print(f"stage {stage} (length {config.stages[stage]}): family weights "
                      f"{dict(zip(testbed_tasks.FAMILIES, weights)) if weights else 'uniform'}", flush=True)
            batches = loader(stage, weights)
        input_ids, labels = next(batches)
        input_ids = input_ids.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        lr = lr_at(config, step, fraction)
        for group in opt.param_groups:
            group["lr"] = lr
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            # the prepared causal masks: building them read a device bool every step (the step's only host sync)
            loss = ddp_model(input_ids=input_ids, labels=labels, attention_mask=unpadded_causal_masks(model)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens += input_ids.numel()
        if step % config.log_every == 0:
            value = float(loss.detach())
            loss_ema = value if loss_ema is None else 0.9 * loss_ema + 0.1 * value
            if d.main:
                elapsed = time.time() - t0
                print(f"step {step:6d} stage {stage} len {config.stages[stage]:5d} loss {value:.4f} lr {lr:.2e} "
                      f"tok/s {tokens * d.world / elapsed:,.0f} elapsed {elapsed / 60:.2f} min", flush=True)
    log["steps"] = step
    log["tokens"] = tokens * d.world
    log["minutes"] = round((time.time() - t0) / 60, 2)
    if d.main:
        save_checkpoint(model, tokenizer, config.out, log)
    # DDP's reducer holds the process group: dropped after the group was destroyed, its gloo worker thread waited for
    # the GIL while the main thread, holding it, joined that thread (a hang seen under load). Drop the wrapper first,
    # then a barrier flushes every pending collective before the group goes.
    del ddp_model
    parallel.close_distributed(d)
    return log
