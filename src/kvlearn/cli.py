"""The ``kvlearn`` command: ``demo``, ``eval``, ``methods``, ``pretrain``, ``retrofit``, ``kaizen-train`` and ``testbed``.

Bad input is reported as one line (``kvlearn: error: ...``) with exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

from .errors import KVLearnError, check, check_int
from .lineage import teacher_mismatch
from .output_paths import check_output_folder, check_writable_location
from .threads import THREADS_HELP, set_threads, thread_count

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO_ROOT / "checkpoints" / "testbed-teacher"
DEFAULT_KVPOP_MODEL = REPO_ROOT / "checkpoints" / "testbed-kvpop"
PLOT_SUFFIXES = (".png", ".pdf", ".svg")
# The demo must finish within 10 minutes on 2 shared CPU cores. Its cost is dominated by the dense cache's prefill of
# 4096 tokens, by trace answers (~300 decoded tokens when the teacher does not stop early) and by the KVpop student's
# chunked prefill (the running top-k cutoff of each chunk): one batch per family and method. The wall time of a
# run is stored in results/demo.json (`wall_seconds`).
DEMO_N_PER_TASK = 4
DEMO_BATCH_SIZE = 4
# One thread: on 2 cores shared with another busy process, a decode step of the teacher at batch 4 took 21 ms with one
# torch thread and 109 ms with two (oversubscribed threads wait on each other); on an idle machine two are faster.
DEMO_THREADS = 1


def default_model_path() -> str:
    """The embedded teacher: ``$KVLEARN_MODEL`` if set, else ``checkpoints/testbed-teacher`` of this checkout."""
    return os.environ.get("KVLEARN_MODEL", str(DEFAULT_MODEL))


def default_kvpop_model_path() -> str:
    """The shipped KVpop student: ``$KVLEARN_KVPOP_MODEL`` if set, else ``checkpoints/testbed-kvpop`` of this
    checkout."""
    return os.environ.get("KVLEARN_KVPOP_MODEL", str(DEFAULT_KVPOP_MODEL))


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    match = re.fullmatch(r"cuda(?::(\d+))?", name)
    check(name == "cpu" or match is not None, f"device={name!r} is invalid: expected auto, cpu or cuda[:N]")
    check(name == "cpu" or torch.cuda.is_available(), f"device={name!r} requested but CUDA is not available: use --device cpu")
    if match is not None and match.group(1) is not None:
        count = torch.cuda.device_count()
        check(int(match.group(1)) < count, f"device={name!r} is invalid: this machine has {count} CUDA device(s), "
                                           f"expected cuda or cuda:N with N in [0, {count - 1}]")
    return name


def _tasks(text: str) -> tuple[str, ...]:
    from .testbed.tasks import FAMILIES

    if text == "all":
        return FAMILIES
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [t for t in names if t not in FAMILIES]
    check(not unknown and names, f"--tasks {text!r}: unknown task(s) {', '.join(unknown) or '(none given)'}; expected a comma list of {', '.join(FAMILIES)} or 'all'")
    repeated = sorted({t for t in names if names.count(t) > 1}, key=names.index)
    check(not repeated, f"--tasks {text!r}: task(s) {', '.join(repeated)} given more than once; expected each of "
                        f"{', '.join(FAMILIES)} at most once, or 'all'")
    return names


def _load(path: str, device: str):
    from .checkpoint import load as load_model, serving_dtype

    return load_model(path, dtype=serving_dtype(device), device=device)


def display_path(path: str | os.PathLike) -> str:
    """``path`` as a results file records it: relative to the repository inside it, ``$OUT/...`` or
    ``$TMPDIR/...`` under those folders (:func:`kvlearn.results.portable_path`), so results stay machine-independent."""
    from .results import portable_path

    return portable_path(str(Path(path).resolve()))


def check_output_path(path: str | os.PathLike, option: str, suffixes: tuple[str, ...]) -> Path:
    """One-line error unless ``path`` can be written as a file (checked before any evaluation starts)."""
    p = Path(path)
    check(not p.is_dir(), f"{option} {str(path)!r} is a directory: expected a file path ending in {' or '.join(suffixes)}")
    check(p.suffix.lower() in suffixes, f"{option} {str(path)!r}: expected a file path ending in {' or '.join(suffixes)}")
    return check_writable_location(p, option)


def check_model_context(path: str, context: int) -> None:
    """One-line errors for a missing checkpoint, an unsupported family, or ``context`` beyond the model's
    ``max_position_embeddings`` (read from ``config.json``, before the weights load)."""
    from .hf import read_model_config

    limit = getattr(read_model_config(path), "max_position_embeddings", None)
    check(limit is None or context <= limit,
          f"--context {context} exceeds the model's max_position_embeddings={limit} ({path}): expected --context <= {limit}")


def check_kvpop_model(path: str) -> None:
    """One-line error unless ``path`` is a checkpoint folder whose ``config.json`` records a ``kvpop`` block (a model
    saved after ``apply_kvpop``, e.g. by ``kvlearn retrofit``); checked before any evaluation starts."""
    import json

    from .methods import get_method

    key = get_method("kvpop").config_key
    check(Path(path).is_dir(), f"--kvpop-model {path!r} does not exist: expected a KVpop checkpoint folder or 'none'")
    try:
        saved = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        saved = None
    check(isinstance(saved, dict) and isinstance(saved.get(key), dict),
          f"--kvpop-model {path!r} has no {key!r} block in config.json: expected a model saved after apply_kvpop "
          "(kvlearn retrofit) or 'none'")


def _eval_config(args, method: str, budget, tasks, model: str | None = None, target: float | None = None):
    """The ``EvalConfig`` of ``method`` at ``budget`` from the command line, with the trained options of the
    checkpoint ``model`` (default ``--model``); ``target`` overrides ``--target``."""
    from .eval.accuracy import EvalConfig

    from .methods import trained_options

    # a trained checkpoint is evaluated under the pattern it was trained for (its scorer, window, ...), the budget
    # from the command line; --window re-splits the budget, except for a delayed mLSTM readout, tied to its window
    options = trained_options(method, model or args.model)
    window = getattr(args, "window", None)
    if window is not None:
        tied = options.get("scorer") == "mlstm" and options.get("delayed_readout", True) and "window" in options
        check(not tied or options["window"] == window,
              f"--window {window} is invalid for this checkpoint: its delayed mLSTM readout is tied to the window it "
              f"was trained with ({options.get('window')})")
        options["window"] = window
    overflow = getattr(args, "dms_overflow", None)
    if overflow is not None:
        check(method == "dms", f"--dms-overflow is for --method dms (which kept token its full budget evicts), not "
                               f"--method {method}")
        options["overflow_evicts"] = overflow
    configuration = getattr(args, "configuration", None)
    if configuration is not None:
        check(method == "kaizen_static", f"--configuration is for --method kaizen_static (one given per-layer "
                                         f"configuration), not --method {method}")
        options["configuration"] = configuration
    return EvalConfig(method=method, budget=budget, sinks=args.sinks, tasks=tasks, n_per_task=args.n_per_task,
                      context=args.context, batch_size=args.batch_size, split=args.split, protocol=args.protocol,
                      chunk_size=args.chunk_size, target=target if target is not None else getattr(args, "target", None),
                      options=options or None)


def untrained_modules_warning(method: str, model, model_path) -> str | None:
    """One line when a learned ``method`` is evaluated on a model that carries none of its trained modules, so the
    method runs freshly initialised ones (documented behaviour, e.g. the untrained-scorer ablation, but rarely what a
    user means); ``None`` otherwise."""
    if method in ("kvpop", "kaizen+kvpop"):
        from .kvpop.apply import has_kvpop

        if not has_kvpop(model):
            return (f"--model {model_path} carries no trained KVpop scorers: --method {method} runs freshly initialised "
                    "ones (zero-initialised: they rank by recency); pass a retrofitted student "
                    "(e.g. checkpoints/testbed-kvpop) or --kvpop-scorers FOLDER")
    elif method == "dms":
        from .dms.apply import recorded_config

        if recorded_config(model) is None:
            return (f"--model {model_path} carries no trained DMS gates: --method dms runs freshly initialised ones; "
                    "pass a student of `kvlearn retrofit --method dms`")
    elif method == "kaizen":
        from .kaizen.selector import SELECTOR_NAME

        if getattr(model, SELECTOR_NAME, None) is None:
            return (f"--model {model_path} carries no trained KV-Kaizen selector: --method kaizen runs a freshly "
                    "initialised one (no trained choice); pass the final/ folder of `kvlearn kaizen-train`")
    return None


def cmd_eval(args) -> int:
    from .eval.accuracy import evaluate, format_table
    from .eval.plots import plot_accuracy
    from .results import make_results, write_results

    scorers = getattr(args, "kvpop_scorers", None)
    check(scorers is None or args.method in ("kvpop", "kaizen+kvpop"),
          f"--kvpop-scorers is for methods kvpop and kaizen+kvpop (their eviction reads KVpop's scorers), not "
          f"--method {args.method}")
    if scorers is not None:
        check(os.path.isfile(os.path.join(scorers, "config.json")),
              f"--kvpop-scorers {scorers}: no config.json there (expected a KVpop checkpoint folder, e.g. "
              "checkpoints/testbed-kvpop)")
    config = _eval_config(args, args.method, args.budget, _tasks(args.tasks), model=scorers)
    check(not args.plot or args.out, "--plot needs --out: the plot is drawn from the results file's rows")
    if args.out:
        check_output_path(args.out, "--out", (".json",))
    if args.plot:
        check_output_path(args.plot, "--plot", PLOT_SUFFIXES)
    device = _device(args.device)
    check_model_context(args.model, args.context)
    set_threads(args.threads)
    model = _load(args.model, device)
    if scorers is not None:  # a KVpop student's scorers and decays onto --model (e.g. a Kaizen-trained backbone)
        from .kvpop.apply import load_kvpop

        load_kvpop(model, scorers)
    warning = untrained_modules_warning(args.method, model, args.model)
    if warning:
        print(f"warning: {warning}", file=sys.stderr)
    start = time.perf_counter()
    rows = evaluate(model, config)
    wall = time.perf_counter() - start
    print(format_table(rows))
    if args.out:
        extra = {"kvpop_scorers": display_path(scorers)} if scorers is not None else {}
        results = make_results("accuracy", rows, device=device, model=display_path(args.model), context=args.context,
                               split=args.split, protocol=args.protocol, wall_seconds=round(wall, 1), **extra)
        print(f"wrote {write_results(args.out, results)}")
        if args.plot:
            print(f"wrote {plot_accuracy(rows, args.plot)}")
    print(f"wall time {wall:.0f} s")
    return 0


# the teacher's row sets; the KVpop student (--kvpop-model) adds one more: method kvpop at the same budget
DEMO_METHODS = (("dense", None), ("streaming", "budget"))
DEMO_TITLE = "Testbed teacher, context {context}: full cache vs sinks+window (StreamingLLM)"
DEMO_KVPOP_TITLE = ("Testbed teacher, context {context}: full cache vs sinks+window (StreamingLLM);\n"
                    "its KVpop student: sinks+window+learned top-k (KVpop), and the same in 4-bit stores (kaizen+kvpop)")
DEMO_COMPOSED_BITS = 4  # the student's cache once more in KV-Kaizen's packed stores: 16 / 4 = 4x fewer bytes a token
DEMO_OTHER_TEACHER = "\n(the KVpop student was distilled from another teacher: not like for like)"


def _demo_student(args) -> str | None:
    """The KVpop student of the demo: ``--kvpop-model``, or ``None`` for ``none``."""
    return None if args.kvpop_model.lower() == "none" else args.kvpop_model


def _demo_runs(args, tasks) -> list[tuple[str, object]]:
    """``(model folder, EvalConfig)`` per row set of the demo: the teacher under :data:`DEMO_METHODS`, then the KVpop
    student (``--kvpop-model``, unless ``none``) under ``kvpop`` at ``--budget`` with its trained options, and under
    ``kaizen+kvpop`` at the same budget with every layer's keys and values in :data:`DEMO_COMPOSED_BITS`-bit packed
    stores (the total factor: 16 / bits x context / budget). Every config is built (and so checked) here, before
    anything is evaluated."""
    runs = [(args.model, _eval_config(args, m, args.budget if b else None, tasks)) for m, b in DEMO_METHODS]
    student = _demo_student(args)
    if student is not None:
        check_kvpop_model(student)
        runs.append((student, _eval_config(args, "kvpop", args.budget, tasks, model=student)))
        total = 16 / DEMO_COMPOSED_BITS * args.context / args.budget
        runs.append((student, _eval_config(args, "kaizen+kvpop", args.budget, tasks, model=student, target=total)))
    return runs


def _evaluate_runs(runs: list[tuple[str, object]], device: str) -> list[dict]:
    """The rows of every run, each naming its ``model`` (as results record paths); one model loaded at a time."""
    from itertools import groupby

    from .eval.accuracy import evaluate

    rows = []
    for path, group in groupby(runs, key=lambda run: run[0]):
        model = _load(path, device)
        for _, config in group:
            rows += [{"method": r["method"], "model": display_path(path), **r} for r in evaluate(model, config)]
        del model
    return rows


def cmd_demo(args) -> int:
    from .eval.accuracy import format_table
    from .eval.plots import plot_accuracy
    from .results import make_results, write_results

    start = time.perf_counter()
    runs = _demo_runs(args, _tasks(args.tasks))
    check_output_path(args.out, "--out", (".json",))
    check_output_path(args.plot, "--plot", PLOT_SUFFIXES)
    device = _device(args.device)
    for path in dict.fromkeys(path for path, _ in runs):
        check_model_context(path, args.context)
    set_threads(args.threads)
    student = _demo_student(args)
    mismatch = None if student is None else teacher_mismatch(student, args.model)
    if mismatch:
        print(f"warning: {mismatch}", file=sys.stderr, flush=True)
    rows = _evaluate_runs(runs, device)
    wall = time.perf_counter() - start
    print(format_table(rows))
    results = make_results("accuracy", rows, device=device, model=display_path(args.model),
                           kvpop_model=display_path(student) if student else None,
                           kvpop_teacher_matches=None if student is None else mismatch is None, context=args.context,
                           split=args.split, protocol=args.protocol, wall_seconds=round(wall, 1))
    print(f"wrote {write_results(args.out, results)}")
    title = (DEMO_KVPOP_TITLE if student else DEMO_TITLE).format(context=args.context)
    if mismatch:
        title += DEMO_OTHER_TEACHER
    print(f"wrote {plot_accuracy(rows, args.plot, title=title)}")
    print(f"wall time {wall:.0f} s")
    return 0


def cmd_methods(args) -> int:
    from .methods import describe

    print("\n".join(describe()))
    return 0


def _family_weights(text: str):
    """``--family-weights``: ``adaptive`` / ``uniform``; ``'a,b,c,d'`` -> one tuple; ``'a,b,c,d;...'`` -> one tuple per
    stage."""
    from .train.pretrain import FAMILY_WEIGHT_MODES

    if text in FAMILY_WEIGHT_MODES:
        return text
    try:
        groups = [tuple(float(w) for w in g.split(",")) for g in text.split(";")]
    except ValueError:
        raise KVLearnError(f"--family-weights {text!r}: expected 'adaptive', 'uniform', or comma lists of numbers, "
                           "separated by ';' per stage") from None
    return tuple(groups) if ";" in text else groups[0]


def _number_list(text: str, option: str, kind: type, expected: str) -> tuple:
    """``--stages`` / ``--stage-fractions``: a comma list of ``kind`` (int or float); a one-line error otherwise."""
    try:
        return tuple(kind(t) for t in text.split(","))
    except ValueError:
        raise KVLearnError(f"{option} {text!r} is invalid: expected {expected}") from None


def cmd_pretrain(args) -> int:
    from .train.pretrain import PretrainConfig, pretrain

    config = PretrainConfig(**({"out": args.out} if args.out else {}), overwrite=args.overwrite, minutes=args.minutes, steps=args.steps, device=_device(args.device), seed=args.seed,
                            resume=args.resume, num_workers=args.num_workers, eval_n=args.eval_n,
                            tokens_per_step=args.tokens_per_step, lr=args.lr, dense_fraction=args.dense_fraction,
                            **({"stages": _number_list(args.stages, "--stages", int, "a comma list of example "
                                                       "lengths, e.g. 256,512,1024,2048,4096")} if args.stages else {}),
                            **({"stage_fractions": _number_list(args.stage_fractions, "--stage-fractions", float,
                                                                "a comma list of time fractions summing to 1, e.g. "
                                                                "0.06,0.08,0.12,0.24,0.5")}
                               if args.stage_fractions else {}),
                            **({"warmup_steps": args.warmup_steps} if args.warmup_steps is not None else {}),
                            **({"family_weights": _family_weights(args.family_weights)} if args.family_weights else {}),
                            **({"train_styles": tuple(args.train_styles.split(","))} if args.train_styles else {}),
                            **({"train_regimes": tuple(args.train_regimes.split(","))} if args.train_regimes else {}),
                            **({"plain_stages": args.plain_stages} if args.plain_stages is not None else {}),
                            **({"multivalue_from": args.multivalue_from} if args.multivalue_from is not None else {}),
                            **({"num_layers": args.num_layers} if args.num_layers is not None else {}))
    pretrain(config)
    return 0


RETROFIT_METHODS = ("kvpop", "streaming_plus", "dms")


# retrofit options read by some methods only: option -> (dest, the methods that read it)
METHOD_OPTIONS = {"--window": ("window", ("kvpop", "dms")), "--scorer": ("scorer", ("kvpop",)),
                  "--decay-init": ("decay_init", ("kvpop",)), "--lr-decay": ("lr_decay", ("kvpop",)),
                  "--target-reduction": ("target_reduction", ("kvpop",)),
                  "--target-count-normalize": ("target_count_normalize", ("kvpop",)),
                  "--target-aggregation": ("target_aggregation", ("kvpop",)),
                  "--target-cr": ("target_cr", ("dms",)), "--gate-hidden": ("gate_hidden", ("dms",)),
                  "--compression-weight": ("compression_weight", ("dms",)),
                  "--compression-scope": ("compression_scope", ("dms",))}


def ignored_retrofit_options(args, defaults: dict) -> list[str]:
    """The ``--option value`` pairs set away from their default (``defaults``: dest -> default) that ``args.method``
    does not read. Warned about, not refused: the Table 1 chain passes ``--window`` to every method on purpose."""
    return [f"{flag} {getattr(args, dest)}" for flag, (dest, methods) in METHOD_OPTIONS.items()
            if args.method not in methods and getattr(args, dest) != defaults.get(dest)]


def cmd_retrofit(args) -> int:
    from .config import DMSConfig, KVpopConfig, StreamingConfig, retrofit_window
    from .train.distill import RetrofitConfig, retrofit

    check(args.method in RETROFIT_METHODS,
          f"--method {args.method!r} is unknown: expected one of {', '.join(RETROFIT_METHODS)}")
    check(args.steps is None or args.minutes is None, "--steps and --minutes exclude each other: give one of them")
    ignored = ignored_retrofit_options(args, args.option_defaults)
    if ignored:
        print(f"warning: {', '.join(ignored)}: not read by --method {args.method} (ignored)", file=sys.stderr)
    mlstm_only = [f"{flag} {value}" for flag, value in (("--mlstm-skip", args.mlstm_skip), ("--readout", args.readout),
                                                      ("--state-in-budget", args.state_in_budget),
                                                      ("--mlstm-compile-mode", args.mlstm_compile_mode),
                                                      ("--mlstm-use-norm", args.mlstm_use_norm),
                                                      ("--mlstm-chunk-size", args.mlstm_chunk_size),
                                                      ("--mlstm-value-dim", args.mlstm_value_dim),
                                                      ("--mlstm-gate-softcap", args.mlstm_gate_softcap))
                  if value is not None]
    check(not mlstm_only or (args.method == "kvpop" and args.scorer == "mlstm"),
          f"{', '.join(mlstm_only)}: options of the mLSTM scorer, given with --method {args.method} --scorer "
          f"{args.scorer}: expected --method kvpop --scorer mlstm")
    method_kw = {}
    if args.method == "streaming_plus":  # the window is budget - sinks
        check_int("--budget", args.budget, args.sinks + 1,
                  hint=f" (StreamingLLM+ keeps sinks={args.sinks} and a window of budget - sinks >= 1)")
        method_kw["streaming"] = StreamingConfig(budget=args.budget, sinks=args.sinks)
        kvpop = KVpopConfig(scorer=args.scorer)
    else:
        window = retrofit_window(args.budget) if args.window is None else args.window
        check_int("--budget", args.budget, args.sinks + window + 1,
                  hint=f" ({args.method} needs sinks={args.sinks} + window={window} and at least one long-range slot)")
        kvpop = (KVpopConfig(sinks=args.sinks, window=window, topk=args.budget - args.sinks - window,
                             scorer=args.scorer, decay_init=args.decay_init, **_target_options(args))
                 if args.method == "kvpop" else KVpopConfig(scorer=args.scorer))
    if args.method == "dms":
        scope = dms_compression_scope(args)
        # the model scope's closed fraction is the budget's share of the context (the paper's compression ratio); the
        # head scope holds each head to its own long-range slots, so its default is the context over those
        slots = args.budget if scope == "model" else args.budget - args.sinks - window
        target_cr = args.target_cr if args.target_cr is not None else args.seq_len / slots
        method_kw["dms"] = DMSConfig(sinks=args.sinks, window=window, budget=args.budget,
                                     gate_hidden=args.gate_hidden, target_cr=target_cr,
                                     compression_scope=scope)
        method_kw["compression_weight"] = args.compression_weight
    if args.kv_bits is not None:
        try:
            bits = tuple(b.strip() if b.strip() == "share" else int(b) for b in args.kv_bits.split(","))
        except ValueError:
            raise KVLearnError(f"--kv-bits {args.kv_bits!r}: expected a bit-width (2, 4, 8 or 16) or a comma list of "
                               "one per layer, where a later layer may be 'share'") from None
        method_kw["kv_bits"] = bits[0] if len(bits) == 1 else bits
    if args.init_student is not None:
        method_kw["init_student"] = args.init_student
    if args.init_backbone is not None:
        method_kw["init_backbone"] = args.init_backbone
    if args.freeze_backbone:
        method_kw["freeze_backbone"] = True
    if args.readout_penalty is not None:
        method_kw["readout_penalty"] = args.readout_penalty
    for name in ("scorer_kd", "scorer_kd_temperature", "scorer_kd_queries"):  # RetrofitConfig checks them together
        if getattr(args, name) is not None:
            method_kw[name] = getattr(args, name)
    if args.scorer_kd_compile:
        method_kw["scorer_kd_compile"] = True
    if args.cuda_graph_step:
        method_kw["cuda_graph_step"] = True
    length = ({"minutes": args.minutes, "steps": None} if args.minutes is not None  # --steps 0 is refused, not 1000
              else {"steps": 1000 if args.steps is None else args.steps})
    config = RetrofitConfig(model=args.model, out=args.out, overwrite=args.overwrite, resume=args.resume,
                            kvpop=kvpop, batch_size=args.batch_size, seq_len=args.seq_len,
                            **({"lr": args.lr} if args.lr is not None else {}),
                            lr_new=args.lr_new, lr_decay=args.lr_decay, warmup_steps=args.warmup_steps,
                            grad_clip=args.grad_clip, kd_topk=args.kd_topk, boundary_weight=args.boundary_weight,
                            dense_fraction=args.dense_fraction,
                            family_weights=_mixture_weights(args.family_weights),
                            save_interval=args.save_interval, seed=args.seed, device=_device(args.device),
                            num_workers=args.num_workers, method=args.method, **method_kw, **length)
    set_threads(args.threads)
    result = retrofit(config)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun: once
        print(f"wrote {result['final']} (step {result['step']}); evaluate it with: kvlearn eval --model "
              f"{result['final']} --method {args.method} --budget {args.budget}")
    return 0


def dms_compression_scope(args) -> str:
    """``--compression-scope``, or its default: with ``--resume``, the scope the newest checkpoint of ``--out`` trained
    with (``model`` for one saved before the option existed, which is what it did); otherwise ``head``, each KV head
    held to the budget's long-range slots (since session 48: the model scope's per-head cap cost one draw 0.57 of its
    accuracy at budget 1024, docs/DESIGN.md section 9)."""
    if args.compression_scope is not None:
        return args.compression_scope
    if args.resume:
        from .train.distill import STATE_FILE, latest_checkpoint

        last = latest_checkpoint(args.out)
        if last is not None:  # the trainer state is what a resume is checked against; mmap: the optimizer is not read
            import torch

            state = torch.load(last / STATE_FILE, map_location="cpu", weights_only=False, mmap=True)
            dms = state.get("config", {}).get("dms")
            if isinstance(dms, dict):
                return dms.get("compression_scope", "model")
    return "head"


def _target_options(args) -> dict:
    """The KVpop target, mLSTM-skip, readout, state-in-budget, compile-mode and other mLSTM options given on the retrofit
    command line (the rest keep KVpopConfig's defaults)."""
    given = {"target_aggregation": args.target_aggregation, "target_reduction": args.target_reduction,
             "target_count_normalize": None if args.target_count_normalize is None else args.target_count_normalize == "1",
             "mlstm_skip": None if args.mlstm_skip is None else args.mlstm_skip == "1",
             "delayed_readout": None if args.readout is None else args.readout == "delayed",
             "state_in_budget": None if args.state_in_budget is None else args.state_in_budget == "1",
             "mlstm_compile_mode": args.mlstm_compile_mode,
             "mlstm_use_norm": None if args.mlstm_use_norm is None else args.mlstm_use_norm == "1",
             "mlstm_chunk_size": args.mlstm_chunk_size, "mlstm_value_dim": args.mlstm_value_dim}
    options = {k: v for k, v in given.items() if v is not None}
    if args.mlstm_gate_softcap is not None:  # "none" (no cap) is a value, so it is added after the filter
        options["mlstm_gate_softcap"] = _gate_softcap(args.mlstm_gate_softcap)
    return options


def _gate_softcap(text: str) -> float | None:
    """``--mlstm-gate-softcap``: ``none`` (no cap) or a number (KVpopConfig checks that it is > 0)."""
    if text.strip().lower() == "none":
        return None
    try:
        return float(text)
    except ValueError:
        raise KVLearnError(f"--mlstm-gate-softcap {text!r} is invalid: expected a number > 0 or none") from None


def cmd_reproduce(args) -> int:
    from .eval.reproduce import ReproduceConfig, merge_folder, reproduce_kvpop

    if args.merge_only:  # nothing runs, so no device is needed
        check(not args.overwrite, "--merge-only and --overwrite exclude each other: --merge-only runs nothing and "
                                  "keeps every table the folder holds")
        print(f"wrote {merge_folder(args.out)}")
        return 0

    try:  # ReproduceConfig checks each budget's range
        budgets = tuple(int(part) for part in args.budgets.split(","))
    except ValueError:
        raise KVLearnError(f"--budgets {args.budgets!r} is invalid: expected a comma list of integers") from None
    config = ReproduceConfig(out=args.out, budgets=budgets, minutes=args.minutes, steps=args.steps,
                             n_per_task=args.n_per_task, students=tuple(args.students.split(",")),
                             device=_device(args.device), model=args.model, retrofit_args=args.retrofit_args,
                             table_args=args.table_args, overwrite=args.overwrite, resume=args.resume,
                             context_rows=args.context_rows, dms_scope=args.dms_scope)
    print(f"wrote {reproduce_kvpop(config)}")
    return 0


def parse_targets(text: str, flag: str = "--target") -> tuple[float, ...]:
    """A compression factor or a comma list of them (``"4"``, ``"1,2,4"``) -> floats > 0; a one-line error naming
    ``flag`` otherwise."""
    try:
        targets = tuple(float(t) for t in text.split(","))
    except ValueError:
        targets = ()
    check(len(targets) > 0 and all(t > 0 for t in targets),
          f"{flag} {text!r} is invalid: expected a compression factor > 0 or a comma list, e.g. 4 or 1,2,4")
    return targets


def parse_share_layers(text: str):
    """``--share-layers``: ``all`` (None: every layer but 0), ``auto`` (the sensitivity pass) or a comma list of layer
    indices (``6,7``; an empty string: no layer shares); a one-line error otherwise."""
    if text in ("all", "auto"):
        return None if text == "all" else "auto"
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise KVLearnError(f"--share-layers {text!r} is invalid: expected all, auto or a comma list of layer "
                           "indices >= 1, e.g. 6,7") from None


def _mixture_weights(text: str | None):
    """``kaizen-train`` / ``retrofit --family-weights 'a,b,c,d'`` -> a tuple of floats (``None`` when not given)."""
    if text is None:
        return None
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise KVLearnError(f"--family-weights {text!r}: expected a comma list of 4 numbers (trace,niah,vt,recall), "
                           "e.g. 2,1,1,1") from None


def cmd_kaizen_train(args) -> int:
    from .train.kaizen_recipes import FIRST_STAGE, SECOND_STAGE, kaizen_recipe
    from .train.kaizen_train import KaizenTrainConfig, kaizen_train

    check(args.steps is None or args.minutes is None, "--steps and --minutes exclude each other: give one of them")
    recipe = kaizen_recipe(args.recipe) if args.recipe else {}
    check(args.recipe not in FIRST_STAGE or args.init_student is not None,
          f"--recipe {args.recipe} continues a trained selector: give --init-student FOLDER (the final/ of a "
          f"--recipe {FIRST_STAGE.get(args.recipe)} run, or its export) and another --seed than that run's")
    # the fields the command line gave (None: left out); the recipe fills the ones left out, and KaizenTrainConfig's
    # defaults the rest (--share-layers all is given: None there means every layer)
    given = {"targets": None if args.target is None else parse_targets(args.target),
             "dense_fraction": args.dense_fraction, "underuse_weight": args.underuse_weight,
             "share_threshold": args.share_threshold, "lr": args.lr, "ema_decay": args.ema_decay,
             "family_weights": _mixture_weights(args.family_weights), "tau_start": args.tau_start,
             "steps": args.steps}
    fields = {k: v for k, v in given.items() if v is not None}
    if args.share_layers is not None:
        fields["share_layers"] = parse_share_layers(args.share_layers)
    if args.minutes is not None:  # --minutes replaces the recipe's steps
        fields.update(minutes=args.minutes, steps=None)
    fields.update({k: v for k, v in recipe.items() if k not in fields
                   # the recipe's threshold belongs to its sensitivity pass, not to a --share-layers given instead
                   and not (k == "share_threshold" and fields.get("share_layers", "auto") != "auto")})
    share_layers = args.share_layers or ("auto" if fields.get("share_layers") == "auto" else "all")
    selection = [f"--{k.replace('_', '-')} {v}" for k, v in (("select_n", args.select_n),
                                                              ("select_from", args.select_from)) if v is not None]
    check(not selection or args.select_every, f"{', '.join(selection)}: options of checkpoint selection, read only "
                                              "with --select-every N (N >= 1): give it, or leave them out")
    check(args.ema_from is None or fields.get("ema_decay"),
          f"--ema-from {args.ema_from}: an option of weight averaging, read only with --ema-decay D (0 < D < 1): give "
          "it, or leave it out")
    for name, value in (("--share-threshold", fields.get("share_threshold")), ("--share-rows", args.share_rows),
                        ("--share-seed", args.share_seed)):
        check(value is None or share_layers == "auto",
              f"{name} {value} is read only by the sensitivity pass: expected --share-layers auto with it (got "
              f"--share-layers {share_layers})")
    axes = tuple(a.strip() for a in args.axes.split(",")) if args.axes else None
    config = KaizenTrainConfig(model=args.model, out=args.out, overwrite=args.overwrite, resume=args.resume,
                               axes=axes, batch_size=args.batch_size, seq_len=args.seq_len,
                               lr_schedule=args.lr_schedule, lr_new=args.lr_new,
                               warmup_steps=args.warmup_steps, grad_clip=args.grad_clip, kd_topk=args.kd_topk,
                               beta=args.beta, eta=args.eta, budget_cap=args.budget_cap,
                               penalty_cost=args.penalty_cost, budget_scope=args.budget_scope,
                               target_head=None if args.target_head is None else args.target_head == "1",
                               **({} if args.share_rows is None else {"share_rows": args.share_rows}),
                               **({} if args.share_seed is None else {"share_seed": args.share_seed}),
                               select_every=args.select_every,
                               **{k: v for k, v in (("select_n", args.select_n), ("select_from", args.select_from),
                                                    ("ema_from", args.ema_from), ("tau_end", args.tau_end))
                                  if v is not None},
                               init_student=args.init_student,
                               save_interval=args.save_interval, seed=args.seed, device=_device(args.device),
                               num_workers=args.num_workers, **fields)
    set_threads(args.threads)
    result = kaizen_train(config)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun: once
        print(kaizen_final_message(result, config.targets[0], config.select_n))
        follow_up = SECOND_STAGE.get(args.recipe)
        if follow_up:  # a recipe whose record trains on in a second stage says how
            print(f"the recipe's second stage: kvlearn kaizen-train --recipe {follow_up} --init-student "
                  f"{result['final']} --seed {config.seed + 1} --model {config.model} --out {config.out}-refined "
                  f"--device {args.device}")
    return 0


def kaizen_final_message(result: dict, target: float, select_n: int) -> str:
    """What ``kaizen-train`` prints at the end: where ``final/`` is, which step's weights it holds under checkpoint
    selection (with the caveat that the picked validation overrates it), and the command that evaluates it."""
    holds = f"step {result['step']}"
    if result.get("averaged_since") is not None:
        holds = f"trained {result['step']} steps; holds the average of its weights from step {result['averaged_since']} on"
    selected = result.get("selected")
    if selected is not None:
        holds = (f"trained {result['step']} steps; holds step {selected['step']}, whose validation read "
                 f"{selected['accuracy']:.3f} on {select_n} prompts per family: the best of several small draws, so "
                 "expect the evaluation to read lower")
    return (f"wrote {result['final']} ({holds}); evaluate it with: kvlearn eval --model {result['final']} "
            f"--method kaizen --target {target}")


def cmd_convert_mla(args) -> int:
    import torch

    from .checkpoint import load
    from .hf import copy_tokenizer_files, read_model_config
    from .kaizen.mla import check_rank, check_rope_dim, convert_to_mla
    from .testbed.data import training_batch
    from .testbed.tasks import MAX_LENGTH, MIN_LENGTH
    from .testbed.tokenizer import VOCAB_SIZE

    config = read_model_config(args.model)  # one-line error for a missing folder or an unsupported family
    check(config.vocab_size >= VOCAB_SIZE, f"--model {args.model!r} has a vocabulary of {config.vocab_size} tokens: "
          f"calibration uses testbed examples, which need >= {VOCAB_SIZE} (a testbed model)")
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    check_rope_dim(args.rope_dim, kv, head_dim)  # before loading anything
    if args.rank is not None:
        check_rank(args.rank, kv, head_dim)
    check_int("--calibration-examples", args.calibration_examples, 1, 4096)
    limit = min(MAX_LENGTH, getattr(config, "max_position_embeddings", MAX_LENGTH) or MAX_LENGTH)
    check_int("--calibration-length", args.calibration_length, MIN_LENGTH, limit)
    out = Path(args.out)
    check_output_folder(out, "--out")
    check(args.overwrite or not out.exists() or not any(out.iterdir()),
          f"--out {args.out!r} already holds files: pass --overwrite to replace them, or choose a new folder")
    set_threads(args.threads)
    model = load(args.model, dtype=torch.float32, device=_device(args.device))
    ids, _ = training_batch(args.calibration_examples, args.calibration_length, args.seed, dense=False)
    convert_to_mla(model, args.rope_dim, ids.to(next(model.parameters()).device), rank=args.rank, variant=args.variant)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    copy_tokenizer_files(args.model, out)
    print(f"wrote {out}: MLA with latent width {model.config.kv_lora_rank} and RoPE key width {args.rope_dim}; "
          f"train its selector with: kvlearn kaizen-train --model {out} --axes precision,rank")
    return 0


def cmd_testbed(args) -> int:
    from .testbed import tasks
    from .testbed.tokenizer import build_tokenizer

    tok = build_tokenizer()
    ex = tasks.generate(args.family, tasks.example_seed(args.family, args.split, args.index), args.length,
                        variant=args.variant, dense=args.dense)
    print(f"# {ex.family}/{ex.variant}  prompt {len(ex.prompt_ids)} tokens, answer {len(ex.answer_ids)} tokens, "
          f"style {ex.style}, regime {ex.regime}" + (", training format: [[supervised]]" if args.dense else ""))
    if args.dense:  # the in-context answers training supervises, between [[ and ]]
        words, inside = [], False
        for t, supervised in zip(ex.prompt_ids + [None], ex.loss_mask_prompt + [False]):
            if supervised != inside:  # a supervised span opens or closes here
                words.append("[[" if supervised else "]]")
                inside = supervised
            if t is not None:
                words.append(tok.decode([t]))
        print(" ".join(words))
    else:
        print(tok.decode(ex.prompt_ids))
    print("# answer:")
    print(tok.decode(ex.answer_ids))
    return 0


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help with its default, except where the default says nothing: required options (none), an
    unset default (``None``: the help says what happens then, e.g. "default: the method's") and an off flag."""

    def _get_help_string(self, action):
        unset = action.default is None or (action.nargs == 0 and action.default is False)
        return action.help if action.required or unset else super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """argparse with kvlearn's one-line errors (``kvlearn: error: ...``, exit status 2) and defaults in the help."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"kvlearn: error: {message.splitlines()[0]} (see: {self.prog} --help)\n")


def add_trainer_options(sp, existing: str, new: str, existing_schedule: str = "constant", lr_default: str = "",
                        dense_fraction_default: float | None = 0.75) -> None:
    """The options ``kvlearn retrofit`` and ``kvlearn kaizen-train`` share: length, batch, the two learning rates
    (``existing`` weights at a constant rate, ``new`` ones warmed up), clipping, distillation, checkpoints, plumbing.
    ``--lr`` defaults to None: the trainer's config holds the default (``lr_default`` names it in the help), and so
    does ``--dense-fraction`` where ``dense_fraction_default`` is None (kaizen-train, whose ``--recipe`` may set it)."""
    sp.add_argument("--steps", type=int, default=None, help="optimizer steps (1000 when neither this nor --minutes)")
    sp.add_argument("--minutes", type=float, default=None, help="wall-clock budget instead of --steps")
    sp.add_argument("--batch-size", type=int, default=8, help="sequences per step")
    sp.add_argument("--seq-len", type=int, default=4096, help="tokens per training sequence (testbed examples)")
    sp.add_argument("--lr", type=float, default=None,
                    help=f"learning rate of {existing} ({existing_schedule}; default: {lr_default})")
    sp.add_argument("--lr-new", type=float, default=1e-3, help=f"peak learning rate of {new}")
    sp.add_argument("--warmup-steps", type=int, default=100, help=f"warm-up steps of the learning rate of {new}")
    sp.add_argument("--grad-clip", type=float, default=1.0, help="gradient-norm clip")
    sp.add_argument("--kd-topk", type=int, default=256, help="teacher logits kept by the distillation loss")
    sp.add_argument("--dense-fraction", type=float, default=dense_fraction_default,
                    help="share of training rows in the dense format (in-context Q/A pairs); the rest are in the "
                         "evaluation format, one supervised answer each (default 0.75)")
    sp.add_argument("--family-weights", default=None,
                    help="sampling weights of the training rows' families, trace,niah,vt,recall (e.g. 2,1,1,1: twice "
                         "the trace rows; default: uniform)")
    sp.add_argument("--save-interval", type=int, default=200, help="steps between checkpoints")
    sp.add_argument("--seed", type=int, default=0, help="random seed (data and sampling)")
    sp.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    sp.add_argument("--num-workers", type=int, default=None,
                    help="data-generation worker processes (default: 3 on a CUDA device, at most the CPU cores less one "
                         "shared among torchrun's processes on the host; 0 on the CPU; the batches are the same for any "
                         "number)")
    sp.add_argument("--threads", type=thread_count, default=0, help=THREADS_HELP)


def add_eval_options(sp, n_default: int, batch_default: int, threads_default: int = 0) -> None:
    """The evaluation options ``kvlearn demo`` and ``kvlearn eval`` share (model, tasks, examples, context, protocol,
    batching, device), with each command's defaults."""
    from .eval.accuracy import eval_splits
    from .eval.protocols import DEFAULT_PREFILL_CHUNK
    from .methods import PROTOCOLS
    from .testbed import tasks

    sp.add_argument("--model", default=default_model_path(), help="checkpoint folder ($KVLEARN_MODEL overrides the default)")
    sp.add_argument("--tasks", default="all", help=f"comma list of {','.join(tasks.FAMILIES)} or 'all'")
    sp.add_argument("--n-per-task", type=int, default=n_default, help="examples per task family")
    sp.add_argument("--context", type=int, default=4096,
                    help=f"tokens per example, prompt + answer (at most {tasks.MAX_LENGTH} and the model's max_position_embeddings)")
    sp.add_argument("--sinks", type=int, default=4, help="first tokens every compressing method keeps")
    sp.add_argument("--split", default="eval", choices=eval_splits(), help="testbed split the examples are drawn from")
    sp.add_argument("--protocol", default="bounded", choices=PROTOCOLS,
                    help="bounded: the whole prompt goes through the bounded cache; context: everything before the "
                         "final question is prefilled densely and compressed once (kvpress)")
    sp.add_argument("--chunk-size", type=int, default=DEFAULT_PREFILL_CHUNK, help="prefill chunk of the bounded cache")
    sp.add_argument("--batch-size", type=int, default=batch_default, help="examples per batch (left-padded)")
    sp.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    sp.add_argument("--threads", type=thread_count, default=threads_default, help=THREADS_HELP)


def add_demo_parser(sub) -> None:
    """``kvlearn demo``'s options."""
    sp = sub.add_parser("demo", help="embedded teacher: full cache vs a sinks+window cache, and its KVpop student, "
                                     "alone and in 4-bit KV-Kaizen stores, on every family")
    add_eval_options(sp, DEMO_N_PER_TASK, DEMO_BATCH_SIZE, DEMO_THREADS)
    sp.add_argument("--budget", type=int, default=1024,
                    help="tokens the streaming and KVpop caches keep (CR = 1 - budget/context)")
    sp.add_argument("--kvpop-model", default=default_kvpop_model_path(),
                    help="KVpop student evaluated with methods kvpop and kaizen+kvpop (4-bit stores) at --budget, "
                         "or 'none' to leave it out "
                         "($KVLEARN_KVPOP_MODEL overrides the default)")
    sp.add_argument("--out", default="runs/demo/demo.json", help="results file (runs/ is not tracked by git)")
    sp.add_argument("--plot", default="runs/demo/demo.png", help="plot file")
    sp.set_defaults(func=cmd_demo)


def add_eval_parser(sub) -> None:
    """``kvlearn eval``'s options."""
    from .config import DMS_OVERFLOW_ORDERS
    from .methods import method_names

    sp = sub.add_parser("eval", help="accuracy of one method on the testbed")
    add_eval_options(sp, 10, 8)
    sp.add_argument("--method", required=True, choices=method_names(), help="cache method (see: kvlearn methods)")
    sp.add_argument("--budget", type=int, default=None, help="tokens kept per KV head (every method but dense and the kaizen ones; "
                         "kaizen+snapkv and kaizen+kvpop take both --budget and --target)")
    sp.add_argument("--window", type=int, default=None,
                    help="recent tokens always kept, for methods with a window (kvpop, dms); the rest of the budget "
                         "is ranked (default: the method's)")
    sp.add_argument("--dms-overflow", default=None, choices=DMS_OVERFLOW_ORDERS,
                    help="dms: which kept token a full budget evicts: the highest eviction logit (the default), the "
                         "oldest kept one or the newest (a serving rule; recorded in each row's options)")
    sp.add_argument("--target", type=float, default=None,
                    help="kaizen and its baselines (kaizen_static, kaizen_random, kaizen_dp): target compression "
                         "factor (kaizen's default: the one it was trained for); kaizen+snapkv, kaizen+kvpop: the "
                         "total factor, representation x context/budget")
    sp.add_argument("--configuration", default=None, metavar="ACTIONS",
                    help="kaizen_static: one per-layer configuration instead of the uniform choice, e.g. 'b4 b4 share "
                         "b4' (b<bits> or share per layer, layer 0 never shares); --target then defaults to its "
                         "compression and may not exceed it")
    sp.add_argument("--kvpop-scorers", default=None, metavar="PATH",
                    help="kvpop, kaizen+kvpop: a KVpop checkpoint whose scorers and decays go onto --model (same base "
                         "shape), evaluated under its trained fields; e.g. a kaizen-train folder as --model with "
                         "checkpoints/testbed-kvpop here: the trained selector's choice under the student's eviction")
    sp.add_argument("--out", default=None, help="results file (.json); nothing is written without it")
    sp.add_argument("--plot", default=None, help=f"plot file ({', '.join(PLOT_SUFFIXES)}); needs --out")
    sp.set_defaults(func=cmd_eval)


def add_methods_parser(sub) -> None:
    """``kvlearn methods``'s options."""
    sp = sub.add_parser("methods", help="list the registered cache methods: name, protocols, summary")
    sp.set_defaults(func=cmd_methods)


def add_pretrain_parser(sub) -> None:
    """``kvlearn pretrain``'s options."""
    from .testbed import tasks
    from .testbed.filler import TRAIN_STYLES

    sp = sub.add_parser("pretrain", help="train the testbed teacher from scratch (GPU)")
    sp.add_argument("--out", default=None, help="checkpoint folder (default: a new runs/testbed-teacher-<UTC time>)")
    sp.add_argument("--overwrite", action="store_true", help="allow an --out folder that already holds files")
    sp.add_argument("--minutes", type=float, default=18.0, help="wall-clock training budget")
    sp.add_argument("--steps", type=int, default=None,
                    help="a budget of optimizer steps instead of --minutes: the curriculum stages and the learning rate "
                         "follow the share of steps done (e.g. a smaller model on the teacher's 9,162 steps)")
    sp.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    sp.add_argument("--seed", type=int, default=0, help="random seed")
    sp.add_argument("--resume", default=None, help="checkpoint folder to start from instead of a fresh model")
    sp.add_argument("--num-workers", type=int, default=6, help="data-generation worker processes")
    sp.add_argument("--eval-n", type=int, default=64, help="examples per family and split in each stage check")
    sp.add_argument("--tokens-per-step", type=int, default=131072, help="tokens per optimizer step")
    sp.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    sp.add_argument("--warmup-steps", type=int, default=None, help="warm-up steps (None: the recipe's default)")
    sp.add_argument("--dense-fraction", type=float, default=0.75,
                    help="share of training rows with in-context question/answer pairs (the rest: evaluation format)")
    sp.add_argument("--stages", default=None, help="comma list of example lengths, e.g. 256,512,1024,2048,4096")
    sp.add_argument("--stage-fractions", default=None, help="comma list of time fractions, summing to 1")
    sp.add_argument("--family-weights", default=None,
                    help="'adaptive' (default: after each stage check, family f gets weight 1.25 - its eval accuracy), "
                         "'uniform', a comma list of sampling weights for trace,niah,vt,recall, or one such list per "
                         "stage, separated by ';' (e.g. '3,1,1,1;3,1,1,1;1,1,1,1;1,1,1,1;1,1,1,1')")
    sp.add_argument("--train-styles", default=None,
                    help=f"narrow the training haystack to these styles (comma list of {','.join(TRAIN_STYLES)}; default all)")
    sp.add_argument("--train-regimes", default=None,
                    help=f"narrow the training depth regimes (comma list of {','.join(tasks.TRAIN_REGIMES)}; default all)")
    sp.add_argument("--plain-stages", type=int, default=None,
                    help="the first N curriculum stages train on the plain haystack only (svo grammar, uniform depths); "
                         "(default 0: every stage on the varied haystacks, the shipped teacher's recipe)")
    sp.add_argument("--num-layers", type=int, default=None,
                    help="decoder layers (default 8, the shipped teacher's); fewer make the smaller uncompressed "
                         "model of the KV-Kaizen table (benchmarks/kaizen_table.py --smaller-model)")
    sp.add_argument("--multivalue-from", type=int, default=None, metavar="LENGTH",
                    help=f"from the curriculum stage of this example length on, a share {tasks.MULTIVALUE_PROBE_SHARE:g} of "
                         "the dense rows' niah probes give their key 2-4 needles, answered in document order (default: "
                         "never, the shipped teacher's recipe)")
    sp.set_defaults(func=cmd_pretrain)


def add_retrofit_parser(sub) -> None:
    """``kvlearn retrofit``'s options."""
    sp = sub.add_parser("retrofit", help="distil a trained cache method into a model (teacher: the dense model): KVpop's "
                                         "scorers and decays, StreamingLLM+ or DMS gates")
    sp.add_argument("--model", required=True, help="checkpoint folder of the dense model (a supported family)")
    sp.add_argument("--out", required=True, help="output folder: step-<N>/ checkpoints, final/, train_log.jsonl")
    sp.add_argument("--overwrite", action="store_true", help="allow an --out folder that already holds files")
    sp.add_argument("--resume", action="store_true", help="continue from the newest step-<N> checkpoint in --out")
    sp.add_argument("--method", default="kvpop", choices=RETROFIT_METHODS,
                    help="kvpop (learned scorers), streaming_plus (KD under the sinks + window mask, no new modules) "
                         "or dms (learned eviction gates, KD + compression hinge)")
    sp.add_argument("--target-cr", type=float, default=None,
                    help="dms: final compression ratio of the ramped target (default: seq-len / (budget - sinks - "
                         "window), the long-range slots, under the head scope; seq-len / budget with "
                         "--compression-scope model)")
    sp.add_argument("--gate-hidden", type=int, default=0,
                    help="dms: width of the gate MLP (0: the reference Linear(hidden, kv_heads) gate)")
    sp.add_argument("--compression-weight", type=float, default=1.0, help="dms: weight of the compression hinge")
    sp.add_argument("--compression-scope", default=None, choices=("model", "head"),
                    help="dms: what the hinge holds to the target: each layer's KV head on its own (head, the default: "
                         "what a budget per KV head asks) or the closed fraction over the whole model (model, the "
                         "reference's; heads may then differ, and a head that keeps more than its slots loses keys to "
                         "the cap); --resume without it continues the checkpoint's scope")
    sp.add_argument("--scorer", default="mlp", choices=("linear", "mlp", "mlstm"),
                    help="KVpop scorer (mlstm: the paper's stateful scorer with the delayed readout)")
    sp.add_argument("--mlstm-skip", default=None, choices=("0", "1"),
                    help="kvpop, --scorer mlstm: 1 adds the skip connection from the scored token to the score (an MLP "
                         "of its key and value; the paper's appendix E.5 variant, docs/DESIGN.md section 5), 0 leaves the "
                         "paper's plain delayed readout (default: KVpopConfig's, 1)")
    sp.add_argument("--readout", default=None, choices=("delayed", "immediate"),
                    help="kvpop, --scorer mlstm: score token u from the state at u + window (delayed, the paper's) or at "
                         "u itself (immediate; the paper's readout ablation) (default: KVpopConfig's, delayed)")
    sp.add_argument("--kv-bits", default=None,
                    help="kvpop: attend keys and values quantized to these bits (2, 4, 8 or 16; one, or a comma list of one "
                         "per layer, where a later layer may be 'share': it reads the nearest earlier layer's keys and "
                         "values under that layer's retention) with straight-through gradients, the scorers reading "
                         "them in full precision (a delayed mLSTM readout: their stored form, as the cache), so that the student serves under kaizen+kvpop in that configuration "
                         "(default: unquantized)")
    sp.add_argument("--init-student", default=None, metavar="FOLDER",
                    help="kvpop: start from this trained KVpop student (the final/ folder of a retrofit with the same "
                         "teacher and scorer) instead of fresh scorers on the teacher's weights; --model stays the "
                         "teacher. E.g. a full-precision student refined under --kv-bits 4 (default: none)")
    sp.add_argument("--init-backbone", default=None, metavar="FOLDER",
                    help="start the student's backbone from this model folder of the teacher's shape (e.g. the final/ "
                         "of a kaizen-train run, whose backbone adapted to its configuration), the added modules "
                         "fresh; --model stays the teacher (default: the teacher's weights)")
    sp.add_argument("--freeze-backbone", action="store_true",
                    help="kvpop: train only the scorers and decays (the boundary loss), the backbone staying as built: "
                         "a scorer-only refit, e.g. of a trained student's scorers on its own backbone with "
                         "--init-student (one process only)")
    sp.add_argument("--readout-penalty", type=float, default=None, metavar="WEIGHT",
                    help="kvpop, --scorer mlstm: add WEIGHT x the mean squared norm of the memory readout's weights to "
                         "the loss, holding the score near its skip path's (Table 1's mLSTM recipe: 30; default 0: off)")
    sp.add_argument("--scorer-kd", type=float, default=None, metavar="WEIGHT",
                    help="kvpop: also train the scorers and decays through the distillation loss, by a straight-through "
                         "soft retention on sampled query rows (the forward unchanged), at WEIGHT (1: an unbiased "
                         "estimate of every evicting row's gradient; default 0: off, the boundary loss alone; "
                         "docs/DESIGN.md section 5, 'Scorers through the distillation loss')")
    sp.add_argument("--scorer-kd-temperature", type=float, default=None, metavar="TAU",
                    help="kvpop, --scorer-kd: temperature of the soft retention log sigmoid((priority - cutoff) / TAU) "
                         "(default 1)")
    sp.add_argument("--scorer-kd-queries", type=int, default=None, metavar="N",
                    help="kvpop, --scorer-kd: query rows per step that carry the soft retention (default 256)")
    sp.add_argument("--scorer-kd-compile", action="store_true",
                    help="kvpop, --scorer-kd: run the soft retention rows through torch.compile on CUDA (speed only; "
                         "the same values to float32 rounding; other devices run them eagerly)")
    sp.add_argument("--cuda-graph-step", action="store_true",
                    help="CUDA, one process, kvpop or streaming_plus: replay each step as one CUDA graph after 3 eager "
                         "steps (the same updates, far fewer kernel launches: the testbed model's step is "
                         "launch-bound; docs/DESIGN.md section 4, 'The step as one CUDA graph'); not with --scorer-kd "
                         "or --mlstm-compile-mode reduce-overhead")
    sp.add_argument("--state-in-budget", default=None, choices=("0", "1"),
                    help="kvpop, --scorer mlstm: 1 makes the recurrent state take its bytes' worth of top-k slots (in "
                         "training and in the cache, the KVpop paper's Table 1 rule), 0 does not (default: "
                         "KVpopConfig's, 0)")
    sp.add_argument("--mlstm-compile-mode", default=None, choices=("default", "reduce-overhead"),
                    help="kvpop, --scorer mlstm, CUDA: how the compiled scorer's training forward and backward launch: "
                         "kernel by kernel (default) or replayed as CUDA graphs (reduce-overhead; docs/DESIGN.md "
                         "section 5, 'Launch overhead') (default: KVpopConfig's, default)")
    sp.add_argument("--mlstm-use-norm", default=None, choices=("0", "1"),
                    help="kvpop, --scorer mlstm: 1 puts a per-head RMSNorm on the memory readout before the score (a "
                         "learned weight per value channel), 0 does not (default: KVpopConfig's, 0)")
    sp.add_argument("--mlstm-chunk-size", type=int, default=None, metavar="L",
                    help="kvpop, --scorer mlstm: chunk length of the scorer's chunkwise mLSTM forward (numerics and "
                         "speed only, the same function) (default: KVpopConfig's, 64)")
    sp.add_argument("--mlstm-value-dim", type=int, default=None, metavar="DV",
                    help="kvpop, --scorer mlstm: width of the mLSTM memory's values (the state holds head_dim x DV "
                         "per KV head) (default: KVpopConfig's, head_dim / 2)")
    sp.add_argument("--mlstm-gate-softcap", default=None, metavar="C",
                    help="kvpop, --scorer mlstm: soft cap C tanh(z / C) of the input and forget gate logits, a number "
                         "> 0, or none for no cap (default: KVpopConfig's, 15)")
    sp.add_argument("--decay-init", type=float, default=None,
                    help="kvpop: every head's initial decay gamma, in (0.999, 0.999999) (default: the log-midpoint, 0.9995)")
    sp.add_argument("--lr-decay", type=float, default=1e-2,
                    help="kvpop: peak learning rate of the decays' alpha (the --lr-new schedule; 1e-2 lets ~1000 "
                         "steps cross the decay range)")
    sp.add_argument("--target-aggregation", default=None, choices=("max", "mean"),
                    help="kvpop: the future-attention target's aggregation over the query heads of a KV head "
                         "(default: KVpopConfig's, max)")
    sp.add_argument("--target-count-normalize", default=None, choices=("0", "1"),
                    help="kvpop: 1 divides a token's future attention mass by its number of future queries (the "
                         "mean, Eq. 2), 0 keeps the total (default: KVpopConfig's; docs/DESIGN.md, 'Future-attention target')")
    sp.add_argument("--target-reduction", default=None, choices=("mass", "peak"),
                    help="kvpop: over a token's future queries, the sum of their attention probabilities (mass, the "
                         "paper's) or the largest one (peak; the count normalisation is then ignored) "
                         "(default: KVpopConfig's, peak)")
    sp.add_argument("--budget", type=int, default=1024, help="tokens kept per KV head: sinks + window + top-k")
    sp.add_argument("--sinks", type=int, default=4, help="first tokens always kept")
    sp.add_argument("--window", type=int, default=None,
                    help="protected recent window of kvpop and dms (default: the KVpop paper's 256 at budgets >= 512, "
                         "half the budget below; streaming_plus: budget - sinks)")
    add_trainer_options(sp, "the existing weights", "the new weights (KVpop, DMS gates)",
                        lr_default="RetrofitConfig's, 1e-4")
    sp.add_argument("--boundary-weight", type=float, default=1.0, help="weight of the boundary loss")
    sp.set_defaults(func=cmd_retrofit,  # the method-specific options' defaults, to tell which ones a user set
                    option_defaults={dest: sp.get_default(dest) for dest, _ in METHOD_OPTIONS.values()})


def add_reproduce_parser(sub) -> None:
    """``kvlearn reproduce``'s options."""
    sp = sub.add_parser("reproduce", help="rebuild a paper table on the testbed from the committed teacher (GPU; "
                                          "kvpop: the KVpop paper's Table 1, three budgets of four retrofits and a table each)")
    sp.add_argument("table", choices=("kvpop",), help="which table: kvpop (Table 1 of the KVpop paper)")
    sp.add_argument("--out", default="runs/reproduce-kvpop", help="folder for the runs and the merged kvpop_table.json")
    sp.add_argument("--overwrite", action="store_true", help="allow an --out folder that already holds files")
    sp.add_argument("--resume", action="store_true",
                    help="keep the budgets an earlier run with the same settings finished in --out, measure only the "
                         "runs a time guard left out of a budget's table (its students still in --out), and run the "
                         "other budgets (which may then run in separate sessions); the merged table covers them all")
    sp.add_argument("--budgets", default="1024,512,256", help="comma list of budgets (tokens per KV head)")
    sp.add_argument("--steps", type=int, default=None,
                    help="optimizer steps of each retrofit, the same for every method (default 1300, the table of "
                         "record's; the run's time then follows the GPU's speed)")
    sp.add_argument("--minutes", type=float, default=None,
                    help="instead of --steps: training minutes of each retrofit (a bounded run; the GPU then decides "
                         "the steps: DMS, the slowest step, trained 481-488 in 5 minutes on one H100, and its rows "
                         "fell short of the table of record's)")
    sp.add_argument("--n-per-task", type=int, default=100, help="examples per family and split")
    sp.add_argument("--students", default="kvpop_mlp,kvpop,streaming_plus,dms",
                    help="which of the four students this run trains (comma list); with --resume a later run adds the "
                         "others to each budget's table (a machine whose runs are too short for four at once)")
    sp.add_argument("--context-rows", action="store_true",
                    help="also the table of record's context rows: every training-free baseline under the context "
                         "protocol on the eval split (SnapKV and PyramidKV define only that one); with --resume, "
                         "added to budgets an earlier run left without them")
    sp.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cuda (cpu: a smoke run)")
    sp.add_argument("--merge-only", action="store_true",
                    help="run nothing: merge every budget table the --out folder holds into its kvpop_table.json, "
                         "with the plot and the comparison (no GPU needed, e.g. a folder copied back from one)")
    sp.add_argument("--model", default=None, help="the teacher's folder (default: checkpoints/testbed-teacher)")
    sp.add_argument("--retrofit-args", default="", help="more options for every retrofit (e.g. '--seq-len 256')")
    sp.add_argument("--table-args", default="", help="more options for every table process (e.g. '--context 256')")
    sp.add_argument("--dms-scope", default="head", choices=("head", "model"),
                    help="the DMS student's --compression-scope: head (each KV head trained for its slots, the "
                         "default) or model (the reference's, what Table 1's DMS rows of record used; a --resume of a "
                         "folder from before this option needs it)")
    sp.set_defaults(func=cmd_reproduce)


def add_kaizen_train_parser(sub) -> None:
    """``kvlearn kaizen-train``'s options."""
    from .kaizen.selector import TAU_END, TAU_START
    from .train.kaizen_recipes import KAIZEN_RECIPES, recipe_options

    sp = sub.add_parser("kaizen-train", help="train a KV-Kaizen selector and the backbone jointly (teacher: the dense "
                                             "model); one process, or FSDP2 under torchrun --nproc_per_node N -m "
                                             "kvlearn.cli kaizen-train (--batch-size is then the global batch, a "
                                             "multiple of N)")
    sp.add_argument("--model", required=True, help="checkpoint folder of the dense model (a supported family)")
    sp.add_argument("--out", required=True, help="output folder: step-<N>/ checkpoints, final/, train_log.jsonl")
    sp.add_argument("--overwrite", action="store_true", help="allow an --out folder that already holds files")
    sp.add_argument("--resume", action="store_true", help="continue from the newest step-<N> checkpoint in --out")
    sp.add_argument("--recipe", default=None, choices=tuple(KAIZEN_RECIPES),
                    help="a recipe of record: its settings for every option left out ("
                         + "; ".join(f"{name}: {recipe_options(name)}" for name in KAIZEN_RECIPES)
                         + "); 8x-refine continues an 8x run's final/ (--init-student, another --seed)")
    sp.add_argument("--target", default=None,
                    help="target compression factor, or a comma list sampled per sequence (default 4)")
    sp.add_argument("--axes", default=None, help="comma list of precision,rank,depth (default: every axis of the "
                    "backbone: precision,depth on GQA; rank needs a model converted to MLA and saved)")
    sp.add_argument("--beta", type=float, default=None,
                    help="initial budget multiplier (default: 0; with --init-student, where that run left it when "
                         "its folder records it for the same targets)")
    sp.add_argument("--eta", type=float, default=0.01, help="multiplier step (0: constant --beta)")
    sp.add_argument("--budget-cap", type=float, default=1e4, help="largest budget multiplier")
    sp.add_argument("--penalty-cost", default="expected", choices=("expected", "sampled"),
                    help="the cost the budget penalty reads: the expected cost under the selector's softmax (default: "
                         "no noise, so the argmax does not settle below the target) or the Gumbel sample's (the "
                         "default before 78345ed)")
    sp.add_argument("--underuse-weight", type=float, default=None,
                    help="weight of a penalty on compressing more than the target asks (w * relu(1 - cost / target)); "
                         "> 0 makes a budget-conditioned selector (--target 1,2,4) spend a loose target (default 0)")
    sp.add_argument("--budget-scope", default="sequence", choices=("sequence", "batch"),
                    help="what the budget penalty holds to the target: every sequence (default) or the batch's mean "
                         "ratio of cost to target (one budget over the prompts: one prompt may get more bits, "
                         "another fewer)")
    sp.add_argument("--target-head", default=None, choices=("0", "1"),
                    help="the selector's direct target term T_l log2(target) (default: on when --target lists several)")
    sp.add_argument("--share-layers", default=None,
                    help="the layers whose cache may be shared (replaced by an earlier layer's): all (the default: "
                         "every layer but 0), a comma list (6,7), or auto: before training, measure on evaluation-format training rows "
                         "how much sharing each layer alone raises the distillation loss, and allow it where that is "
                         "at most --share-threshold (written to share_sensitivity.json in --out)")
    sp.add_argument("--share-threshold", type=float, default=None,
                    help="with --share-layers auto: the largest increase of the distillation loss (nats per "
                         "supervised token) a shared layer may cost (default 0.05)")
    sp.add_argument("--share-rows", type=int, default=None,
                    help="with --share-layers auto: calibration rows of the sensitivity pass (default 64; each "
                         "layer's increase is reported with its standard error over the rows)")
    sp.add_argument("--share-seed", type=int, default=None,
                    help="with --share-layers auto: the calibration rows' stream seed (default 0 for every --seed, so "
                         "that runs of several seeds get one mask; --share-rows 16 --share-seed S with --seed S is "
                         "the pass of runs before session 41)")
    sp.add_argument("--lr-schedule", default="constant", choices=("constant", "cosine"),
                    help="the backbone's learning rate over the run: --lr throughout, or a cosine from --lr down to a "
                         "tenth of it (no warm-up)")
    sp.add_argument("--select-every", type=int, default=0, metavar="N",
                    help="checkpoint selection: every N steps from --select-from of the run on, and at its end, "
                         "evaluate the student as served (its selector's choices) on --select-n validation prompts per "
                         "family, disjoint from the eval and held-out ones; final/ is then the best one (best/, "
                         "selection.jsonl in --out; one process, one target) (default 0: off, final/ is the last step)")
    sp.add_argument("--select-n", type=int, default=None,
                    help="with --select-every: validation prompts per family (default 16)")
    sp.add_argument("--select-from", type=float, default=None,
                    help="with --select-every: the fraction of the run from which the iterates are validated "
                         "(default 0.5)")
    sp.add_argument("--ema-decay", type=float, default=None, metavar="D",
                    help="weight averaging: from --ema-from of the run on, keep an exponential moving average of every "
                         "weight (backbone and selector), decay D per step (e.g. 0.998: about the last 500 steps), and "
                         "make final/ that average (one process; not with --select-every) (default 0: off)")
    sp.add_argument("--ema-from", type=float, default=None,
                    help="with --ema-decay: the fraction of the run from which the average runs (default 0.5)")
    sp.add_argument("--init-student", default=None, metavar="FOLDER",
                    help="refine a trained selector: start the student (backbone and selector) from FOLDER, the "
                         "final/ of a kaizen-train run from the same --model (or its export), with a new optimizer, "
                         "multiplier and schedules; its selector settings and sharing mask are kept (--share-layers "
                         "left out). Give another --seed than its run's, so that the refinement reads new batches, and "
                         "--tau-start 0.1 to continue at the end temperature instead of reheating to 2.0")
    sp.add_argument("--tau-start", type=float, default=None,
                    help=f"Gumbel temperature at the start of the run, annealed geometrically to --tau-end (default "
                         f"{TAU_START})")
    sp.add_argument("--tau-end", type=float, default=None,
                    help=f"Gumbel temperature at the end of the run (default {TAU_END})")
    add_trainer_options(sp, "the backbone", "the selector", "constant, or the peak of --lr-schedule cosine",
                        lr_default="KaizenTrainConfig's, 1e-5", dense_fraction_default=None)
    sp.set_defaults(func=cmd_kaizen_train)


def add_convert_mla_parser(sub) -> None:
    """``kvlearn convert-mla``'s options."""
    sp = sub.add_parser("convert-mla", help="convert a GQA model to MLA (KV-Kaizen's rank axis), calibrated on testbed data")
    sp.add_argument("--model", required=True, help="checkpoint folder of the GQA model (Qwen3, Qwen2, Llama, Mistral)")
    sp.add_argument("--out", required=True, help="folder for the converted model (loadable by kvlearn.load)")
    sp.add_argument("--overwrite", action="store_true", help="allow an --out folder that already holds files")
    sp.add_argument("--rope-dim", type=int, required=True, help="width of the shared RoPE key (even, <= kv_heads x head_dim)")
    sp.add_argument("--rank", type=int, default=None, help="latent width (default kv_heads x head_dim; full: 2x that)")
    sp.add_argument("--variant", default="svd", choices=("svd", "care"), help="plain SVD or activation-aware CARE")
    sp.add_argument("--calibration-examples", type=int, default=16, help="testbed train examples for calibration")
    sp.add_argument("--calibration-length", type=int, default=1024, help="tokens per calibration example")
    sp.add_argument("--seed", type=int, default=0, help="calibration batch seed")
    sp.add_argument("--device", default="auto", help="auto, cpu or cuda[:N]")
    sp.add_argument("--threads", type=thread_count, default=0, help=THREADS_HELP)
    sp.set_defaults(func=cmd_convert_mla)


def add_testbed_parser(sub) -> None:
    """``kvlearn testbed``'s options."""
    from .testbed import tasks

    sp = sub.add_parser("testbed", help="print one generated example")
    sp.add_argument("--family", required=True, choices=tasks.FAMILIES, help="task family")
    variants = "; ".join(f"{f}: {', '.join(v)}" for f, v in tasks.VARIANTS.items())
    sp.add_argument("--variant", default=None, choices=sorted({v for vs in tasks.VARIANTS.values() for v in vs}),
                    help=f"variant of the family ({variants}); None: drawn from the seed")
    sp.add_argument("--length", type=int, default=512, help=f"prompt + answer tokens, in [{tasks.MIN_LENGTH}, {tasks.MAX_LENGTH}]")
    sp.add_argument("--split", default="eval", choices=tasks.SPLITS, help="split the example's seed is drawn from")
    sp.add_argument("--index", type=int, default=0, help="example index within the split")
    sp.add_argument("--dense", action="store_true",
                    help="the training format: in-context questions whose answers are supervised, shown as [[...]]")
    sp.set_defaults(func=cmd_testbed)


def build_parser() -> argparse.ArgumentParser:
    """The ``kvlearn`` command: one ``add_<command>_parser`` per subcommand."""
    from . import __version__

    p = _Parser(prog="kvlearn", description="Learned KV-cache compression for Hugging Face models.")
    p.add_argument("--version", action="version", version=f"kvlearn {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_demo_parser(sub)
    add_eval_parser(sub)
    add_methods_parser(sub)
    add_pretrain_parser(sub)
    add_retrofit_parser(sub)
    add_reproduce_parser(sub)
    add_kaizen_train_parser(sub)
    add_convert_mla_parser(sub)
    add_testbed_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KVLearnError as e:
        print(f"kvlearn: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
