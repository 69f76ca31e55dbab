"""Operators a forward issues per layer through each cache, counted on the CPU: a proxy for the host's launch work on
the GPU, where a forward of a small model waits on the host issuing kernels, not on the kernels.

    python benchmarks/cache_operator_count.py                       # -> results/cache_operator_count_cpu.json
    python benchmarks/cache_operator_count.py --chunks 1,256 --methods dense,streaming,kvpop_mlp,kvpop_mlstm

A tiny random GQA Qwen3 (2 layers, 4 query / 2 KV heads of 32; the counts depend on the code path, not the sizes)
takes a ``--context``-token prompt through each method's cache in chunks of 256 columns, then one forward of
``chunk`` more tokens (1: a decode step) is counted under a dispatch mode: every aten operator that is not a view
(views launch no kernel). Each row: the method, the chunk, the operators per layer in all, those issued from
kvlearn's code (``kvlearn_ops_per_layer``: the rest is the model's own, e.g. its projections and norms), and the ten
kvlearn sites (file:function) that issue the most. ``dense`` is transformers' ``DynamicCache``: the model alone.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from kvlearn.errors import KVLearnError, check, check_int  # noqa: E402
from kvlearn.results import command_line, make_results, write_results  # noqa: E402

METHODS = ("dense", "streaming", "knorm", "kvpop_mlp", "kvpop_mlstm")
VIEWS = frozenset({"view", "_unsafe_view", "as_strided", "expand", "unsqueeze", "squeeze", "slice", "select",
                   "transpose", "permute", "t", "alias", "detach", "reshape", "narrow", "split", "unbind",
                   "split_with_sizes", "lift_fresh", "_reshape_alias", "diagonal", "unfold", "chunk", "view_as"})
PACKAGE = str(REPO / "src" / "kvlearn")


class OperatorCounter(TorchDispatchMode):
    """Counts the non-view aten operators dispatched inside it: ``total``, and ``sites``, per innermost kvlearn
    frame (``path:function``) of the Python stack that issued them (operators issued outside kvlearn's code are
    counted in ``total`` only)."""

    def __init__(self):
        super().__init__()
        self.total, self.sites = 0, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] not in VIEWS:
            self.total += 1
            for frame in reversed(traceback.extract_stack()):
                if frame.filename.startswith(PACKAGE):
                    self.sites[f"{Path(frame.filename).relative_to(PACKAGE).as_posix()}:{frame.name}"] += 1
                    break
        return func(*args, **(kwargs or {}))


def tiny_model(layers: int = 2):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1 << 15)
    return Qwen3ForCausalLM(config).eval()


def make_cache(method: str, model, budget: int, window: int):
    """A fresh cache of ``method`` for ``model`` (KVpop applied to the model first for ``kvpop_*``)."""
    from transformers import DynamicCache

    from kvlearn.config import KVpopConfig
    from kvlearn.hf import attach
    from kvlearn.kvpop.apply import apply_kvpop, make_kvpop_cache
    from kvlearn.methods import get_method, make_config

    if method == "dense":
        return model, DynamicCache()
    if method.startswith("kvpop_"):
        apply_kvpop(model, KVpopConfig(sinks=4, window=window, topk=budget - 4 - window, scorer=method[6:]))
        return model, make_kvpop_cache(model)
    attach(model)
    options = {"window": window} if method == "knorm" else {}
    return model, get_method(method).make_cache(make_config(method, budget=budget, sinks=4, **options), model.config)


def count(method: str, chunk: int, context: int, budget: int, window: int) -> dict:
    from kvlearn.cache import prefill

    model, cache = make_cache(method, tiny_model(), budget, window)
    ids = torch.randint(3, model.config.vocab_size, (1, context + chunk), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if method == "dense":
            model(input_ids=ids[:, :context], past_key_values=cache, use_cache=True)
        else:
            prefill(model, cache, ids[:, :context], chunk_size=256)
        counter = OperatorCounter()
        with counter:
            model(input_ids=ids[:, context:], attention_mask=torch.ones_like(ids), past_key_values=cache,
                  use_cache=True)
    layers = model.config.num_hidden_layers
    ours = sum(counter.sites.values())
    return {"method": method, "chunk": chunk, "context": context, "layers": layers,
            "ops_per_layer": counter.total / layers, "kvlearn_ops_per_layer": ours / layers,
            "top_kvlearn_sites_per_layer": {k: v / layers for k, v in counter.sites.most_common(10)}}


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma list of {', '.join(METHODS)}")
    ap.add_argument("--chunks", default="1,256", help="tokens of the counted forward, comma list (1 = a decode step)")
    ap.add_argument("--context", type=int, default=2048, help="tokens in the cache before the counted forward")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--out", default=str(REPO / "results" / "cache_operator_count_cpu.json"))
    args = ap.parse_args(argv)
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    for m in args.methods:
        check(m in METHODS, f"--methods: {m!r} is unknown: expected some of {', '.join(METHODS)}")
    try:
        args.chunks = [int(c) for c in args.chunks.split(",")]
    except ValueError:
        raise KVLearnError(f"--chunks={args.chunks!r} is invalid: expected comma-separated integers") from None
    for c in args.chunks:
        check_int("--chunks value", c, 1, 4096)
    check_int("--window", args.window, 1)
    check(args.budget > args.window + 4, f"--budget={args.budget} is invalid: expected > window + 4 = {args.window + 4}")
    check(args.context > args.budget, f"--context={args.context} is invalid: expected more than --budget={args.budget} "
                                      "tokens (else nothing is evicted)")
    return args


def main(argv=None) -> int:
    try:
        args = parse(argv)
    except KVLearnError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    rows = []
    for method in args.methods:
        for chunk in args.chunks:
            rows.append(count(method, chunk, args.context, args.budget, args.window))
            r = rows[-1]
            print(f"{method:<12} chunk {chunk:>4}: {r['ops_per_layer']:7.1f} operators per layer, "
                  f"{r['kvlearn_ops_per_layer']:6.1f} from kvlearn", flush=True)
    write_results(args.out, make_results("operator_count", rows, device="cpu", command=command_line(),
                                         budget=args.budget, window=args.window, context=args.context))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
