"""KV-Kaizen's two overheads, one process (issue #11 item 9: "the selector's latency against pre-fill and the training
cost against plain fine-tuning"; the paper: about 3 ms, and 1.0 to 1.4x with one action per layer).

    PYTHONPATH=src python benchmarks/kaizen_overheads.py --out results/kaizen_overheads_h200.json
    PYTHONPATH=src python benchmarks/kaizen_overheads.py --shape qwen3-0.6b --out results/kaizen_overheads_0p6b_h200.json

Both parts use the student that :func:`kvlearn.train.kaizen_train.build_models` makes (the teacher loaded in
float32, a copy with :func:`~kvlearn.kaizen.apply.apply_kaizen`: an untrained selector; neither the latency nor
the step time depends on the weights) for a :class:`~kvlearn.train.kaizen_train.KaizenTrainConfig` with the
kaizen-train defaults but ``--axes``, ``--seq-len``, ``--batch-size`` and ``--seed``.

1. **Selector latency against prefill** (rows ``selector``, ``prefill_dense``), on a prompt of ``--context`` random
   tokens at batch ``--latency-batch`` (default 1), no gradient:

   - ``selector``: :func:`kvlearn.kaizen.apply.prompt_choices`, exactly what ``kvlearn eval --method kaizen`` runs
     once per prompt before prefill (the registry's ``prompt_choices``: per row, the selector's forward on the
     row alone at the target, its argmax and the per-layer configuration read back to the host); the selector in
     float32 (as :func:`~kvlearn.kaizen.apply.apply_kaizen` builds it and evaluation runs it), eval mode;
   - ``prefill_dense``: the dense model's prefill forward of the same prompt: a copy of the teacher in bf16 on CUDA
     (float32 on the CPU: ``kvlearn eval``'s load), default (SDPA) attention, one forward of the whole prompt into
     a fresh ``DynamicCache`` with ``logits_to_keep=1`` (as :func:`kvlearn.cache.prefill`'s dense forward).

2. **Training cost against plain fine-tuning** (rows ``distill_dense_step``, ``kaizen_train_step``), on one batch of
   the testbed stream (the trainer's first, ``--seq-len`` x ``--batch-size``), milliseconds per optimizer step:

   - ``distill_dense_step``: :func:`kvlearn.train.distill.dense_distill_step`, a float32 copy of the teacher
     (:func:`~kvlearn.train.distill.dense_student`) with its default attention, KD loss only (the same ``kd_topk``
     and ``grad_clip``), AdamW as :func:`kvlearn.train.kaizen_train.make_optimizer` makes it: the reference;
   - ``kaizen_train_step``: :func:`kvlearn.train.kaizen_train.kaizen_train_step`, the trainer's own step (teacher
     forward, selector, Gumbel straight-through, the student's mixture forward over every action of every layer,
     KD + budget penalty, backward, clipping, AdamW, the multiplier update and the logged values read back). The
     row records the axes and the actions per layer (the mixture forward costs one fake-quantized K/V per own-cache
     action and layer; the selector picks one action per layer).

Each part first runs ``--warmup`` untimed calls of each side, then the ``--steps`` timed calls are interleaved in
rounds (each side ``--steps-per-round`` calls per round, the order rotated per round), so that each ratio is measured
under the same machine conditions; CUDA events after a synchronize (the host clock on the CPU), median per row.
Training rows also record the process's peak memory during their steps (every model of the run is resident) and the
peak above what was allocated before the step. The file is rewritten after every round (``partial`` until the end),
so a time-out keeps what was measured.

Model sources: ``--model PATH`` (default the committed 8-layer testbed teacher; training seq 4096, batch 8: the
kaizen-train defaults) or ``--shape qwen3-0.6b``: a randomly initialised Qwen3 of Qwen3-0.6B's shape with the testbed
vocabulary (``benchmarks/step_timing.py``'s ``random_model_folder``; training seq 4096, batch 4, not the
kaizen-train batch 8: the plain step's activations at that shape were 18.6 GiB per 8192 tokens on the H200
(``results/retrofit_step_speed_0p6b_h200.json``), the mixture forward keeps fake-quantized K/V copies per action
and layer on top (about 10% more saved bytes than the plain step, float32 on the CPU), so 8 x 4096 is estimated at
100-120 GiB with every model resident: too close to the H200's memory for a first run; ``--batch-size 8`` asks for
it). ``--smoke``: a tiny random GQA Qwen3 on the CPU (checks the script end to end, times nothing meaningful).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from kvlearn.errors import check, check_int  # noqa: E402
from kvlearn.hf import read_model_config  # noqa: E402
from kvlearn.kaizen.actions import AXES  # noqa: E402
from kvlearn.kaizen.apply import prompt_choices, selector_of  # noqa: E402
from kvlearn.results import portable_path  # noqa: E402
from kvlearn.testbed.data import TestbedStream  # noqa: E402
from kvlearn.testbed.tasks import MAX_LENGTH, MIN_LENGTH  # noqa: E402
from kvlearn.train.distill import dense_distill_step, dense_student  # noqa: E402
from kvlearn.train.kaizen_train import (  # noqa: E402
    KaizenStep, KaizenTrainConfig, build_models, kaizen_train_step, make_multiplier, make_optimizer)
from step_timing import (  # noqa: E402
    Timed, add_source_options, measure, model_shape, random_model_folder, resolve_source, results_saver,
    run_main)

SELECTOR, PREFILL, DISTILL, KAIZEN = "selector", "prefill_dense", "distill_dense_step", "kaizen_train_step"
# (context, latency_batch, seq_len, batch_size, warmup, steps) by model source: --model, --shape qwen3-0.6b /
# qwen3-1.7b, --smoke
DEFAULTS = {source: dict(zip(("context", "latency_batch", "seq_len", "batch_size", "warmup", "steps"), values))
            for source, values in ((None, (4096, 1, 4096, 8, 3, 10)), ("qwen3-0.6b", (4096, 1, 4096, 4, 3, 10)),
                                   ("qwen3-1.7b", (4096, 1, 4096, 2, 3, 10)), ("tiny", (256, 1, 128, 2, 1, 2)))}
PAPER = {"selector_ms": 3, "training_cost": [1.0, 1.4]}


def parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_source_options(ap, "kaizen_overheads")
    ap.add_argument("--axes", default=None, help="comma list of precision,rank,depth (default: the backbone's "
                    "default axes, as kaizen-train: precision,depth on GQA)")
    ap.add_argument("--context", type=int, default=None, help="prompt tokens of the latency part (default 4096; "
                    "--smoke 256)")
    ap.add_argument("--latency-batch", type=int, default=None, help="prompts of the latency part (default 1)")
    ap.add_argument("--seq-len", type=int, default=None, help="training sequence (default 4096; --smoke 128)")
    ap.add_argument("--batch-size", type=int, default=None, help="training batch (default 8 (--model), 4 (--shape), "
                    "2 (--smoke))")
    args = ap.parse_args(argv)
    resolve_source(args, DEFAULTS, "kaizen_overheads", REPO)
    if args.axes is not None:
        args.axes = tuple(a.strip() for a in args.axes.split(",") if a.strip())
        bad = [a for a in args.axes if a not in AXES]
        check(args.axes and not bad, f"--axes={','.join(args.axes)!r} is invalid: expected a non-empty comma list of "
              f"{', '.join(AXES)}")
    check_int("--context", args.context, 1)
    check_int("--latency-batch", args.latency_batch, 1)
    check_int("--seq-len", args.seq_len, MIN_LENGTH, MAX_LENGTH, hint=" (the testbed's example lengths)")
    check_int("--batch-size", args.batch_size, 1)
    return args


def main(argv: list[str] | None = None) -> int:
    return run_main("kaizen_overheads", argv, parse, run)


def run(args, tmp: Path, command: str) -> int:
    """Build the models, time the latency part then the training part; write ``args.out``."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the models' save / load bars: stderr holds this script's lines only
    start, device = time.perf_counter(), torch.device(args.device)
    teacher_folder = args.model
    if args.source is not None:  # a random model of that shape, with the testbed teacher's tokenizer files
        teacher_folder = random_model_folder(args.source, tmp / args.source, args.model, device)
    # the trainer's config (one-line errors: the model folder, the axes on this backbone, the target's range)
    config = KaizenTrainConfig(model=teacher_folder, out=str(tmp / "unused"), axes=args.axes, seq_len=args.seq_len,
                               batch_size=args.batch_size, seed=args.seed, device=args.device)
    check_int("--context", args.context, 1, read_model_config(teacher_folder).max_position_embeddings,
              hint=" (the model's max_position_embeddings)")
    torch.manual_seed(config.seed)  # as kaizen_train() seeds before build_models (the selector's init)
    teacher, student, _ = build_models(config, device)
    sel = selector_of(student)
    import transformers
    from transformers import DynamicCache

    fields = dict(
        model=(f"random {args.source} shape (testbed vocabulary)" if args.source else portable_path(teacher_folder)),
        model_shape=model_shape(teacher.config),
        context=args.context, latency_batch=args.latency_batch, seq_len=args.seq_len, batch_size=args.batch_size,
        axes=list(sel.axes), actions_per_layer=sel.num_actions, targets=list(config.targets),
        selector={"width": config.width, "heads": config.heads, "blocks": config.blocks},
        warmup=args.warmup, steps=args.steps, steps_per_round=args.steps_per_round, smoke=args.smoke,
        precision=("selector float32, prefill model bf16 on CUDA (kvlearn eval's); training: float32 weights and "
                   "AdamW, bf16 autocast on CUDA (kaizen-train's)"),
        torch=torch.__version__, transformers=transformers.__version__)
    timed: list[Timed] = []

    save = results_saver(args.out, timed, summarize, device, command, fields, start)

    # 1. the selector's latency against the dense prefill of the same prompt
    gen = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(3, teacher.config.vocab_size, (args.latency_batch, args.context), generator=gen).to(device)
    dense = copy.deepcopy(teacher).to(torch.bfloat16 if device.type == "cuda" else torch.float32).eval()
    method_config = config.method_config()  # target None: the first training target, as a trained checkpoint's
    student.eval()  # as kvlearn.load gives it to the evaluation

    def selector_call():
        prompt_choices(method_config, student, prompt, None)  # one KaizenConfig per row (host read-back included)

    @torch.no_grad()
    def prefill_call():
        dense(input_ids=prompt, past_key_values=DynamicCache(config=dense.config), use_cache=True, logits_to_keep=1)

    latency = dict(part="latency", context=args.context, batch=args.latency_batch)
    timed += [Timed(SELECTOR, selector_call, {**latency, "what": "kvlearn.kaizen.apply.prompt_choices (selector "
                                              "forward per row, argmax, configuration)", "dtype": "float32",
                                              "parameters": sum(p.numel() for p in sel.parameters())}),
              Timed(PREFILL, prefill_call, {**latency, "what": "dense model forward of the whole prompt into a "
                                            "DynamicCache, logits_to_keep=1", "dtype": str(dense.dtype).split(".")[-1],
                                            "parameters": sum(p.numel() for p in dense.parameters())})]
    measure(timed[:2], args.warmup, args.steps, args.steps_per_round, device, save)
    student.train()
    dense = None  # frees the bf16 copy before the training part (the closure reads the same cell)
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # 2. a kaizen training step against a plain distillation step, same batch
    stream = TestbedStream(length=config.seq_len, batch_size=config.batch_size, seed=config.seed,
                           dense=config.dense_fraction)
    input_ids, labels = (t.to(device) for t in next(iter(stream)))  # the trainer's first batch, [B, T] each
    plain = dense_student(teacher)
    plain_optimizer = make_optimizer(config, plain)  # group 0 every weight at lr; group 1 (the selector's) empty
    joint = KaizenStep(student, make_multiplier(config), config.kd_topk)
    optimizer = make_optimizer(config, student)
    kaizen_steps = [0]

    def distill_call():
        # dense_distill_step reads config.kd_topk and config.grad_clip only: the kaizen step's values
        return dense_distill_step(config, teacher, plain, plain_optimizer, input_ids, labels)

    def kaizen_call():
        step = kaizen_steps[0]
        kaizen_steps[0] += 1
        return kaizen_train_step(config, teacher, joint, optimizer, input_ids, labels, step, step / config.steps)

    training = dict(part="training", seq_len=config.seq_len, batch=config.batch_size)
    timed += [Timed(DISTILL, distill_call, {**training, "what": "kvlearn.train.distill.dense_distill_step",
                                            "parameters": sum(p.numel() for p in plain.parameters())}, memory=True),
              Timed(KAIZEN, kaizen_call, {**training, "what": "kvlearn.train.kaizen_train.kaizen_train_step",
                                          "axes": list(sel.axes), "actions_per_layer": sel.num_actions,
                                          "layers": sel.backbone.num_layers,
                                          "actions": [str(a) for a in sel.space],
                                          "parameters": sum(p.numel() for p in student.parameters()),
                                          "selector_parameters": sum(p.numel() for p in sel.parameters())},
                    memory=True)]
    measure(timed[2:], args.warmup, args.steps, args.steps_per_round, device, save)
    results = save(partial=False)
    for row in results["rows"]:
        ms = row.get("ms", math.nan)
        print(f"{row['name']:<20} {ms:>10.3f} ms" + (f"  ERROR {row['error']}" if "error" in row else ""))
    print(json.dumps(results["summary"]))
    return 0


def summarize(rows: list[dict]) -> dict:
    """Adds ``ratio_to_prefill`` to the selector row and ``ratio_to_distill_dense_step`` to the kaizen row (in place,
    when both sides have a time); the medians, the two ratios (None when a side has none) and the paper's values."""
    ms = {r["name"]: r["ms"] for r in rows if "ms" in r}
    by_name = {r["name"]: r for r in rows}
    ratios = {}
    for name, ref, key in ((SELECTOR, PREFILL, "selector_over_prefill"),
                           (KAIZEN, DISTILL, "kaizen_step_over_distill_step")):
        ratios[key] = ms[name] / ms[ref] if name in ms and ms.get(ref) else None
        if ratios[key] is not None:
            by_name[name]["ratio_to_" + ref] = ratios[key]
    return {"selector_ms": ms.get(SELECTOR), "prefill_ms": ms.get(PREFILL),
            "selector_over_prefill": ratios["selector_over_prefill"], "kaizen_step_ms": ms.get(KAIZEN),
            "distill_step_ms": ms.get(DISTILL),
            "kaizen_step_over_distill_step": ratios["kaizen_step_over_distill_step"],
            "paper": PAPER}


if __name__ == "__main__":
    sys.exit(main())
