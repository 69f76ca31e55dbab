"""Which single-layer KV-Kaizen actions break a dense model's answers, and whether the training loss sees it.

    python benchmarks/kaizen_layer_sensitivity.py --model checkpoints/testbed-teacher --n 8 \
        --out results/raw/NAME.json

For each task family and each row format (``eval``: the evaluation prompts; ``dense``: the training stream's rows
with in-context answers, what the KV-Kaizen trainer supervises), the first ``--n`` examples of the ``eval`` split at
``--context`` go through the model's *training* forward (``use_cache=False`` with
:class:`~kvlearn.kaizen.sharing.KaizenTrainForward` and one-hot weights: exactly the chosen configuration's
forward, :mod:`kvlearn.kaizen.sharing`) under these configurations:

- ``all16`` (every layer keeps its bf16-range cache: the dense model; checked against a plain forward),
- ``all4`` (every layer at 4 bits: the static 4x configuration),
- ``all4+share<l>`` for every layer ``l >= 1`` (layer ``l`` reads layer ``l-1``'s cache instead of its own),
- ``all4+b2@<l>`` for every layer (layer ``l`` at 2 bits).

Per configuration and family it reports teacher-forced ``token`` accuracy over the supervised tokens, ``answer``
(the share of rows with every supervised token right: exact match), and ``kd``: the distillation loss the
KV-Kaizen trainer minimises (:func:`kvlearn.ops.distill_loss.kd_loss`, KL from the ``all16`` logits' top-256 per
supervised token; its floor, the ``all16`` row's, is the teacher's probability mass outside its top 256, ~0 for a
trained model). A configuration whose ``answer`` collapses while ``kd`` barely moves is one the selector's
training signal cannot tell from a harmless one.

``--configurations 'b4 b4 share b4 share b4 share share;b8 b4 share b2 share b2 share share'`` measures the given
per-layer configurations (``;``-separated, each written as ``kvlearn eval --configuration`` takes it) instead of
the set above, after ``all16``: e.g. every configuration of one compression factor, to see whether the families
would rank them alike (a selector that reads the prompt can only gain from per-family choices if they do not).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from kvlearn import load_model
from kvlearn.threads import THREADS_HELP, set_threads, thread_count
from kvlearn.errors import KVLearnError, check
from kvlearn.kaizen.actions import Backbone, KaizenConfig, LayerAction, action_space
from kvlearn.kaizen.sharing import KaizenTrainForward, attach
from kvlearn.results import make_results, write_results
from kvlearn.testbed.data import IGNORE_INDEX, example_labels
from kvlearn.testbed.tasks import FAMILIES, example_seed, generate
from kvlearn.ops.distill_loss import kd_loss

FORMATS = ("eval", "dense")


def configurations(num_layers: int, given: str | None = None, backbone: Backbone | None = None
                   ) -> list[tuple[str, tuple[LayerAction, ...]]]:
    """``[(name, per-layer actions)]``: all16, then the ``;``-separated ``given`` configurations (parsed on
    ``backbone``; one-line errors), or by default all4, one shared layer, one 2-bit layer (module docstring)."""
    four = LayerAction(bits=4)
    out = [("all16", (LayerAction(bits=16),) * num_layers)]
    if given is not None:
        texts = [t.strip() for t in given.split(";") if t.strip()]
        check(len(texts) > 0, f"--configurations {given!r} is empty: expected configurations like 'b4 b4 share b4'")
        return out + [(" ".join(t.split()), KaizenConfig.parse(backbone, t).actions) for t in texts]
    out.append(("all4", (four,) * num_layers))
    for l in range(1, num_layers):
        out.append((f"all4+share{l}", tuple(LayerAction.shared() if j == l else four for j in range(num_layers))))
    for l in range(num_layers):
        out.append((f"all4+b2@{l}", tuple(LayerAction(bits=2) if j == l else four for j in range(num_layers))))
    return out


def one_hot(actions, space, batch: int) -> torch.Tensor:
    """``[batch, layers, len(space)]`` one-hot weights of ``actions``."""
    indices = torch.tensor([space.index(a) for a in actions])
    return torch.nn.functional.one_hot(indices, len(space)).float().expand(batch, -1, -1)


def measure(logits: torch.Tensor, reference: torch.Tensor, labels: torch.Tensor) -> dict:
    """``token``, ``answer`` and ``kd`` of ``logits [B, T, V]`` against ``labels [B, T]`` and the ``reference``
    logits (module docstring)."""
    pred, lab = logits[:, :-1].argmax(-1), labels[:, 1:]
    mask = lab != IGNORE_INDEX
    right = (pred == lab) & mask
    rows_right = (right | ~mask).all(dim=1)
    return {"token": right.sum().item() / max(1, mask.sum().item()), "answer": rows_right.float().mean().item(),
            "kd": kd_loss(logits, reference, labels, 256).item()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="checkpoints/testbed-teacher")
    ap.add_argument("--families", default="all", help=f"comma list of {','.join(FAMILIES)} or 'all'")
    ap.add_argument("--formats", default="eval,dense", help=f"comma list of {','.join(FORMATS)}")
    ap.add_argument("--n", type=int, default=8, help="examples per family and format")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=thread_count, default=0, help=THREADS_HELP)
    ap.add_argument("--configurations", default=None,
                    help="';'-separated per-layer configurations to measure instead of the default set (after all16)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        families = FAMILIES if args.families == "all" else tuple(args.families.split(","))
        for f in families:
            check(f in FAMILIES, f"--families: unknown family {f!r}: expected one of {', '.join(FAMILIES)}")
        formats = tuple(args.formats.split(","))
        for f in formats:
            check(f in FORMATS, f"--formats: unknown format {f!r}: expected one of {', '.join(FORMATS)}")
        check(args.n >= 1, f"--n={args.n} is invalid: expected >= 1")
    except KVLearnError as e:
        print(f"kaizen_layer_sensitivity: error: {e}", file=sys.stderr)
        return 2
    set_threads(args.threads)
    model = load_model(args.model, dtype=torch.float32, device=args.device)
    model.eval()
    backbone = Backbone.from_model(model)
    try:
        measured = configurations(backbone.num_layers, args.configurations, backbone)
    except KVLearnError as e:
        print(f"kaizen_layer_sensitivity: error: {e}", file=sys.stderr)
        return 2
    attach(model)
    space = list(action_space(backbone))
    rows, start = [], time.time()
    for fmt in formats:
        for family in families:
            examples = [generate(family, example_seed(family, "eval", i), args.context, dense=fmt == "dense")
                        for i in range(args.n)]
            ids = torch.tensor([e.prompt_ids + e.answer_ids for e in examples], device=args.device)
            labels = torch.tensor([example_labels(e) for e in examples], device=args.device)
            with torch.no_grad():
                plain = model(input_ids=ids, use_cache=False).logits  # the independent reference: no Kaizen path
            for name, actions in measured:
                weights = one_hot(actions, space, len(examples)).to(args.device)
                with torch.no_grad():
                    logits = model(input_ids=ids, kaizen_train=KaizenTrainForward(space, weights),
                                   use_cache=False).logits
                if name == "all16":  # 16 bits is the identity: the training forward must be the plain one
                    err = (logits - plain).abs().max().item()
                    check(err < 1e-3, f"all16 through the training forward differs from a plain forward by {err}")
                m = measure(logits, plain, labels)
                config = KaizenConfig(backbone, actions)
                rows.append({"format": fmt, "task": family, "config": name, "factor": round(config.compression(False), 4),
                             "n": len(examples), **{k: round(v, 5) for k, v in m.items()}})
                print(f"{fmt:5s} {family:6s} {name:40s} factor {rows[-1]['factor']:5.2f}  token {m['token']:.3f}  "
                      f"answer {m['answer']:.2f}  kd {m['kd']:.4f}  ({time.time() - start:.0f} s)", flush=True)
    if args.out:
        results = make_results("kaizen_layer_sensitivity", rows, device=args.device, model=args.model,
                               context=args.context, wall_seconds=round(time.time() - start, 1))
        print(write_results(args.out, results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
