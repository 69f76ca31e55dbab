"""A long prompt prefilled in one forward through a KVpop cache (what ``generate`` does): the visibility mask
against sparse retention over one sequence (``cache.chunk_attention``, :func:`kvlearn.hf.sparse_chunk_attention`).

A randomly initialised Qwen3 of a named shape (default Qwen3-0.6B's: 28 layers, 8 KV heads of 128, 16 query
heads; the testbed vocabulary), bf16, with KVpop modules (random scorers, ``--scorer``, budget ``--budget`` with
sinks 4 and window ``--window``). Per context length ``T``, batch 1, the same prompt: one forward of ``T`` tokens into
an empty cache under ``"mask"`` (the ``[1, kv_heads, T, budget + T]`` boolean mask, SDPA over ``budget + T`` keys in
query chunks) and under ``"sparse"`` (the fused Triton forward on the gathered layout), and the harness's path for
reference (``kvlearn.cache.prefill`` in chunks of 256 under the mask). Each row: the median wall time of
``--repeats`` calls after one warm-up (CUDA-synchronised, the rows interleaved per round), the peak memory above
what was allocated before the call, and, against the mask row, the largest logit difference and the share of
positions whose greedy token agrees, and whether the cache holds the same positions after the forward (exactly in
float32; in bf16 the first layer must, and deeper layers may differ where rounding reorders near-tied scores:
``leading_layers_holding_the_mask_positions``). A mode whose call took longer than ``--row-seconds`` skips the longer
contexts; the results file is written after every context (``partial`` until the last).

    PYTHONPATH=src python benchmarks/kvpop_prefill_attention.py --out results/kvpop_prefill_attention_h200.json
    PYTHONPATH=src python benchmarks/kvpop_prefill_attention.py --smoke   # tiny model on the CPU
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "benchmarks"))

from kvlearn.cache import prefill  # noqa: E402
from kvlearn.config import KVpopConfig  # noqa: E402
from kvlearn.errors import KVLearnError, check, check_int  # noqa: E402
from kvlearn.results import command_line, make_results, portable_path, write_results  # noqa: E402
from step_timing import GIB, SHAPES, model_shape  # noqa: E402

MODES = ("mask", "sparse", "chunked256")


def parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen3-0.6b", help=f"one of {', '.join(s for s in SHAPES if s != 'tiny')}")
    ap.add_argument("--contexts", default="4096,16384,32768", help="comma-separated prompt lengths")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--scorer", default="mlstm", choices=("mlp", "mlstm"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--row-seconds", type=float, default=10.0, help="skip a mode's longer contexts once one call "
                    "of it took longer than this")
    ap.add_argument("--smoke", action="store_true", help="tiny random model on the CPU (checks the script)")
    ap.add_argument("--out", default=None, help="default results/kvpop_prefill_attention_h200.json "
                    "(--smoke: runs/smoke/kvpop_prefill_attention.json)")
    args = ap.parse_args(argv)
    if args.smoke:
        args.shape, args.contexts, args.budget, args.window, args.repeats = "tiny", "96,160", 24, 8, 1
    check(args.shape in SHAPES, f"--shape={args.shape!r} is unknown: expected one of {', '.join(SHAPES)}")
    try:
        args.contexts = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        raise KVLearnError(f"--contexts={args.contexts!r} is invalid: expected comma-separated integers") from None
    check_int("--budget", args.budget, 8)
    check_int("--window", args.window, 1)
    check(args.window + 4 <= args.budget, f"--window={args.window} is invalid: expected <= budget - 4 = {args.budget - 4}")
    for c in args.contexts:
        check(c > args.budget, f"--contexts value {c} is invalid: expected more than --budget={args.budget} tokens")
    check_int("--repeats", args.repeats, 1)
    args.out = args.out or str(REPO / ("runs/smoke" if args.smoke else "results") /
                               ("kvpop_prefill_attention.json" if args.smoke else "kvpop_prefill_attention_h200.json"))
    return args


def build_model(shape: str, kv: KVpopConfig, device: torch.device, dtype: torch.dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kvlearn.kvpop.apply import apply_kvpop
    from kvlearn.testbed.tokenizer import VOCAB_SIZE

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB_SIZE, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=True, **{**SHAPES[shape], "max_position_embeddings": 1 << 17})
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype).eval()
    apply_kvpop(model, kv)
    with torch.no_grad():  # random scorers whose scores spread: the top-k differs from recency
        for layer in model.model.layers:
            for p in layer.self_attn.kvpop.scorer.parameters():
                p.normal_(0.0, 0.5)
    return model


def held_positions(cache) -> torch.Tensor:
    """``[layers, batch, kv_heads, capacity]`` held positions of every layer, each sorted."""
    return torch.stack([layer.slot_positions.long().sort(dim=2).values for layer in cache.layers])


def leading_equal_layers(held: torch.Tensor, ref: torch.Tensor) -> int:
    """How many layers from the first hold exactly the positions ``ref`` holds (``[layers, ...]`` each). In bf16 a
    layer's keys depend on the earlier layers' attention outputs, whose rounding differs between executions, so the
    deeper layers' near-tied scores may order differently; the first layer's keys do not depend on attention."""
    same = [bool(torch.equal(a, b)) for a, b in zip(held, ref)]
    return same.index(False) if False in same else len(same)


def run(args, command: str) -> int:
    from kvlearn.kvpop.apply import make_kvpop_cache

    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.float32 if args.smoke else torch.bfloat16
    kv = KVpopConfig(sinks=4, window=args.window, topk=args.budget - 4 - args.window, scorer=args.scorer)
    model = build_model(args.shape, kv, device, dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def call(mode: str, ids: torch.Tensor):
        cache = make_kvpop_cache(model)
        with torch.no_grad():
            if mode == "chunked256":
                cache.chunk_attention = "mask"
                logits = prefill(model, cache, ids, chunk_size=256)[:, None]
            else:
                cache.chunk_attention = mode
                logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        return logits, held_positions(cache)

    rows, slow, failed = [], set(), set()  # slow: skip the longer contexts; failed: also this context's rounds
    start = time.perf_counter()
    for T in args.contexts:
        g = torch.Generator().manual_seed(T)
        ids = torch.randint(3, model.config.vocab_size, (1, T), generator=g).to(device)
        modes = [m for m in MODES if m not in slow]
        times = {m: [] for m in modes}
        peaks, outputs = {}, {}
        for r in range(args.repeats + 1):  # round 0: warm-up (compiles, autotunes); rotated order per round
            for m in modes[r % len(modes):] + modes[:r % len(modes)]:
                if m in failed:
                    continue
                sync()
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
                t0 = time.perf_counter()
                try:
                    logits, held = call(m, ids)
                    sync()
                except torch.OutOfMemoryError as err:
                    rows.append(dict(context=T, mode=m, error=f"out of memory: {str(err).splitlines()[0]}"))
                    slow.add(m)
                    failed.add(m)
                    continue
                seconds = time.perf_counter() - t0
                if r == 0:
                    outputs[m] = (logits[:, -1].float(), logits.float() if m != "chunked256" else None, held)
                    if device.type == "cuda":
                        peaks[m] = (torch.cuda.max_memory_allocated() - base) / GIB
                else:
                    times[m].append(seconds * 1000)
                if seconds > args.row_seconds:  # this context's rounds still run: its timing is complete
                    slow.add(m)
                del logits
        ref_last, ref_all, ref_held = outputs.get("mask", (None, None, None))
        for m in modes:
            if m not in outputs:
                continue
            last, full, held = outputs[m]
            row = dict(context=T, mode=m, ms=round(statistics.median(times[m]), 2) if times[m] else None,
                       calls=len(times[m]), peak_gib_above_model=round(peaks[m], 3) if m in peaks else None)
            if ref_last is not None:
                row["max_abs_diff_last_logits_vs_mask"] = float((last - ref_last).abs().max())
                row["same_held_positions_as_mask"] = bool(torch.equal(held, ref_held))
                row["leading_layers_holding_the_mask_positions"] = leading_equal_layers(held, ref_held)
                if full is not None:
                    row["max_abs_diff_logits_vs_mask"] = float((full - ref_all).abs().max())
                    row["greedy_agreement_vs_mask"] = float((full.argmax(-1) == ref_all.argmax(-1)).float().mean())
            rows.append(row)
            print(row, flush=True)
        outputs.clear()
        save(args, rows, model, kv, dtype, device, command, start, partial=T != args.contexts[-1])
    return 0


def save(args, rows, model, kv, dtype, device, command, start, partial) -> None:
    """Write the rows so far (after every context, so that a timeout keeps the finished ones)."""
    summary = {}
    for T in args.contexts:
        by = {r["mode"]: r for r in rows if r["context"] == T and r.get("ms")}
        if "mask" in by and "sparse" in by:
            summary[f"sparse_over_mask_ms_at_{T}"] = round(by["sparse"]["ms"] / by["mask"]["ms"], 3)
            if by["mask"].get("peak_gib_above_model"):
                summary[f"sparse_over_mask_peak_at_{T}"] = round(
                    by["sparse"]["peak_gib_above_model"] / by["mask"]["peak_gib_above_model"], 3)
            summary[f"sparse_same_held_positions_at_{T}"] = by["sparse"].get("same_held_positions_as_mask")
            summary[f"sparse_leading_layers_holding_the_mask_positions_at_{T}"] = by["sparse"].get(
                "leading_layers_holding_the_mask_positions")
    results = make_results("speed", rows, device=str(device), command=command, shape=model_shape(model.config),
                           kvpop=dict(sinks=kv.sinks, window=kv.window, topk=kv.topk, scorer=kv.scorer),
                           dtype=str(dtype).removeprefix("torch."), wall_seconds=round(time.perf_counter() - start, 1),
                           summary=summary, partial=partial)
    write_results(args.out, results)
    print(f"wrote {portable_path(args.out)}{' (partial)' if partial else ''}: {summary}")


def main(argv=None) -> int:
    command = command_line() if argv is None else " ".join(
        ["python", "benchmarks/kvpop_prefill_attention.py"] + [portable_path(a) for a in argv])
    try:
        return run(parse(sys.argv[1:] if argv is None else argv), command)
    except KVLearnError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
