"""One retrofit step against one plain distillation step of the dense model, same batch, one process (issue #10
item 8: "one retrofit step <= 1.5x a plain distillation step of the dense model on the same batch").

    PYTHONPATH=src python benchmarks/retrofit_step_speed.py --out results/retrofit_step_speed_h200.json
    PYTHONPATH=src python benchmarks/retrofit_step_speed.py --shape qwen3-0.6b --out results/retrofit_step_speed_0p6b_h200.json

Milliseconds per optimizer step (teacher forward, student forward + backward, clipping, AdamW step, the logged
values read back) of:

- ``distill_dense``: :func:`kvlearn.train.distill.dense_distill_step`, the student a float32 copy of the teacher
  with its default (SDPA) attention, KD loss only: the reference;
- ``retrofit_kvpop_mlp`` / ``retrofit_kvpop_mlstm``: :func:`kvlearn.train.distill.train_step`, the retrofit's own
  step, KVpop with the MLP / the mLSTM scorer (KVpopConfig defaults: skip connection, delayed readout);
- with ``--methods``: ``retrofit_dms``, ``retrofit_streaming_plus``.

Every retrofit student is :func:`~kvlearn.train.distill.build_models`'s (exactly the trainer's) with
:func:`~kvlearn.train.distill.make_optimizer`; all run on one fixed batch of the testbed stream (the retrofit's
first batch). Each method first runs ``--warmup`` steps (compiles), then the ``--steps`` timed steps are
interleaved in rounds (each method ``--steps-per-round`` steps per round, the order rotated per round), so that
every ratio is measured under the same machine conditions; CUDA events after a synchronize, median per method.
``peak_memory_gib``: the process's peak during the method's steps (every student of the run is resident);
``step_peak_memory_gib``: that peak above what was allocated before the step.

``--one-resident`` (shapes whose students do not fit in memory together: the Qwen3-1.7B shape's did not on an H100,
even two rows): one row's student at a time, in phases ``distill_dense, row 1, distill_dense, row 2, ...``, each
built, warmed up and timed on its own and dropped before the next; the reference's median is over all its phases,
around every row (``step_timing.measure_one_resident``). Its peaks are then each row's own.

Model sources: ``--model PATH`` (default the committed 8-layer testbed teacher; seq 4096, batch 8: the real
retrofit) or ``--shape qwen3-0.6b``: a randomly initialised Qwen3 of Qwen3-0.6B's shape (28 layers, hidden 1024,
16 query / 8 KV heads of 128, intermediate 3072) with the testbed vocabulary (seq 8192, batch 1). ``--smoke``: a
tiny random GQA Qwen3 on the CPU (checks the script end to end, times nothing meaningful).

``--variants``: extra rows in the same run, each a method with one setting changed, named ``<method>+<variant>``
(the default rows unchanged; every row's ``ratio_to_distill_dense`` is to the default reference):

- ``foreach_adamw``: every method with torch's default AdamW (``foreach`` on CUDA) instead of the fused kernel that
  :func:`~kvlearn.train.distill.make_optimizer` takes on CUDA (the rows then also get
  ``ratio_to_reference_variant``: the ratio to ``distill_dense+foreach_adamw``, the setting of the runs before);
- ``bf16_mlstm_matmuls``: ``retrofit_kvpop_mlstm`` with ``KVpopConfig.mlstm_matmul_dtype="bfloat16"`` (bf16
  operands of the mLSTM chunk matmuls);
- ``mlstm_cudagraphs``: ``retrofit_kvpop_mlstm`` with ``KVpopConfig.mlstm_compile_mode="reduce-overhead"`` (the
  compiled mLSTM scorer's forward and backward replayed as CUDA graphs; on the CPU the scorer runs eagerly either way);
- ``graphed_step`` (CUDA only): ``distill_dense``, ``retrofit_kvpop_mlp`` and ``retrofit_kvpop_mlstm`` with the
  step's device part captured in one CUDA graph and replayed (:func:`graphed_step_call`: the retrofit rows are the
  trainer's own ``retrofit --cuda-graph-step``, :class:`~kvlearn.train.distill.GraphedRetrofitStep`, each call
  a real step with its own query positions and learning rates); the reference's own graphed row gives the ratio of
  graphed to graphed (``ratio_to_reference_variant``);
- ``dms_score_mod``: ``retrofit_dms`` with ``DMSConfig.train_attention="flex"``, the penalty as a FlexAttention
  score_mod whose backward accumulates its gradient into a captured buffer (the CUDA default before 7fce8b6's
  measurement; the default ``"auto"`` is now the penalty as one more key channel, ``"flex_channel"``). On the CPU,
  where FlexAttention has no backward, the variant runs ``"dense_channel"`` (the channel's inputs under a dense
  mask) against the default's dense bias.
- ``scorer_kd``: both KVpop methods with ``RetrofitConfig.scorer_kd=1`` (the straight-through soft retention on 256
  query rows per step that also trains the scorers through the distillation loss, :mod:`kvlearn.kvpop.scorer_kd`).
- ``scorer_kd_compiled``: the same with ``RetrofitConfig.scorer_kd_compile=True`` (the soft rows through
  ``torch.compile`` on CUDA; on the CPU they run eagerly either way, so the row times the same code there).

``--sync-sites`` (CUDA only): after the timing, one more step of every method with CUDA's sync debug mode at
``"warn"``: each row gets ``host_syncs_per_step`` (the operations that made the host wait for the GPU, the step's
read-back of its logged values at the end included) and ``host_sync_sites`` (``file:line`` of the Python frames that
issued them, most frequent first), so that a sync in the middle of a step, which leaves the GPU idle while the host
issues what follows, is found by where it is.

``--profile DIR``: after the timing, one more step of every method under ``torch.profiler`` (CUDA kernels on the GPU,
CPU ops on the CPU), written as ``DIR/<method>.txt``: the operators sorted by their own device time (CPU time on the
CPU), the 40 largest, and the step's total (on CUDA also the row's ``device_busy_ms``, the kernels' summed time, and
``device_busy_ratio`` against the distillation step's: the ratio where the GPU, not the host, bounds the step), and
the step's timeline as ``DIR/<method>.trace.json.gz`` (Chrome trace
format: where the GPU idles between kernels; ``benchmarks/step_timeline_gaps.py`` charges each gap to the host operator
that launched the kernel after it). It says where a retrofit step's time over the distillation step goes.

``--host-profile DIR``: three more steps of every method under :mod:`cProfile` (``DIR/<method>.host.txt``): where the
host's time goes, for a step whose wall time exceeds its device time (launch-bound: the GPU idles while Python issues
the next kernels).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import shutil
import sys
import time
import warnings
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from kvlearn.config import DMSConfig, KVpopConfig, StreamingConfig  # noqa: E402
from kvlearn.errors import check, check_int  # noqa: E402
from kvlearn.results import portable_path  # noqa: E402
from kvlearn.testbed.data import TestbedStream  # noqa: E402
from kvlearn.testbed.tasks import MAX_LENGTH, MIN_LENGTH  # noqa: E402
from kvlearn.train.distill import (  # noqa: E402
    NEW_MODULES, GraphedRetrofitStep, RetrofitConfig, build_models, dense_distill_step, dense_read_back,
    dense_step_tensors, dense_student, make_optimizer, train_step, training_kvpop)
from kvlearn.train.cuda_graph import EAGER_STEPS, CudaGraphStep  # noqa: E402
from step_timing import (  # noqa: E402
    Timed, add_source_options, measure, measure_one_resident, model_shape, random_model_folder, resolve_source, results_saver,
    run_main)

REFERENCE = "distill_dense"
METHODS = (REFERENCE, "retrofit_kvpop_mlp", "retrofit_kvpop_mlstm", "retrofit_dms", "retrofit_streaming_plus")
DEFAULT_METHODS = METHODS[:3]
ACCEPTANCE_METHOD = "retrofit_kvpop_mlstm"  # the paper's KVpop
# --variants: name -> the methods it makes extra rows of
VARIANTS = {"foreach_adamw": METHODS, "bf16_mlstm_matmuls": ("retrofit_kvpop_mlstm",),
            "mlstm_cudagraphs": ("retrofit_kvpop_mlstm",), "dms_score_mod": ("retrofit_dms",),
            "scorer_kd": ("retrofit_kvpop_mlp", "retrofit_kvpop_mlstm"),
            "scorer_kd_compiled": ("retrofit_kvpop_mlp", "retrofit_kvpop_mlstm"),
            "graphed_step": (REFERENCE, "retrofit_kvpop_mlp", "retrofit_kvpop_mlstm")}
# the defaults by model source: --model (None), --shape qwen3-0.6b / qwen3-1.7b, --smoke (tiny)
DEFAULTS = {source: dict(zip(("seq_len", "batch_size", "budget", "window", "warmup", "steps"), values))
            for source, values in ((None, (4096, 8, 1024, 256, 3, 10)), ("qwen3-0.6b", (8192, 1, 1024, 256, 3, 10)),
                                   ("qwen3-1.7b", (8192, 1, 1024, 256, 3, 10)), ("tiny", (256, 2, 64, 16, 1, 2)))}


def method_config(name: str, args, model: str, out: str, device: str, variant: str | None = None) -> RetrofitConfig:
    """The retrofit config of method ``name`` (``distill_dense`` reads only its KD, clipping and ``lr`` fields)
    under ``variant`` (``bf16_mlstm_matmuls``, ``mlstm_cudagraphs``, ``dms_score_mod``, ``scorer_kd`` and
    ``scorer_kd_compiled`` change the config; ``foreach_adamw`` the
    optimizer only)."""
    s, w, b = args.sinks, args.window, args.budget
    if name == "retrofit_dms":
        score_mod = "flex" if str(device).startswith("cuda") else "dense_channel"  # no flex backward on CPU
        attention = score_mod if variant == "dms_score_mod" else "auto"
        kw = dict(method="dms", dms=DMSConfig(sinks=s, window=w, budget=b, target_cr=args.seq_len / b,
                                              train_attention=attention))
    elif name == "retrofit_streaming_plus":
        kw = dict(method="streaming_plus", streaming=StreamingConfig(budget=b, sinks=s))
    else:
        kv = KVpopConfig(sinks=s, window=w, topk=b - s - w, scorer="mlstm" if name == "retrofit_kvpop_mlstm" else "mlp")
        if variant == "bf16_mlstm_matmuls":
            kv = replace(kv, mlstm_matmul_dtype="bfloat16")
        elif variant == "mlstm_cudagraphs":
            kv = replace(kv, mlstm_compile_mode="reduce-overhead")
        kd = variant in ("scorer_kd", "scorer_kd_compiled")
        kw = dict(kvpop=kv, scorer_kd=1.0 if kd else 0.0, scorer_kd_compile=variant == "scorer_kd_compiled")
    return RetrofitConfig(model=model, out=out, batch_size=args.batch_size, seq_len=args.seq_len, device=device,
                          seed=args.seed, **kw)


def row_name(name: str, variant: str | None) -> str:
    return name if variant is None else f"{name}+{variant}"


def timed_method(name: str, config: RetrofitConfig, teacher, input_ids: torch.Tensor, labels: torch.Tensor,
                 device: torch.device, variant: str | None = None) -> Timed:
    """Method ``name`` (under ``variant``, see ``--variants``) as a :class:`~step_timing.Timed` step on the batch
    ``input_ids``, ``labels`` (``[B, T]`` each): its student (``dense_student`` for the reference, else exactly the
    trainer's, ``build_models``) and optimizer, each call one optimizer step (step ``n`` of a ``config.steps``-step
    run); the row records the parameters, the method's exact config and whether AdamW is fused."""
    if name == REFERENCE:
        student, kv = dense_student(teacher), None
    else:
        torch.manual_seed(config.seed)  # as retrofit() seeds before build_models (the new modules' init)
        _, student = build_models(config, device)
        kv = training_kvpop(config, student)
    graphed = variant == "graphed_step"
    optimizer = make_optimizer(config, student, device, fused=False if variant == "foreach_adamw" else None,
                               capturable=graphed)
    marker = NEW_MODULES[config.method] if name != REFERENCE else None
    fields = {"method": "dense" if name == REFERENCE else config.method,
              "parameters": sum(p.numel() for p in student.parameters()),
              "new_parameters": sum(p.numel() for n, p in student.named_parameters() if marker and marker in n),
              "adamw_fused": bool(optimizer.defaults.get("fused"))}
    if variant is not None:
        fields.update(base=name, variant=variant)
    if name != REFERENCE and config.method == "kvpop":  # the exact config, and the top-k training holds
        fields.update(scorer=config.kvpop.scorer, kvpop=asdict(config.kvpop), kvpop_training_topk=kv.topk)
        if config.scorer_kd:
            fields.update(scorer_kd=config.scorer_kd, scorer_kd_queries=config.scorer_kd_queries,
                          scorer_kd_temperature=config.scorer_kd_temperature,
                          scorer_kd_compile=config.scorer_kd_compile)
    elif name != REFERENCE and config.method == "dms":
        fields["dms"] = asdict(config.dms)
    elif name != REFERENCE:
        fields["streaming"] = asdict(config.streaming)
    step = [0]

    def call() -> dict:
        n = step[0]
        step[0] += 1
        if name == REFERENCE:
            return dense_distill_step(config, teacher, student, optimizer, input_ids, labels)
        return train_step(config, teacher, student, optimizer, input_ids, labels, n, n / config.steps, kv)

    if graphed:
        fields["graphed_step"] = True
        return Timed(row_name(name, variant), graphed_step_call(name, config, teacher, student, optimizer, input_ids,
                                                                labels, kv, device, fields), fields, memory=True,
                     first_key="first_step_s")

    return Timed(row_name(name, variant), call, fields, memory=True, first_key="first_step_s")


