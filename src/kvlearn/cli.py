"""The ``kvlearn`` command: ``demo``, ``eval``, ``pretrain`` and ``testbed``.

Bad input is reported as one line (``kvlearn: error: ...``) with exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .errors import KVLearnError, check

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = REPO_ROOT / "checkpoints" / "testbed-teacher"


def default_model_path() -> str:
    """The embedded teacher: ``$KVLEARN_MODEL`` if set, else ``checkpoints/testbed-teacher`` of this checkout."""
    return os.environ.get("KVLEARN_MODEL", str(DEFAULT_MODEL))


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    check(name == "cpu" or name.startswith("cuda"), f"device={name!r} is invalid: expected auto, cpu or cuda[:N]")
    check(name == "cpu" or torch.cuda.is_available(), f"device={name!r} requested but CUDA is not available: use --device cpu")
    return name


def _tasks(text: str) -> tuple[str, ...]:
    from .testbed.tasks import FAMILIES

    if text == "all":
        return FAMILIES
    names = tuple(t.strip() for t in text.split(",") if t.strip())
    unknown = [t for t in names if t not in FAMILIES]
    check(not unknown and names, f"--tasks {text!r}: unknown task(s) {', '.join(unknown) or '(none given)'}; expected a comma list of {', '.join(FAMILIES)} or 'all'")
    return names


def _load(path: str, device: str):
    import torch

    from .hf import load_model

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    return load_model(path, dtype=dtype, device=device)


def cmd_eval(args) -> int:
    from .eval.accuracy import EvalConfig, evaluate, format_table
    from .eval.plots import plot_accuracy
    from .results import make_results, write_results

    device = _device(args.device)
    config = EvalConfig(method=args.method, budget=args.budget, sinks=args.sinks, tasks=_tasks(args.tasks),
                        n_per_task=args.n_per_task, context=args.context, batch_size=args.batch_size)
    model = _load(args.model, device)
    rows = evaluate(model, config)
    print(format_table(rows))
    if args.out:
        results = make_results("accuracy", rows, device=device, model=args.model, context=args.context)
        print(f"wrote {write_results(args.out, results)}")
        if args.plot:
            print(f"wrote {plot_accuracy(rows, args.plot)}")
    return 0


def cmd_demo(args) -> int:
    from .eval.accuracy import EvalConfig, evaluate, format_table
    from .eval.plots import plot_accuracy
    from .results import make_results, write_results

    device = _device(args.device)
    model = _load(args.model, device)
    tasks = _tasks(args.tasks)
    rows = []
    for method, budget in (("dense", None), ("streaming", args.budget)):
        config = EvalConfig(method=method, budget=budget, sinks=args.sinks, tasks=tasks, n_per_task=args.n_per_task,
                            context=args.context, batch_size=args.batch_size)
        rows += evaluate(model, config)
    print(format_table(rows))
    results = make_results("accuracy", rows, device=device, model=args.model, context=args.context)
    print(f"wrote {write_results(args.out, results)}")
    title = f"Testbed teacher at context {args.context}: full cache vs sinks+window"
    print(f"wrote {plot_accuracy(rows, args.plot, title=title)}")
    return 0


def cmd_pretrain(args) -> int:
    from .train.pretrain import PretrainConfig, pretrain

    config = PretrainConfig(**({"out": args.out} if args.out else {}), overwrite=args.overwrite, minutes=args.minutes, device=_device(args.device), seed=args.seed,
                            resume=args.resume, num_workers=args.num_workers, eval_n=args.eval_n,
                            tokens_per_step=args.tokens_per_step, lr=args.lr, dense_fraction=args.dense_fraction,
                            **({"stages": tuple(int(s) for s in args.stages.split(","))} if args.stages else {}),
                            **({"stage_fractions": tuple(float(s) for s in args.stage_fractions.split(","))} if args.stage_fractions else {}),
                            **({"warmup_steps": args.warmup_steps} if args.warmup_steps is not None else {}),
                            **({"family_weights": tuple(float(w) for w in args.family_weights.split(","))} if args.family_weights else {}))
    pretrain(config)
    return 0


def cmd_testbed(args) -> int:
    from .testbed import tasks
    from .testbed.tokenizer import build_tokenizer

    check(args.family in tasks.FAMILIES, f"--family {args.family!r} is unknown: expected one of {', '.join(tasks.FAMILIES)}")
    tok = build_tokenizer()
    ex = tasks.generate(args.family, tasks.example_seed(args.family, "eval", args.index), args.length, variant=args.variant)
    print(f"# {ex.family}/{ex.variant}  prompt {len(ex.prompt_ids)} tokens, answer {len(ex.answer_ids)} tokens")
    print(tok.decode(ex.prompt_ids))
    print("# answer:")
    print(tok.decode(ex.answer_ids))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvlearn", description="Learned KV-cache compression for Hugging Face models.")
    sub = p.add_subparsers(dest="command", required=True)

    def common_eval(sp, n_default):
        sp.add_argument("--model", default=default_model_path(), help="checkpoint folder (default: the embedded teacher)")
        sp.add_argument("--tasks", default="all", help="comma list of trace,niah,vt,recall or 'all'")
        sp.add_argument("--n-per-task", type=int, default=n_default)
        sp.add_argument("--context", type=int, default=4096)
        sp.add_argument("--sinks", type=int, default=4)
        sp.add_argument("--batch-size", type=int, default=8)
        sp.add_argument("--device", default="auto")

    sp = sub.add_parser("demo", help="embedded teacher: full cache vs a sinks+window cache on every family")
    common_eval(sp, 8)
    sp.add_argument("--budget", type=int, default=1024)
    sp.add_argument("--out", default="results/demo.json")
    sp.add_argument("--plot", default="results/demo.png")
    sp.set_defaults(func=cmd_demo)

    sp = sub.add_parser("eval", help="accuracy of one method on the testbed")
    common_eval(sp, 10)
    sp.add_argument("--method", required=True, help="dense or streaming")
    sp.add_argument("--budget", type=int, default=None)
    sp.add_argument("--out", default=None)
    sp.add_argument("--plot", default=None)
    sp.set_defaults(func=cmd_eval)

    sp = sub.add_parser("pretrain", help="train the testbed teacher from scratch (GPU)")
    sp.add_argument("--out", default=None, help="checkpoint folder (default: a new runs/testbed-teacher-<time>)")
    sp.add_argument("--overwrite", action="store_true", help="allow an --out folder that already holds files")
    sp.add_argument("--minutes", type=float, default=18.0, help="wall-clock training budget")
    sp.add_argument("--device", default="auto")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--resume", default=None)
    sp.add_argument("--num-workers", type=int, default=6)
    sp.add_argument("--eval-n", type=int, default=64, help="examples per family and split in each stage check")
    sp.add_argument("--tokens-per-step", type=int, default=131072)
    sp.add_argument("--lr", type=float, default=2e-3)
    sp.add_argument("--warmup-steps", type=int, default=None)
    sp.add_argument("--dense-fraction", type=float, default=0.75,
                    help="share of training rows with in-context question/answer pairs (the rest: evaluation format)")
    sp.add_argument("--stages", default=None, help="comma list of example lengths, e.g. 256,512,1024,2048,4096")
    sp.add_argument("--stage-fractions", default=None, help="comma list of time fractions, summing to 1")
    sp.add_argument("--family-weights", default=None, help="comma list of sampling weights for trace,niah,vt,recall")
    sp.set_defaults(func=cmd_pretrain)

    sp = sub.add_parser("testbed", help="print one generated example")
    sp.add_argument("--family", required=True)
    sp.add_argument("--variant", default=None)
    sp.add_argument("--length", type=int, default=512)
    sp.add_argument("--index", type=int, default=0)
    sp.set_defaults(func=cmd_testbed)
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
