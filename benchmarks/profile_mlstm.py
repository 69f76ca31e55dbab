"""Where the mLSTM scorer's forward+backward spends its GPU time (torch.profiler, CUDA kernels by total time).

    PYTHONPATH=src python benchmarks/profile_mlstm.py --out mlstm_profile.txt

Sizes of the ops benchmark: batch 1, 8 KV heads, T = 16384, head dim 128, window 256, the scorer's defaults
(compiled on CUDA). Prints and writes the top kernels table, then the matmuls grouped by their input shapes (which
matmul of the scorer each kernel time belongs to: the projection, the chunk products, the chunk-state sums), for the
operand precision ``--matmul-dtype`` (default float32; ``tf32``: every float32 matmul of the compiled scorer TF32,
the projection included); a diagnosis aid, not a results file.
"""

from __future__ import annotations

import argparse
import sys

import torch

from kvlearn.kvpop.scorers import MLSTMScorer


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="mlstm_profile.txt")
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--matmul-dtype", default="float32", help="MLSTMScorer(matmul_dtype=): float32, tf32 or bfloat16")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("this profile needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    B, H, T, D, w = 1, 8, 16384, 128, 256
    k = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
    scorer = MLSTMScorer(H, D, window=w, matmul_dtype=args.matmul_dtype).cuda()
    for p in scorer.parameters():
        if p.abs().sum() == 0:
            torch.nn.init.normal_(p, std=0.02)

    def step():
        scorer(k, v).square().mean().backward()

    for _ in range(5):  # compile and warm up
        step()
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, record_shapes=True) as prof:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.rows, max_name_column_width=70)
    print(table)
    by_shape = [e for e in prof.key_averages(group_by_input_shape=True) if e.key in ("aten::bmm", "aten::mm")]
    by_shape.sort(key=lambda e: -e.device_time_total)
    lines = [f"{'op':<10} {'calls':>5} {'device ms (10 steps)':>20}  input shapes"]
    lines += [f"{e.key:<10} {e.count:>5} {e.device_time_total / 1e3:>20.3f}  {e.input_shapes}" for e in by_shape[:args.rows]]
    shapes = "\n".join(lines)
    print(shapes)
    with open(args.out, "w") as f:
        f.write(f"torch {torch.__version__}, 10 steps of MLSTMScorer({H}, {D}, window={w}, matmul_dtype="
                f"{args.matmul_dtype!r}) fwd+bwd at T={T}\n{table}\n\nmatmuls by input shape\n{shapes}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