def graphed_step_call(name: str, config: RetrofitConfig, teacher, student, optimizer, input_ids: torch.Tensor,
                      labels: torch.Tensor, kv, device: torch.device, fields: dict | None = None):
    """``--variants graphed_step``: method ``name``'s step replayed as one CUDA graph. A retrofit row is the trainer's
    own :class:`~kvlearn.train.distill.GraphedRetrofitStep` (``retrofit --cuda-graph-step``: each call a real
    step, its query positions and learning rates those of its step number); the reference is
    :func:`~kvlearn.train.distill.dense_step_tensors` in a :class:`~kvlearn.train.cuda_graph.CudaGraphStep`. The
    first call runs the eager steps and the capture (so that the warm-up, not the timing, holds them); each later
    call is one replay and one read-back, as the eager step reads back once. ``fields`` (the row's) gets
    ``graph_pool_gib``: the memory the allocator reserved during the capture (the graph's private pool, which the
    row's ``peak_memory_gib`` of the replays does not see: a replay allocates nothing)."""
    if name == REFERENCE:
        graph = CudaGraphStep(lambda: dense_step_tensors(config, teacher, student, optimizer, input_ids, labels,
                                                         set_to_none=False), device)

        def one():
            return dense_read_back(*graph())
    else:
        step_fn = GraphedRetrofitStep(config, teacher, student, optimizer, kv, device)
        step = [0]

        def one():
            n = step[0]
            step[0] += 1
            return step_fn(input_ids, labels, n, n / config.steps)

    def call() -> dict:
        if calls:
            return one()
        for _ in range(EAGER_STEPS):  # the first call: the eager steps, then the capture
            one()
        calls.append(1)
        # the capture empties the allocator's cache first (torch.cuda.graph): empty it here too, so that what is
        # reserved afterwards above this is the graph's pool (without this, a first H100 run read -0.062 GiB)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(device)
        out = one()
        if fields is not None:
            fields["graph_pool_gib"] = round((torch.cuda.memory_reserved(device) - reserved) / 2**30, 3)
        return out

    calls: list = []
    return call


