"""How much the KV-Kaizen sharing mask depends on which calibration rows the sensitivity pass draws.

    python benchmarks/kaizen_share_sensitivity_spread.py --model checkpoints/testbed-teacher --seeds 0,1,2,3 \
        --rows 16 --threshold 0.2 --out results/raw/NAME.json

``kvlearn kaizen-train --share-layers auto`` lets the selector share layer ``l``'s cache only when sharing it raises
the distillation loss by at most ``--share-threshold`` nats per token on ``--share-rows`` calibration rows
(:mod:`kvlearn.kaizen.share_sensitivity`). Those rows come from a stream seed. This script runs the pass for each of
``--seeds`` (``--rows`` rows each) and reports per seed each layer's increase, its standard error over the rows
(:func:`~kvlearn.kaizen.share_sensitivity.increase_stats`) and the layers allowed at ``--threshold``; then the same
over every seed's rows together (the pooled estimate), and the layers whose allowed status differs between seeds.

The model runs in float32 on ``--device`` (``cpu`` by default: the testbed teacher's 16 rows of 4,096 tokens take
about two minutes a seed on two cores); the device's pass runs under bf16 autocast, which moves the increases in
the third decimal.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from kvlearn.errors import KVLearnError, check  # noqa: E402
from kvlearn.kaizen.share_sensitivity import (allowed_share_layers, calibration_rows, increase_stats,  # noqa: E402
                                              share_row_increases)
from kvlearn.results import make_results, portable_path, write_results  # noqa: E402


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(part) for part in text.split(",")]
    except ValueError:
        raise KVLearnError(f"--seeds {text!r} is invalid: expected a comma list of integers >= 0") from None
    check(len(seeds) > 0 and all(s >= 0 for s in seeds) and len(set(seeds)) == len(seeds),
          f"--seeds {text!r} is invalid: expected distinct integers >= 0")
    return seeds


def spread(model, seeds: list[int], rows: int, seq_len: int, threshold: float, batch_size: int = 2,
           kd_topk: int = 256) -> dict:
    """The per-seed and pooled sensitivity reports (module docstring) of ``model`` (Kaizen attention attached)."""
    per_seed, all_increases, all_tokens = [], [], []
    for seed in tqdm(seeds, desc="sensitivity pass per seed", unit="seed"):
        ids, labels = calibration_rows(rows, seq_len, seed)
        row_increases, tokens = share_row_increases(model, ids, labels, kd_topk, batch_size)
        increases, errors = increase_stats(row_increases, tokens)
        per_seed.append({"seed": seed, "increases": rounded(increases), "standard_errors": rounded(errors),
                         "allowed": list(allowed_share_layers(increases, threshold))})
        all_increases.append(row_increases)
        all_tokens.append(tokens)
    increases, errors = increase_stats(torch.cat(all_increases, dim=1), torch.cat(all_tokens))
    pooled = {"seeds": seeds, "rows": rows * len(seeds), "increases": rounded(increases),
              "standard_errors": rounded(errors), "allowed": list(allowed_share_layers(increases, threshold))}
    layers = len(increases)
    flips = [l for l in range(1, layers) if len({l in s["allowed"] for s in per_seed}) > 1]
    return {"per_seed": per_seed, "pooled": pooled, "layers_whose_mask_differs_between_seeds": flips}


def rounded(values: list[float | None]) -> list[float | None]:
    return [None if v is None else round(v, 6) for v in values]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", default=str(REPO / "checkpoints" / "testbed-teacher"), help="the dense model's folder")
    ap.add_argument("--seeds", default="0,1,2,3", help="calibration stream seeds, one pass each")
    ap.add_argument("--rows", type=int, default=16, help="calibration rows per seed (kaizen-train --share-rows)")
    ap.add_argument("--seq-len", type=int, default=4096, help="tokens per row (kaizen-train --seq-len)")
    ap.add_argument("--threshold", type=float, default=0.2, help="nats per token (kaizen-train --share-threshold)")
    ap.add_argument("--batch-size", type=int, default=2, help="rows per forward")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--out", required=True, help="results JSON")
    args = ap.parse_args(argv)
    try:
        seeds = parse_seeds(args.seeds)
        check(args.rows >= 2, f"--rows {args.rows} is invalid: expected >= 2 (a standard error needs two rows)")
        check(args.seq_len >= 16, f"--seq-len {args.seq_len} is invalid: expected >= 16")
        check(args.threshold >= 0, f"--threshold {args.threshold} is invalid: expected >= 0 nats per token")
        check(args.batch_size >= 1, f"--batch-size {args.batch_size} is invalid: expected >= 1")
        from kvlearn.checkpoint import load
        from kvlearn.kaizen.sharing import attach

        model = attach(load(args.model, dtype=torch.float32, device=args.device)).eval()
    except KVLearnError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    start = time.monotonic()
    report = spread(model, seeds, args.rows, args.seq_len, args.threshold, args.batch_size)
    results = make_results("share_sensitivity_spread", [], device=args.device, model=portable_path(args.model),
                           threshold=args.threshold, seq_len=args.seq_len, rows_per_seed=args.rows,
                           wall_seconds=round(time.monotonic() - start, 1), **report)
    write_results(args.out, results)
    for s in report["per_seed"]:
        print(f"seed {s['seed']}: " + " ".join(f"{v:.3f}±{e:.3f}" for v, e in zip(s["increases"][1:],
                                                                                s["standard_errors"][1:]))
              + f"  allowed {s['allowed']}")
    p = report["pooled"]
    print(f"pooled ({p['rows']} rows): " + " ".join(f"{v:.3f}±{e:.3f}" for v, e in zip(p["increases"][1:],
                                                                                        p["standard_errors"][1:]))
          + f"  allowed {p['allowed']}")
    print(f"layers whose mask differs between seeds: {report['layers_whose_mask_differs_between_seeds']}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
