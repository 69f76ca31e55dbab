"""The KV-Kaizen paper's comparison on the testbed (issue #11 item 9): the uncompressed control, the learned
selector(s), the same selectors' choices on the untrained backbone, the training-free baselines at matched factors,
and KV-Kaizen composed with eviction; every family, both splits, context 4096.

On the device (H200, bf16), after ``kvlearn kaizen-train`` (``benchmarks/device/kaizen_table.sh`` does both):

    PYTHONPATH=src python benchmarks/kaizen_table.py \\
        --selector kaizen4=runs/kaizen-t4/final --selector kaizen8=runs/kaizen-t8/final \\
        --n-per-task 100 --minutes 9 --out results/kaizen_table.json

writes ``results/kaizen_table.json`` (schema ``kvlearn.results.v1``, kind ``accuracy``) and
``results/kaizen_table.png`` (mean accuracy against the realised factor, one line per method). Every row has
``method`` in the issue's vocabulary, ``registry_method`` (what ``kvlearn eval --method`` ran), ``model`` (the
weights it ran on), ``factor`` (realised cache reduction, mean over examples; 1 for the control) and ``target``:

=====================  =====================================  ==================================================
``method``             ``registry_method`` (options)          what
=====================  =====================================  ==================================================
``control``            ``dense``                              the uncompressed model: ``--control PATH`` when
                                                              given (e.g. a same-recipe fine-tune without
                                                              compression), else ``--model`` (recorded in
                                                              ``control_model``)
``kaizen``             ``kaizen``                             each ``--selector LABEL=PATH`` (a kaizen-train
                                                              folder: selector and jointly trained backbone) at
                                                              each of its training targets; ``selector`` = LABEL
``untrained_backbone`` ``kaizen``                             the same selector on ``--model``'s weights, never
                                                              trained under it (``load_selector_onto``)
``static``             ``kaizen_static``                      uniform bits / evenly shared, per ``--factors``
``random``             ``kaizen_random``                      seeded random configuration, per ``--factors``
``dp_search``          ``kaizen_dp``                          offline DP search, per ``--factors``
``kivi``               ``kivi``                               post-hoc KIVI at 16/F bits (F in 2, 4, 8)
``posthoc_quant``      ``kaizen_static`` (axes precision)     the plain quantizer, uniform bits, no training
``kaizen+snapkv``      ``kaizen+snapkv`` (protocol context)   total factors ``--compose-factors``: the static
``kaizen+kvpop``       ``kaizen+kvpop``                       configuration at ``--compose-rep`` x eviction
``smaller_model``      ``dense``                              ``--smaller-model PATH``: a smaller dense model
                                                              trained with the teacher's recipe (e.g. ``kvlearn
                                                              pretrain --num-layers 2``), uncompressed; ``factor``
                                                              = the teacher's bf16 cache bits per token over its
                                                              own (:func:`smaller_model_factor`)
=====================  =====================================  ==================================================

The baselines (static .. posthoc_quant) and the compositions run on ``--model``'s weights without training (the
paper fine-tunes its static and random configurations under the recipe; that is not done here). On the same
weights ``posthoc_quant`` picks the configuration ``static`` picks whenever precision alone reaches the factor (at
ties ``static`` prefers less sharing), so those rows repeat ``static``'s; it runs on ``--control`` when given.
``kaizen+kvpop`` uses ``--kvpop PATH`` (a KVpop retrofit, under its trained scorer and trained fields: window,
decay range) or the teacher with untrained, zero-initialised scorers. ``--compose-selectors`` adds, per selector, the
composed rows on its trained backbone with its own per-prompt choice at its training target (``selector`` = LABEL;
the eviction keeps ``context x target / F`` tokens; ``kaizen+kvpop`` with the ``--kvpop`` scorers grafted on, the
rows' ``scorers``); ``--compose-methods`` and ``--no-untrained`` narrow the plan. Factors a method cannot reach (KIVI at 16x, precision alone past 8x) are listed under
``skipped`` with the reason. Protocol ``bounded`` for all but ``kaizen+snapkv`` (``context``, SnapKV's).

Runs go in priority order (the control, unless ``--no-control``: a part run beside one that measures it; the selectors and their untrained-backbone rows; the baselines at the
selectors' targets and ``--first-factors``, then at the other factors; the compositions), the file is written before the first run and
rewritten after every run with every run not done yet under ``not_run`` (a process killed mid-way leaves a file that
says ``complete: false``), and ``--minutes`` stops cleanly as in ``eviction_baselines.py``.

``--smoke`` runs the same code on the CPU in about a minute: a tiny random GQA Qwen3 (4 layers, 2 KV heads of 128,
2 query heads per KV head) saved as the teacher, the same shape with 2 layers as the smaller model, a selector trained 4 steps at target 4 with the trainer's Python
API, bfloat16 (so the dense cache is the factors' 16-bit reference), context 256, factors 4 and 8, compositions 16
and 32 (SnapKV and KVpop windows 16), KIVI windows of 32, 2 examples of niah and vt, under
``runs/smoke/kaizen_table/``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from eviction_baselines import add_run_options, parse_list, print_summary, recorded_command, repo_relative  # noqa: E402

from kvlearn.checkpoint import serving_dtype  # noqa: E402
from kvlearn.errors import KVLearnError, check  # noqa: E402
from kvlearn.eval.accuracy import EvalConfig, eval_splits, evaluate, tasks_not_started  # noqa: E402
from kvlearn.methods import trained_options  # noqa: E402
from kvlearn.results import make_results, settle_run, write_results  # noqa: E402

BASELINES = ("static", "dp_search", "random", "kivi", "posthoc_quant")  # priority order within a factor
COMPOSED = ("kaizen+snapkv", "kaizen+kvpop")
REGISTRY = {"control": "dense", "kaizen": "kaizen", "untrained_backbone": "kaizen", "static": "kaizen_static",
            "random": "kaizen_random", "dp_search": "kaizen_dp", "kivi": "kivi", "posthoc_quant": "kaizen_static",
            "kaizen+snapkv": "kaizen+snapkv", "kaizen+kvpop": "kaizen+kvpop", "smaller_model": "dense"}
BASE_OPTIONS = {"posthoc_quant": {"axes": ["precision"]}}
# The recipes of record in results/kaizen_table.json (README.md's KV-Kaizen table): the plot draws these series bold
# under these labels and every other labelled run faded (kvlearn.eval.plots.plot_pareto's ``highlight``). A series
# the plotted rows lack is left out, so a fresh run's table (its own selector labels) plots as before.
ALONE_8X = "selector 8x alone on the GPU (3,681-4,470 steps, 4 seeds, seed 3 twice; each then refined 3,000-3,088 more steps)"
RECORD_SERIES = {
    "kaizen [kaizen1_2_4_share_auto_alone]": "selector, one for 1x and 2x (--target 1,2,4)",
    "kaizen [kaizen4_share_auto]": "selector 4x (--share-layers auto)",
    "kaizen [kaizen8_lr1e-4_s0]": "selector 8x (--lr 1e-4, 3 seeds)",
    "kaizen [kaizen8_lr1e-4_s1]": "selector 8x (--lr 1e-4, 3 seeds)",
    "kaizen [kaizen8_lr1e-4_s2]": "selector 8x (--lr 1e-4, 3 seeds)",
    "kaizen [kaizen8_share02_ema_fw_alone6_s0]": ALONE_8X,
    "kaizen [kaizen8_share02_ema_fw_alone6_s1]": ALONE_8X,
    "kaizen [kaizen8_share02_ema_fw_alone6_s0_refined]": ALONE_8X,
    "kaizen [kaizen8_share02_ema_fw_alone6_s1_refined]": ALONE_8X,
    "kaizen [kaizen8_share02_ema_fw_alone4000_s2]": ALONE_8X,
    "kaizen [kaizen8_share02_ema_fw_alone4000_s2_refined]": ALONE_8X,
    "kaizen [kaizen8_share02_ema_fw_alone4000_s3]": ALONE_8X,
    "kaizen [kaizen8_share02_ema_fw_alone4000_s3_retrained]": ALONE_8X,
    "kaizen [kaizen8_share02_ema_fw_alone4000_s3_refined]": ALONE_8X,
    "untrained_backbone [kaizen4_share_auto]": "the 4x / 8x selectors' choice on the teacher",
    "untrained_backbone [kaizen8_lr1e-4_s0]": "the 4x / 8x selectors' choice on the teacher",
    "kaizen+kvpop [refined_b4_400]": "4-bit x the KVpop student refined under 4 bits (32x)",
    "kaizen+kvpop [fromsel_2600]": "an 8x selector's backbone x a KVpop student (64x)",
}


def plot_options(rows: list[dict], context: int) -> dict:
    """How the comparison is drawn (:func:`kvlearn.eval.plots.plot_pareto`'s options), after a run and by
    ``--replot``: against the realised factor, the control as the reference, and :data:`RECORD_SERIES` restricted to
    the series ``rows`` hold (named as the factor plot names them) in bold."""
    present = {f"{r['method']} [{r.get('selector') or r.get('series')}]" for r in rows
               if r.get("selector") or r.get("series")}
    return dict(title=f"KV-Kaizen comparison, context {context}", x="factor", reference="control",
                highlight={name: label for name, label in RECORD_SERIES.items() if name in present})


def replot(table: str, plot: str | None) -> int:
    """``--replot TABLE``: redraw a table's plot (default next to it, ``kaizen_table.png``) without running anything:
    how ``results/kaizen_table.png`` is drawn from the merged ``results/kaizen_table.json``."""
    from kvlearn.eval.plots import plot_pareto
    from kvlearn.results import read_results

    try:
        rows = read_results(table)["rows"]
    except (OSError, ValueError, KeyError) as e:
        print(f"kaizen_table: error: --replot {table}: not a readable results file ({e})", file=sys.stderr)
        return 2
    context = max((r.get("context", 0) for r in rows), default=0) or 4096
    print(f"wrote {plot_pareto(rows, Path(plot or Path(table).with_name('kaizen_table.png')), **plot_options(rows, context))}")
    return 0


class Run:
    """One evaluation: row label ``method``, ``weights`` (``None``: ``--model``; else a folder), ``selector`` (a
    kaizen-train folder whose selector goes onto ``--model``: untrained_backbone), ``scorers`` (a KVpop folder whose
    scorers go onto ``weights``: a selector composed with KVpop), the eval config, row extras."""

    def __init__(self, method, config, weights=None, selector=None, label=None, scorers=None):
        self.method, self.config, self.weights, self.selector, self.label = method, config, weights, selector, label
        self.scorers = scorers  # a KVpop folder whose scorers are grafted onto ``weights`` (load_kvpop)

    @property
    def group(self) -> str:  # which attention the model is attached with; a fresh model per group
        return {"dense": "hf", "kivi": "hf", "kaizen+kvpop": "kvpop"}.get(self.config.method, "kaizen")

    def describe(self) -> str:
        c = self.config
        who = self.method + (f"[{self.label}]" if self.label else "")
        factor = "" if c.method == "dense" else f"/F={c.target:g}" if c.target is not None else ""
        return f"{who}/{c.protocol}/{c.split}{factor}"


def parse_selector(text: str) -> tuple[str, str, tuple[float, ...]]:
    """``LABEL=PATH`` -> ``(label, path, train targets)``; one-line error otherwise."""
    label, _, path = text.partition("=")
    check(label and path, f"--selector {text!r}: expected LABEL=PATH, e.g. kaizen4=runs/kaizen-t4/final")
    config = Path(path) / "config.json"
    check(config.is_file(), f"--selector {text!r}: {path} has no config.json (expected a kaizen-train folder)")
    saved = json.loads(config.read_text()).get("kaizen")
    check(isinstance(saved, dict), f"--selector {text!r}: {path} has no KV-Kaizen selector (no 'kaizen' entry in "
                                   "config.json): expected a kaizen-train folder")
    return label, path, tuple(float(t) for t in saved.get("train_targets") or (4.0,))


def parse_factors(text: str, option: str) -> tuple[float, ...]:
    try:
        factors = tuple(float(f) for f in text.split(",") if f.strip())
    except ValueError:
        raise KVLearnError(f"{option} {text!r}: expected a comma list of factors, e.g. 2,4,8,16") from None
    check(factors and all(f > 0 for f in factors), f"{option} {text!r}: expected factors > 0")
    return factors


def smaller_model_factor(teacher: str, smaller: str) -> float:
    """The cache reduction of a smaller uncompressed model: the teacher's bits per token of a 16-bit cache
    (``layers x 2 x kv_heads x head_dim x 16``) over the smaller model's. One-line error unless both read the same
    vocabulary (the testbed's) and the smaller cache is no larger."""
    from kvlearn.hf import read_model_config
    from kvlearn.kaizen.actions import Backbone

    big, small = read_model_config(teacher), read_model_config(smaller)
    check(big.vocab_size == small.vocab_size, f"--smaller-model {smaller}: vocabulary {small.vocab_size}, the teacher's "
                                              f"is {big.vocab_size}: expected a model of the same testbed vocabulary")
    factor = Backbone.from_config(big).reference_bits / Backbone.from_config(small).reference_bits
    check(factor >= 1, f"--smaller-model {smaller}: its cache is {1 / factor:.3g}x the teacher's: expected a smaller one")
    return factor


def plan_runs(args, selectors) -> tuple[list[Run], dict[str, str]]:
    """The runs in priority order, and ``{run: why skipped}`` for factors a method cannot reach."""
    splits = parse_list(args.splits, eval_splits(), "--splits")
    baselines = parse_list(args.baselines, BASELINES, "--baselines") if args.baselines != "none" else ()
    factors = parse_factors(args.factors, "--factors")
    composed = parse_factors(args.compose_factors, "--compose-factors") if args.compose_factors != "none" else ()
    common = dict(tasks=tuple(args.tasks.split(",")) if args.tasks != "all" else EvalConfig().tasks,
                  n_per_task=args.n_per_task, context=args.context, batch_size=args.batch_size,
                  chunk_size=args.chunk_size, sinks=args.sinks)
    runs: list[Run] = []
    skipped: dict[str, str] = {}
    from kvlearn.hf import read_model_config
    from kvlearn.kaizen.actions import Backbone, check_budget

    backbones: dict[str, Backbone] = {}

    def feasible(config: EvalConfig, weights) -> None:
        """A one-line error now, not mid-run, for a factor the configuration's axes cannot reach on the backbone
        (``apply`` checks it only when the run starts)."""
        if config.method in ("kaizen_static", "kaizen_random", "kaizen_dp"):
            path = weights or args.model
            if path not in backbones:
                backbones[path] = Backbone.from_config(read_model_config(path))
            check_budget(config.target, backbones[path], config.method_config.axes)

    def add(method, weights=None, selector=None, label=None, scorers=None, **kw):
        protocol = "context" if method == "kaizen+snapkv" else "bounded"
        # a trained checkpoint is evaluated under the pattern it was trained for (a KVpop student's scorer, decay
        # range and window: kvlearn.methods.trained_options, as `kvlearn eval` does); --options still override
        trained = trained_options(REGISTRY[method], scorers or weights or args.model)
        options = {**trained, **BASE_OPTIONS.get(method, {}), **(args.method_options.get(method) or {})}
        for split in splits:
            try:
                config = EvalConfig(method=REGISTRY[method], split=split, protocol=protocol,
                                    options=options or None, **common, **kw)
                feasible(config, weights)
            except KVLearnError as e:
                run = Run(method, argparse.Namespace(method=REGISTRY[method], protocol=protocol, split=split,
                                                     target=kw.get("target")), label=label)
                skipped[run.describe()] = str(e)
                continue
            runs.append(Run(method, config, weights, selector, label, scorers))

    if not getattr(args, "no_control", False):
        add("control", weights=args.control)
    for label, path, targets in selectors:
        for t in targets:
            add("kaizen", weights=path, label=label, target=t)
            if getattr(args, "untrained", True):
                add("untrained_backbone", selector=path, label=label, target=t)
    if getattr(args, "smaller_model", None):
        add("smaller_model", weights=args.smaller_model)
    first_factors = parse_factors(args.first_factors, "--first-factors") if args.first_factors else ()
    first = sorted({t for *_, ts in selectors for t in ts if t in factors} | {f for f in first_factors if f in factors})
    for f in first + sorted(f for f in factors if f not in first):
        for m in baselines:
            add(m, weights=args.control if m == "posthoc_quant" else None, target=f)
    compose_methods = parse_list(getattr(args, "compose_methods", "all"), COMPOSED, "--compose-methods")
    for f in composed:
        budget = int(round(args.context * args.compose_rep / f))
        for m in compose_methods:
            add(m, weights=args.kvpop if m == "kaizen+kvpop" else None, target=f, budget=budget)
    if getattr(args, "compose_selectors", False):  # each selector's backbone and choice under eviction
        for label, path, targets in selectors:
            rep = targets[0]
            for f in composed:
                budget = int(round(args.context * rep / f))
                for m in compose_methods:
                    if f <= rep:
                        skipped[f"{m}[{label}]/F={f:g}"] = (f"total factor {f:g}x is not above the selector's "
                                                            f"{rep:g}x: no eviction left to compose")
                        continue
                    add(m, weights=path, label=label, scorers=args.kvpop if m == "kaizen+kvpop" else None,
                        target=f, budget=budget)
    return runs, skipped


def smoke_setup(args) -> None:
    """``--smoke``: a tiny random GQA teacher saved to disk, a selector trained 4 steps at target 4, CPU settings."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kvlearn.testbed.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE
    from kvlearn.train.kaizen_train import KaizenTrainConfig, kaizen_train

    args.device, args.context, args.n_per_task, args.batch_size, args.chunk_size = "cpu", 256, 2, 4, 64
    args.tasks = "niah,vt" if args.tasks == "all" else args.tasks
    args.factors = args.factors or "4,8"
    args.method_options.setdefault("dp_search", {"examples": 2, "length": 128, "batch_size": 2})
    args.method_options.setdefault("kaizen+kvpop", {"window": 16})
    args.method_options.setdefault("kaizen+snapkv", {"window": 16})
    args.method_options.setdefault("kivi", {"group_size": 32, "residual": 32})
    args.dtype = "bfloat16" if args.dtype == "auto" else args.dtype
    work = Path(args.smoke_dir)
    teacher = work / "teacher"
    torch.manual_seed(0)
    shape = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=128, max_position_embeddings=512, pad_token_id=PAD_ID,
                 bos_token_id=BOS_ID, eos_token_id=EOS_ID, tie_word_embeddings=True)
    Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=4, **shape)).save_pretrained(teacher)
    args.model = str(teacher)
    if args.smaller_model is None:  # half the layers: a 2x smaller cache
        smaller = work / "smaller"
        Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=2, **shape)).save_pretrained(smaller)
        args.smaller_model = str(smaller)
    if not args.selector:
        result = kaizen_train(KaizenTrainConfig(model=str(teacher), out=str(work / "kaizen-t4"), overwrite=True,
                                                targets=(4.0,), steps=4, batch_size=2, seq_len=128, save_interval=100,
                                                warmup_steps=0, lr=1e-3, lr_new=0.2, beta=50.0, eta=0.0),
                              progress=False)
        args.selector = [f"kaizen4={result['final']}"]


def parse_options(texts: list[str]) -> dict[str, dict]:
    """``--options METHOD=JSON`` (repeatable) -> ``{method: fields}``; one-line error otherwise."""
    out: dict[str, dict] = {}
    for text in texts:
        method, _, body = text.partition("=")
        check(method in REGISTRY, f"--options {text!r}: unknown row method {method!r}: expected one of "
                                  f"{', '.join(REGISTRY)}")
        try:
            fields = json.loads(body)
        except ValueError:
            fields = None
        check(isinstance(fields, dict), f"--options {text!r}: expected METHOD=JSON object, e.g. "
                                        "'dp_search={\"examples\": 8}'")
        out[method] = fields
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "checkpoints" / "testbed-teacher"),
                    help="the teacher (the original backbone: baselines and untrained_backbone rows run on it)")
    ap.add_argument("--control", default=None, help="uncompressed control folder (default: --model)")
    ap.add_argument("--no-control", action="store_true",
                    help="leave the control rows out (a part run beside another that measures them)")
    ap.add_argument("--selector", action="append", default=[], metavar="LABEL=PATH",
                    help="a kaizen-train folder (repeat the option); evaluated at each of its training targets")
    ap.add_argument("--smaller-model", default=None,
                    help="a smaller dense model trained with the teacher's recipe: its rows (smaller_model) at the "
                         "factor of its smaller cache")
    ap.add_argument("--kvpop", default=None, help="a KVpop retrofit folder for kaizen+kvpop (default: --model, "
                                                  "untrained scorers)")
    ap.add_argument("--factors", default=None, help="the baselines' target factors (default 2,4,8,16; --smoke: 4,8)")
    ap.add_argument("--first-factors", default="",
                    help="factors whose baseline rows run first, besides the selectors' targets (e.g. 4,8 in a "
                         "baselines-only run beside the selectors' training)")
    ap.add_argument("--baselines", default="all", help=f"comma list of {','.join(BASELINES)}, 'all' or 'none'")
    ap.add_argument("--compose-factors", default="16,32", help="total factors of kaizen+snapkv/kvpop, or 'none'")
    ap.add_argument("--compose-rep", type=float, default=4.0,
                    help="the representation's share of a composed factor F: eviction keeps context x rep / F tokens")
    ap.add_argument("--compose-methods", default="all",
                    help=f"comma list of {','.join(COMPOSED)} or 'all': the composed methods of --compose-factors")
    ap.add_argument("--untrained", action=argparse.BooleanOptionalAction, default=True,
                    help="each selector's untrained_backbone rows (its choice on --model's weights)")
    ap.add_argument("--compose-selectors", action="store_true",
                    help="also compose each --selector with eviction at --compose-factors: its trained backbone and its "
                         "choice per prompt at its training target (eviction keeps context x target / F tokens), "
                         "KVpop's scorers grafted from --kvpop (rows kaizen+snapkv / kaizen+kvpop with selector=LABEL)")
    ap.add_argument("--options", action="append", default=[], metavar="METHOD=JSON",
                    help="extra config fields of a row method, e.g. 'dp_search={\"examples\": 8}'")
    ap.add_argument("--splits", default="all", help=f"comma list of {','.join(eval_splits())} or 'all'")
    add_run_options(ap)
    ap.add_argument("--out", default=None, help="results file (default: results/kaizen_table.json, "
                                                "runs/smoke/kaizen_table/kaizen_table.json with --smoke)")
    ap.add_argument("--plot", default=None, help="plot (default: next to --out, kaizen_table.png)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"),
                    help="model dtype (auto: bfloat16 on cuda, float32 on the CPU; --smoke: bfloat16)")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny random models, a 4-step selector, context 256")
    ap.add_argument("--smoke-dir", default="runs/smoke/kaizen_table", help="--smoke's teacher and selector folder")
    ap.add_argument("--replot", default=None, metavar="TABLE",
                    help="only redraw TABLE's plot (to --plot, default next to it), the recipes of record in bold")
    args = ap.parse_args(argv)
    if args.replot:
        return replot(args.replot, args.plot)
    start = time.monotonic()
    try:
        args.method_options = parse_options(args.options)
        if args.smoke:
            smoke_setup(args)
        args.factors = args.factors or "2,4,8,16"
        out = Path(args.out or (Path(args.smoke_dir) / "kaizen_table.json" if args.smoke else "results/kaizen_table.json"))
        plot = Path(args.plot or out.with_name("kaizen_table.png"))
        selectors = [parse_selector(s) for s in args.selector]
        check(len({s[0] for s in selectors}) == len(selectors), f"--selector labels repeat: {[s[0] for s in selectors]}")
        smaller_factor = smaller_model_factor(args.model, args.smaller_model) if args.smaller_model else None
        runs, skipped = plan_runs(args, selectors)
    except KVLearnError as e:
        print(f"kaizen_table: error: {e}", file=sys.stderr)
        return 2
    for what, why in skipped.items():
        print(f"skipped {what}: {why}")

    deadline = start + 60 * args.minutes
    dtype = {"auto": serving_dtype(args.device), "bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    models: dict[tuple, torch.nn.Module] = {}

    def model_for(run: Run):
        key = (run.weights, run.selector, run.group, run.scorers)
        if key not in models:
            from kvlearn import load
            from kvlearn.kaizen.apply import load_selector_onto
            from kvlearn.kvpop.apply import load_kvpop

            models.clear()  # one model in memory at a time
            model = load(run.weights or args.model, dtype=dtype, device=args.device)
            if run.selector is not None:
                load_selector_onto(model, run.selector)
            if run.scorers is not None:
                load_kvpop(model, run.scorers)
            models[key] = model
        return models[key]

    rows: list[dict] = []
    command = recorded_command(argv).replace("benchmarks/eviction_baselines.py", "benchmarks/kaizen_table.py")
    control = repo_relative(args.control) if args.control else None

    def save(not_run: list[str]) -> None:
        """Write the file as it stands; ``not_run``: every planned run not done yet (complete only when empty)."""
        results = make_results(
            "accuracy", rows, device=args.device, command=command,
            model=("tiny random Qwen3 (--smoke): " if args.smoke else "") + repo_relative(args.model),
            control_model=control or f"{repo_relative(args.model)} (the teacher itself: no separate same-recipe control "
                                     "given with --control)",
            selectors={label: {"path": repo_relative(path), "train_targets": list(ts)} for label, path, ts in selectors},
            kvpop_model=repo_relative(args.kvpop) if args.kvpop else "the teacher with untrained KVpop scorers",
            **({"smaller_model": repo_relative(args.smaller_model)} if args.smaller_model else {}),
            note=("static, random, dp_search, kivi, posthoc_quant and the compositions run on --model's weights "
                  "without training; posthoc_quant repeats static's configuration wherever precision alone reaches the "
                  "factor; untrained_backbone = each selector's choices on --model's weights; factor = realised"),
            context=args.context, dtype=str(dtype).replace("torch.", ""), n_per_task=args.n_per_task,
            wall_seconds=round(time.monotonic() - start, 1), skipped=skipped, not_run=not_run,
            complete=not not_run and not any(r.get("incomplete") for r in rows))
        write_results(out, results)

    not_run = [r.describe() for r in runs]  # a process killed mid-way leaves an honest file
    save(not_run)
    total = sum(len(r.config.tasks) * r.config.n_per_task for r in runs)
    bar = tqdm(total=total, desc="table", unit="ex", mininterval=0.1 if sys.stderr.isatty() else 20.0)
    for run in runs:
        if time.monotonic() >= deadline:
            print(f"time guard ({args.minutes} min): {len(not_run)} run(s) not started", flush=True)
            break
        bar.set_description(run.describe())
        new = evaluate(model_for(run), run.config, progress=False, deadline=deadline, bar=bar)
        for r in new:
            r["registry_method"], r["method"] = r["method"], run.method
            r["model"] = (repo_relative(run.weights) if run.weights else "teacher")
            if run.label:
                r["selector"] = run.label
            if run.selector:
                r["selector_path"] = repo_relative(run.selector)
            if run.scorers:
                r["scorers"] = repo_relative(run.scorers)
            if run.method == "smaller_model":  # its own dense cache, smaller than the teacher's
                r["factor"] = r["target"] = round(smaller_factor, 6)
            r.setdefault("factor", 1.0)  # control: the dense cache
        rows += new
        not_run = settle_run(not_run, run.describe(), tasks_not_started(run.config, new))
        save(not_run)
    bar.close()
    save(not_run)
    options = plot_options(rows, args.context)
    print_summary(rows, out, plot, options.pop("title"), start, **options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