def parse(argv) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_source_options(ap, "retrofit_step_speed")
    ap.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                    help=f"comma list of {', '.join(METHODS)} ({REFERENCE} is always run: the reference)")
    ap.add_argument("--seq-len", type=int, default=None, help="default 4096 (--model), 8192 (--shape), 256 (--smoke)")
    ap.add_argument("--batch-size", type=int, default=None, help="default 8 (--model), 1 (--shape), 2 (--smoke)")
    ap.add_argument("--budget", type=int, default=None, help="sinks + window + top-k (default 1024; --smoke 64)")
    ap.add_argument("--window", type=int, default=None, help="default 256 (--smoke 16)")
    ap.add_argument("--sinks", type=int, default=4)
    ap.add_argument("--variants", default="",
                    help=f"comma list of extra rows: {', '.join(VARIANTS)} (default none; see the module docstring)")
    ap.add_argument("--sync-sites", action="store_true",
                    help="after the timing, count the host syncs of one step of every method and where they are "
                         "issued (CUDA only)")
    ap.add_argument("--count-operators", action="store_true",
                    help="after the timing, count the non-view operators one step of every method dispatches (the "
                         "host's launch work) and the kvlearn sites that issue the most")
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="after the timing, profile one step of every method into DIR/<method>.txt")
    ap.add_argument("--one-resident", action="store_true",
                    help="one row's student in memory at a time (shapes whose students do not fit together, e.g. "
                         "qwen3-1.7b on an H100): the reference, then each row followed by the reference again, "
                         "each phase warmed up and timed on its own")
    ap.add_argument("--host-profile", default=None, metavar="DIR",
                    help="after the timing, three steps of every method under cProfile into DIR/<method>.host.txt "
                         "(where the host's Python time goes)")
    args = ap.parse_args(argv)
    resolve_source(args, DEFAULTS, "retrofit_step_speed", REPO)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in args.methods:
        check(m in METHODS, f"--methods: {m!r} is unknown: expected some of {', '.join(METHODS)}")
    args.methods = [REFERENCE] + [m for m in dict.fromkeys(args.methods) if m != REFERENCE]
    args.variants = list(dict.fromkeys(v.strip() for v in args.variants.split(",") if v.strip()))
    for v in args.variants:
        check(v in VARIANTS, f"--variants: {v!r} is unknown: expected some of {', '.join(VARIANTS)}")
    # the rows: every method, then every variant of the methods it applies to
    args.rows = [(m, None) for m in args.methods] + [(m, v) for v in args.variants for m in args.methods
                                                     if m in VARIANTS[v]]
    check_int("--seq-len", args.seq_len, MIN_LENGTH, MAX_LENGTH, hint=" (the testbed's example lengths)")
    check_int("--batch-size", args.batch_size, 1)
    check(args.budget > args.sinks + args.window,
          f"--budget={args.budget} is invalid: expected > sinks + window = {args.sinks + args.window} (a top-k >= 1)")
    check("graphed_step" not in args.variants or str(args.device).startswith("cuda"),
          f"--variants graphed_step needs a CUDA device (it captures the step in a CUDA graph), not --device={args.device}")
    check(not args.sync_sites or str(args.device).startswith("cuda"),
          f"--sync-sites needs a CUDA device (CUDA's sync debug mode), not --device={args.device}")
    extras = [name for name, on in (("--sync-sites", args.sync_sites), ("--profile", args.profile),
                                     ("--host-profile", args.host_profile), ("--count-operators", args.count_operators))
              if on]
    check(not (args.one_resident and extras), f"--one-resident cannot be combined with {', '.join(extras)}: those "
          "run every row again after the timing, when only one row's student exists at a time")
    check(args.seq_len > args.budget, f"--seq-len={args.seq_len} is invalid for --budget={args.budget}: expected a "
          "sequence longer than the budget (else nothing is evicted)")
    return args


def main(argv: list[str] | None = None) -> int:
    return run_main("retrofit_step_speed", argv, parse, run)


def run(args, tmp: Path, command: str) -> int:
    """Build the teacher and every method's student, warm up, time the interleaved rounds; write ``args.out``."""
    start, device = time.perf_counter(), torch.device(args.device)
    teacher_folder = args.model
    if args.source is not None:  # a random model of that shape, with the testbed teacher's tokenizer files
        teacher_folder = random_model_folder(args.source, tmp / args.source, args.model, device)
    configs = {(m, v): method_config(m, args, teacher_folder, str(tmp / "unused"), args.device, v)
               for m, v in args.rows}
    from kvlearn.checkpoint import load

    teacher = load(teacher_folder, dtype=torch.float32, device=device)  # as build_models loads it
    teacher.requires_grad_(False)
    stream = TestbedStream(length=args.seq_len, batch_size=args.batch_size, seed=args.seed,
                           dense=configs[REFERENCE, None].dense_fraction)
    input_ids, labels = (t.to(device) for t in next(iter(stream)))  # the retrofit's first batch, [B, T] each
    def build(key) -> Timed:
        return timed_method(key[0], configs[key], teacher, input_ids, labels, device, key[1])

    timed = [] if args.one_resident else [build(key) for key in args.rows]
    import transformers

    fields = dict(
        model=(f"random {args.source} shape (testbed vocabulary)" if args.source else portable_path(teacher_folder)),
        model_shape=model_shape(teacher.config),
        seq_len=args.seq_len, batch_size=args.batch_size, budget=args.budget, sinks=args.sinks, window=args.window,
        variants=args.variants,
        warmup=args.warmup, steps=args.steps, steps_per_round=args.steps_per_round, smoke=args.smoke,
        precision="float32 weights and AdamW (fused where a row says adamw_fused), bf16 autocast on CUDA (the "
                  "retrofit's)", torch=torch.__version__,
        transformers=transformers.__version__,
        resident=("one row's student at a time (--one-resident: phases reference, row, reference, ...; peak memory "
                  "is the row's own)" if args.one_resident else "every row's student at once (interleaved rounds)"))

    save = results_saver(args.out, timed, summarize, device, command, fields, start)

    if args.one_resident:
        measure_one_resident(args.rows, build, (REFERENCE, None), args.warmup, args.steps, device, save, timed)
    else:
        measure(timed, args.warmup, args.steps, args.steps_per_round, device, save)
    results = save(partial=False)
    if args.count_operators:
        for t in timed:
            if t.error is None:
                try:  # a compiled region may refuse to run under a dispatch mode: the row keeps its time
                    t.fields.update(count_operators(t.call))
                except Exception as exc:  # noqa: BLE001
                    t.fields["operator_count_error"] = f"{type(exc).__name__}: {exc}"[:300]
        results = save(partial=False)
    if args.sync_sites:
        for t in timed:  # a row whose counting step fails records why; the timings and the other rows stand
            try:
                t.fields.update(sync_sites(t.call))
            except Exception as exc:  # noqa: BLE001
                t.fields["host_sync_error"] = f"{type(exc).__name__}: {exc}"[:300]
        results = save(partial=False)
    if args.profile:
        for t, busy in zip(timed, profile_steps(timed, Path(args.profile), device)):
            t.fields["device_busy_ms"] = busy
        results = save(partial=False)
    if args.host_profile:
        host_profile_steps(timed, Path(args.host_profile), device)
    for row in results["rows"]:
        ms, ratio = row.get("ms", math.nan), row.get("ratio_to_distill_dense") or math.nan
        print(f"{row['name']:<42} {ms:>10.2f} ms  x{ratio:.3f}  peak {row.get('peak_memory_gib', 0):.2f} GiB"
              + (f"  ERROR {row['error']}" if "error" in row else ""))
    print(json.dumps(results["summary"]))
    return 0


def count_operators(call, top: int = 12) -> dict:
    """One ``call()`` under ``cache_operator_count.OperatorCounter``: ``operators_per_step`` (every non-view aten
    operator dispatched, backward included), ``kvlearn_operators_per_step`` (those issued from kvlearn's code; the
    backward's and the model's own count in the caller's frame, ``train/distill.py``) and the ``top`` sites."""
    from cache_operator_count import OperatorCounter

    counter = OperatorCounter()
    with counter:
        call()
    return {"operators_per_step": counter.total, "kvlearn_operators_per_step": sum(counter.sites.values()),
            "operator_sites": dict(counter.sites.most_common(top))}


SYNC_MESSAGE = "synchronizing CUDA operation"  # torch's warning under set_sync_debug_mode("warn")


def sync_sites(call, set_mode=None, top: int = 10) -> dict:
    """One ``call()`` with CUDA's sync debug mode at ``"warn"`` (``set_mode``: ``torch.cuda.set_sync_debug_mode``
    unless given), back to ``"default"`` after: ``{"host_syncs_per_step": n, "host_sync_sites": {"file:line": count}}``,
    the ``top`` most frequent sites (repository-relative paths) of the Python frames whose operation synchronized."""
    set_mode = torch.cuda.set_sync_debug_mode if set_mode is None else set_mode
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        set_mode("warn")
        try:
            call()
        finally:
            set_mode("default")
    sites = Counter(f"{portable_path(w.filename)}:{w.lineno}" for w in caught if SYNC_MESSAGE in str(w.message))
    return {"host_syncs_per_step": sum(sites.values()), "host_sync_sites": dict(sites.most_common(top))}


def profile_file_stem(name: str) -> str:
    """A row name as a file name the device tool returns: ``+`` (a variant row, ``method+variant``) becomes ``__``."""
    return name.replace("+", "__")


def device_busy_ms(events) -> float:
    """The summed self time (ms) of a profile's device events (``key_averages()``: the kernels, as the table's
    "Self CUDA time total" footer sums them): the time the GPU was busy, 0 without device events."""
    device_types = {"CUDA", "PrivateUse1", "XPU", "MTIA"}
    def self_us(e) -> float:  # self_cuda_time_total: the name before torch's device-generic one
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0.0)

    return sum(self_us(e) for e in events
               if e.device_type.name in device_types and not getattr(e, "is_user_annotation", False)) / 1e3


def profile_steps(timed: list, folder: Path, device: torch.device, rows: int = 40) -> list[float | None]:
    """One step of each method under ``torch.profiler`` into ``folder/<name>.txt`` (:func:`profile_file_stem`): the
    step's wall time, then the
    ``rows`` operators with the most self device time (self CPU time on the CPU). Returns each step's device busy time
    in ms (:func:`device_busy_ms`; None on the CPU), which ``summarize`` turns into ``device_busy_ratio``: the ratio a
    step would approach where the GPU, not the host, bounds it (a larger model)."""
    from torch.profiler import ProfilerActivity, profile

    folder.mkdir(parents=True, exist_ok=True)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    busy = []
    for t in timed:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profile(activities=activities) as prof:
            t.call()
            if cuda:
                torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t0) * 1e3
        averages = prof.key_averages()
        busy.append(device_busy_ms(averages) if cuda else None)
        table = averages.table(sort_by=key, row_limit=rows, max_name_column_width=90)
        trace = folder / f"{profile_file_stem(t.name)}.trace.json"
        prof.export_chrome_trace(str(trace))  # the timeline (chrome://tracing, Perfetto): where the GPU idles
        with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        trace.unlink()
        (folder / f"{profile_file_stem(t.name)}.txt").write_text(f"# {t.name}: one step under the profiler, {wall_ms:.1f} ms wall "
                                              f"(profiler overhead included); sorted by {key}\n{table}\n")
        print(f"profile of {t.name}: {folder / (profile_file_stem(t.name) + '.txt')}")
    return busy


def host_profile_steps(timed: list, folder: Path, device: torch.device, steps: int = 3, rows: int = 45) -> None:
    """``steps`` steps of each method under :mod:`cProfile` into ``folder/<name>.host.txt``: the functions by their
    own time, then by cumulative time, ``rows`` each. A step that launches its kernels faster than the GPU runs them
    spends its waiting in the read-back at its end (the ``.cpu()`` of the logged values); a launch-bound step spends
    it in the Python and dispatch of the functions listed, which says which part to fuse or compile."""
    import cProfile
    import io
    import pstats

    folder.mkdir(parents=True, exist_ok=True)
    for t in timed:
        if device.type == "cuda":
            torch.cuda.synchronize()
        profiler = cProfile.Profile()
        t0 = time.perf_counter()
        profiler.enable()
        for _ in range(steps):
            t.call()
        profiler.disable()
        wall_ms = (time.perf_counter() - t0) * 1e3 / steps
        text = io.StringIO()
        for order in ("tottime", "cumulative"):
            stats = pstats.Stats(profiler, stream=text)
            stats.sort_stats(order).print_stats(rows)
        path = folder / f"{profile_file_stem(t.name)}.host.txt"
        path.write_text(f"# {t.name}: {steps} steps under cProfile, {wall_ms:.1f} ms wall a step (cProfile overhead "
                        f"included)\n{text.getvalue()}")
        print(f"host profile of {t.name}: {path}")


def summarize(rows: list[dict]) -> dict:
    """Adds ``ratio_to_distill_dense`` to every timed row (in place; a variant row of a variant the reference has
    too also ``ratio_to_reference_variant``); the ratios (``variants``: each variant row's) and the acceptance
    (judged on ``retrofit_kvpop_mlstm``: None when it or the reference has no time)."""
    ms = {r["name"]: r["ms"] for r in rows if "ms" in r}
    ref = ms.get(REFERENCE)
    variants = {}
    for r in rows:
        if "ms" in r and ref:
            r["ratio_to_distill_dense"] = r["ms"] / ref
        ref_variant = ms.get(row_name(REFERENCE, r["variant"])) if "variant" in r else None
        if "ms" in r and ref_variant and r["name"] != row_name(REFERENCE, r["variant"]):
            r["ratio_to_reference_variant"] = r["ms"] / ref_variant
        if "variant" in r:
            variants[r["name"]] = {"ratio_to_distill_dense": r.get("ratio_to_distill_dense"),
                                   **{k: r[k] for k in ("ratio_to_reference_variant",) if k in r}}
    ratios = {f"{n}_over_{REFERENCE}": (ms[n] / ref if n in ms and ref else None) for n in METHODS[1:]
              if n in {r["name"] for r in rows} or n in DEFAULT_METHODS}
    busy = {r["name"]: r["device_busy_ms"] for r in rows if r.get("device_busy_ms")}
    for r in rows:  # --profile on CUDA: the same ratio on the GPU's busy time of one profiled step
        if r["name"] in busy and busy.get(REFERENCE):
            r["device_busy_ratio"] = busy[r["name"]] / busy[REFERENCE]
    device_ratios = {r["name"]: r["device_busy_ratio"] for r in rows
                     if "device_busy_ratio" in r and r["name"] != REFERENCE}
    judged = ratios[f"{ACCEPTANCE_METHOD}_over_{REFERENCE}"]
    acceptance = {"retrofit_step_le_1p5x_distill_step": None if judged is None else judged <= 1.5}
    graphed = row_name(ACCEPTANCE_METHOD, "graphed_step")
    if graphed in ms:  # retrofit --cuda-graph-step against the graphed and the eager distillation step
        ref_graphed = ms.get(row_name(REFERENCE, "graphed_step"))
        acceptance["graphed_over_graphed_distill_step"] = None if not ref_graphed else ms[graphed] / ref_graphed
        acceptance["graphed_over_eager_distill_step"] = None if not ref else ms[graphed] / ref
        acceptance["graphed_retrofit_step_le_1p5x_graphed_distill_step"] = (
            None if not ref_graphed else ms[graphed] / ref_graphed <= 1.5)
    return {f"{REFERENCE}_ms": ref, **ratios, **({"variants": variants} if variants else {}),
            **({"device_busy_ratio": device_ratios} if device_ratios else {}),
            "acceptance_method": ACCEPTANCE_METHOD, "acceptance": acceptance}


if __name__ == "__main__":
    sys.exit(main())
