"""KV-Kaizen memory and decode-speed benchmark (issue #11 item 9; run on the device machine).

    PYTHONPATH=src python benchmarks/kaizen_memory.py --out results/kaizen_memory_h200.json

A Qwen2.5-14B-shaped model with random bf16 weights at batch 1: 48 layers, 40 query heads and 8 KV heads of 128,
hidden 5120, Qwen2 (biases on q/k/v, no ``k_norm``). **The MLP and the vocabulary are cut** (``--intermediate``
2048 instead of 13824, ``--vocab`` 4096 instead of 152064) to save memory and time: the KV cache is what is
measured, and the rows record the shape (``model``). For each context length (``--contexts``, default 16k, 32k, 65k,
131k) and configuration (``--configs``):

- ``bf16``: every layer's own cache in the model dtype (``KaizenCache``, ``PlainStore``); the reference;
- ``int4``: every layer at 4 bits (``PackedStore(4)``: packed codes + one bf16 scale per stored vector);
- ``kivi2``: KIVI at 2 bits (``KIVIStore``, key groups of ``--kivi-group`` tokens, values in groups of as many
  channels, a full-precision window of ``--kivi-residual`` tokens; KIVI's defaults 32 and 128);
- ``mla_r128``: MLA latent ``r = 128`` with a decoupled RoPE key ``d_R = 64`` (the paper's 10.7x on Qwen2.5-14B).
  **The conversion is random**: every layer gets an :class:`~kvlearn.kaizen.mla_attention.MLAAttention` built as
  :func:`kvlearn.kaizen.mla.load_mla` builds it, filled with random ``kv_down`` / up-projections and a random
  orthonormal RoPE mixing ``E`` (``P = I - EᵀE``), not calibrated (a calibrated conversion of the 14B shape costs
  minutes and changes no byte or kernel). Decoding is the absorbed path (Qwen2 has no ``k_norm``): the latent is
  never expanded, except by a layer that other layers share (below). The MLA attention modules are kept next to
  the GQA ones and swapped in per row, so the other rows keep the GQA weights (``weights_bytes`` per row);
- ``share4``: groups of 4 layers, the first of each keeps a bf16 cache, the other 3 read it (``BorrowedLayer``);
- ``composed``: the three together: MLA ``r = 128`` at 4 bits, groups of 4 layers sharing (``KaizenConfig.
  evenly_shared`` on the MLA backbone; the paper's 4-bit MLX quantizer gives 152x, ours has a bf16 scale per vector).

Per row: the context (random tokens) is prefilled in chunks of ``--chunk`` tokens (:func:`kvlearn.cache.prefill`,
so the prefill peak is the cache plus one chunk's temporaries; called once per ``--progress-tokens`` tokens, each
call into the cache the earlier ones filled, printing the elapsed time: ``prefill_progress`` in the row), then
``--warmup`` + ``--decode`` tokens are decoded one at a time (fixed random tokens, no sampling). Recorded: ``peak_bytes`` (``torch.cuda.max_memory_allocated``
over the row, reset at its start; weights included, ``weights_bytes`` is what was allocated before the row),
``decode_peak_bytes`` (reset before decoding), ``cache_bytes`` (the cache's ``allocated_bytes()``: every buffer of
every layer, slot positions included), ``store_bytes`` (the K/V buffers alone), ``cost_model_bytes`` (the cost
model's prediction, ``docs/DESIGN.md`` section 8: ``KaizenConfig.cache_bytes``; for KIVI ``L · 2 n_kv d_h ·
(T (b + 2·16/G) + 16 R) / 8``, every token quantized plus the bf16 window, the layout the store allocates) and
their ratio, ``decode_ms_per_token`` (median over the timed steps of CUDA-event times around one decode forward),
``decode_wall_ms_per_token`` (host wall clock over the timed steps / steps) and ``ratio_to_bf16`` (cache bytes,
peak bytes and decode ms over the ``bf16`` row of the same context, measured in the same run: ``bf16`` always
runs first at each context). Rows carry ``method`` (= ``config``) and ``budget`` (= ``context``: every token is
kept) so that ``python -m kvlearn.results merge`` can join runs split over device calls.

Decode paths on CUDA: the packed store (``int4``, and the 4-bit anchors of ``composed``) and the KIVI store
(``kivi2``) attend their codes inside a kernel (:mod:`kvlearn.ops.packed_decode`, :mod:`kvlearn.ops.kivi_decode`: no
dequantized temporary); the MLA latent is still read back into a full-size bf16 temporary per layer and step;
:func:`kvlearn.hf.masked_attention` attends the read-back paths (bf16 included) without expanding their K/V to the
query heads.

``--smoke``: a tiny shape on the CPU in seconds (8 layers, 4 query heads, 4 KV heads of 128, hidden 128, contexts
256 and 512, prefill chunk 128, KIVI group 16 / window 32); the test runs it. ``--minutes``: no row starts after the time guard.
The file is written before the model is built and rewritten after every row, and every write lists in ``not_run``
each planned ``config@context`` row not measured yet (:func:`pending`), so a run killed from outside (a device
call's ``timeout``) leaves a file that says which rows it lacks; ``complete`` holds only when every planned row was
measured without error. ``--summarise FILE`` recomputes the summary, ``not_run`` and ``complete`` of a file (e.g.
after ``python -m kvlearn.results merge``, which keeps the first part's ``contexts`` / ``configs`` and unites the
parts' ``not_run``) from its planned grid (its ``contexts`` x ``configs``, the rows' and the ``not_run`` entries')
minus its rows.
"""

from __future__ import annotations

import argparse
import gc
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from kvlearn.cache import CompactCache, CompactLayer, KeepAllPolicy, KIVIStore, prefill
from kvlearn.errors import KVLearnError, check
from kvlearn.kaizen.actions import Backbone, KaizenConfig
from kvlearn.kaizen.cache import KaizenCache
from kvlearn.kaizen.mla_attention import MLAAttention
from kvlearn.kaizen.sharing import attach
from kvlearn.ops.quant import kivi_bits_per_element
from kvlearn.results import make_results, portable_path, write_results

CONFIGS = ("bf16", "int4", "kivi2", "mla_r128", "share4", "composed")
MLA_CONFIGS = ("mla_r128", "composed")
DESCRIPTIONS = {
    "bf16": "every layer's own cache in bf16 (PlainStore)",
    "int4": "every layer at 4 bits (PackedStore: packed codes + a bf16 scale per vector)",
    "kivi2": "KIVI 2 bits (KIVIStore: keys per channel over token groups, values per token, bf16 window)",
    "mla_r128": "MLA latent r=128 + RoPE key d_R=64 at bf16 (random conversion, absorbed decode)",
    "share4": "groups of 4 layers: one bf16 anchor, 3 layers sharing it",
    "composed": "MLA r=128 + d_R=64 at 4 bits, groups of 4 layers sharing",
}
FULL_SHAPE = dict(layers=48, hidden=5120, heads=40, kv_heads=8, head_dim=128)
SMOKE_SHAPE = dict(layers=8, hidden=128, heads=4, kv_heads=4, head_dim=128)


def shell_word(arg: str) -> str:
    """``arg`` quoted for a POSIX shell, leaving a leading ``$OUT`` / ``$TMPDIR`` (from ``portable_path``) unquoted."""
    if arg.startswith(("$OUT/", "$TMPDIR/")) and shlex.quote(arg[1:]) == arg[1:]:
        return arg
    return shlex.quote(arg)


def parse_ints(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        values = ()
    check(bool(values) and all(v >= 1 for v in values),
          f"{option} {text!r} is invalid: expected a comma list of positive integers")
    return values


def parse_configs(text: str) -> tuple[str, ...]:
    names = CONFIGS if text == "all" else tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [n for n in names if n not in CONFIGS]
    check(bool(names) and not bad, f"--configs {text!r}: unknown {', '.join(bad) or '(none given)'}; expected a comma "
                                   f"list of {', '.join(CONFIGS)} or 'all'")
    return ("bf16",) + tuple(n for n in CONFIGS if n in names and n != "bf16")  # bf16 first: the ratios' reference


def build_model(shape: dict, intermediate: int, vocab: int, max_positions: int, dtype, device, seed: int):
    """A Qwen2 model of ``shape`` with random weights in ``dtype`` on ``device`` (transformers' init, std 0.02)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=vocab, hidden_size=shape["hidden"], intermediate_size=intermediate,
                      num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                      num_key_value_heads=shape["kv_heads"], head_dim=shape["head_dim"],
                      max_position_embeddings=max_positions, rope_theta=1e6, tie_word_embeddings=False,
                      use_sliding_window=False)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    return attach(model.to(dtype).eval())


def random_mla_modules(model, rank: int, rope_dim: int, seed: int) -> list[MLAAttention]:
    """One :class:`MLAAttention` per layer (the structure :func:`kvlearn.kaizen.mla.load_mla` builds), sharing the
    layer's ``q_proj``/``k_proj``/``o_proj``, with random ``kv_down`` (std 0.02), up-projections (std ``r^-1/2``)
    and a random orthonormal RoPE mixing ``E [d_R, n_kv d_h]`` (``nope_proj = I - EᵀE``)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for layer in model.model.layers:
        attn = layer.self_attn
        w = attn.q_proj.weight
        new = MLAAttention(attn, rank, rope_dim, attn.k_proj.bias is not None)
        kv, dh = new.num_kv_heads, new.head_dim
        with torch.no_grad():
            new.kv_down.weight.copy_(torch.randn(new.kv_down.weight.shape, generator=gen) * 0.02)
            if new.kv_down.bias is not None:
                new.kv_down.bias.copy_(torch.randn(new.kv_down.bias.shape, generator=gen) * 0.02)
            for up in (new.up_k, new.up_v):
                up.copy_(torch.randn(up.shape, generator=gen) * rank ** -0.5)
            e = torch.linalg.qr(torch.randn(kv * dh, rope_dim, generator=gen, dtype=torch.float64))[0].T
            new.rope_mix.copy_(e)
            new.nope_proj.copy_(torch.eye(kv * dh, dtype=torch.float64) - e.T @ e)
        out.append(new.to(device=w.device, dtype=w.dtype).eval())
    return out


class AttentionSwap:
    """Swap every layer's attention between the GQA modules and the random MLA ones (and the config's MLA fields,
    which :meth:`Backbone.from_config` reads)."""

    def __init__(self, model, mla: list[MLAAttention], rank: int, rope_dim: int):
        self.model, self.mla, self.rank, self.rope_dim = model, mla, rank, rope_dim
        self.gqa = [layer.self_attn for layer in model.model.layers]

    def set(self, use_mla: bool) -> None:
        for layer, gqa, mla in zip(self.model.model.layers, self.gqa, self.mla):
            layer.self_attn = mla if use_mla else gqa
        cfg = self.model.config
        cfg.kv_lora_rank = self.rank if use_mla else None
        cfg.qk_rope_head_dim = self.rope_dim if use_mla else None


def make_row_cache(name: str, model, capacity: int, args) -> tuple[CompactCache, int, str]:
    """``(cache, cost-model bytes, cost-model formula)`` of configuration ``name`` for ``capacity`` slots."""
    dtype_bits = torch.finfo(model.dtype).bits
    if name == "kivi2":
        cfg = model.config
        layers = [CompactLayer(KeepAllPolicy(capacity), KIVIStore(2, args.kivi_group, args.kivi_residual))
                  for _ in range(cfg.num_hidden_layers)]
        elements = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim
        per_token = kivi_bits_per_element(2, args.kivi_group, dtype_bits)
        bits = elements * (capacity * per_token + dtype_bits * args.kivi_residual)
        formula = (f"L*2*n_kv*d_h*(T*(b + 2*{dtype_bits}/G) + {dtype_bits}*R)/8, b=2, G={args.kivi_group}, "
                   f"R={args.kivi_residual}")
        return CompactCache(layers), round(bits / 8), formula
    backbone = Backbone.from_model(model)
    config = {
        "bf16": lambda: KaizenConfig.static(backbone, 16),
        "int4": lambda: KaizenConfig.static(backbone, 4),
        "share4": lambda: KaizenConfig.evenly_shared(backbone, 4, 16),
        "mla_r128": lambda: KaizenConfig.static(backbone, 16),
        "composed": lambda: KaizenConfig.evenly_shared(backbone, 4, 4),
    }[name]()
    formula = f"KaizenConfig.cache_bytes(1, T): T * {config.bits_per_token()} bits / 8 ({config})"
    return KaizenCache(config, capacity), config.cache_bytes(1, capacity, dtype_bits), formula


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory(device) -> tuple[int, int]:
    if device.type != "cuda":
        return 0, 0
    return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)


def reset_peak(device) -> None:
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def measure(name: str, context: int, model, args, device) -> dict:
    """One row: prefill ``context`` random tokens in chunks, then decode (module docstring)."""
    reset_peak(device)
    weights_bytes = memory(device)[0]
    steps = args.warmup + args.decode
    capacity = context + steps
    gen = torch.Generator().manual_seed(context)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, context), generator=gen).to(device)
    new_ids = torch.randint(0, vocab, (steps, 1, 1), generator=gen).to(device)
    cache, cost_bytes, formula = make_row_cache(name, model, capacity, args)
    t0 = time.perf_counter()
    segment = max(args.chunk, args.progress_tokens // args.chunk * args.chunk)
    prefill_progress = []  # [tokens prefilled, seconds since the row's start] after each segment
    for a in range(0, context, segment):  # prefill into the non-empty cache, segment by segment, the same chunks
        prefill(model, cache, ids[:, a : a + segment], chunk_size=args.chunk)
        sync(device)
        prefill_progress.append([min(context, a + segment), round(time.perf_counter() - t0, 2)])
        if context > segment:  # a slow row says where its time goes (the 131k bf16 row ran past 590 s at d2a03be)
            print(f"  {name}@{context}: prefilled {prefill_progress[-1][0]} tokens in {prefill_progress[-1][1]} s",
                  flush=True)
    prefill_s = time.perf_counter() - t0
    cache_bytes, store_bytes = cache.allocated_bytes(), cache.store_bytes()
    prefill_peak = memory(device)[1]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times, wall = [], None
    with torch.no_grad():
        for i in range(steps):
            if i == args.warmup:
                sync(device)
                wall = time.perf_counter()
            pos = torch.full((1, 1), context + i, dtype=torch.long, device=device)
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                model(input_ids=new_ids[i], position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
                end.record()
                times.append((start, end))
            else:
                t = time.perf_counter()
                model(input_ids=new_ids[i], position_ids=pos, past_key_values=cache, use_cache=True, logits_to_keep=1)
                times.append((time.perf_counter() - t) * 1e3)
        sync(device)
    wall_ms = (time.perf_counter() - wall) * 1e3 / args.decode
    if device.type == "cuda":
        times = [s.elapsed_time(e) for s, e in times]
    decode_peak = memory(device)[1]
    check(cache.get_seq_length() == capacity, f"{name}: the cache saw {cache.get_seq_length()} tokens, expected "
                                              f"{capacity}")
    del cache
    return {
        "method": name, "config": name, "budget": context, "context": context, "batch": 1,
        "description": DESCRIPTIONS[name],
        "capacity": capacity,
        "peak_bytes": max(prefill_peak, decode_peak) if device.type == "cuda" else None,
        "prefill_peak_bytes": prefill_peak if device.type == "cuda" else None,
        "decode_peak_bytes": decode_peak if device.type == "cuda" else None,
        "weights_bytes": weights_bytes if device.type == "cuda" else None,
        "cache_bytes": cache_bytes, "store_bytes": store_bytes, "cost_model_bytes": cost_bytes,
        "cache_over_cost_model": cache_bytes / cost_bytes, "cost_model": formula,
        "decode_ms_per_token": statistics.median(times[args.warmup:]),
        "decode_wall_ms_per_token": wall_ms,
        "decode_steps": args.decode, "warmup_steps": args.warmup,
        "prefill_s": round(prefill_s, 3), "prefill_chunk": args.chunk, "prefill_progress": prefill_progress,
    }


def add_ratios(rows: list[dict]) -> None:
    """``ratio_to_bf16`` of every row against the ``bf16`` row of its context (same run)."""
    ref = {r["context"]: r for r in rows if r["config"] == "bf16" and "error" not in r}
    for r in rows:
        base = ref.get(r["context"])
        if base is None or "error" in r:
            r["ratio_to_bf16"] = None
            continue

        def ratio(key):
            a, b = r.get(key), base.get(key)
            return None if a is None or not b else a / b

        r["ratio_to_bf16"] = {k: ratio(k) for k in ("cache_bytes", "peak_bytes", "decode_peak_bytes",
                                                    "decode_ms_per_token")}


def summarise(rows: list[dict], contexts: tuple[int, ...]) -> dict:
    ok = [r for r in rows if "error" not in r]
    within = [abs(r["cache_over_cost_model"] - 1) <= 0.05 for r in ok]
    top = max(contexts)
    at_top = {r["config"]: r for r in ok if r["context"] == top}
    int4, bf16 = at_top.get("int4"), at_top.get("bf16")
    return {
        "cache_bytes_within_5pct_of_cost_model": all(within) if within else None,
        "max_cache_over_cost_model_deviation": max((abs(r["cache_over_cost_model"] - 1) for r in ok), default=None),
        f"int4_decode_over_bf16_at_{top}": (None if int4 is None or bf16 is None
                                            else int4["decode_ms_per_token"] / bf16["decode_ms_per_token"]),
        f"int4_decode_not_slower_than_bf16_at_{top}": (None if int4 is None or bf16 is None
                                                       else int4["decode_ms_per_token"] <= bf16["decode_ms_per_token"]),
        "decode_reads_full_size_temporary": ("PackedStore and KIVIStore decode through their kernels on CUDA "
                                             "(kvlearn.ops.packed_decode, kvlearn.ops.kivi_decode: no temporary); the "
                                             "MLA latent is read back into a full-size bf16 temporary per layer and "
                                             "decode step; masked_attention no longer expands K/V to the query heads"),
    }


def pending(plan: list[tuple[int, str]], rows: list[dict]) -> list[str]:
    """``config@context`` of every planned ``(context, config)`` that has no row (measured or failed), in plan order:
    the ``not_run`` of a file written with these rows."""
    done = {(r.get("context"), r.get("config")) for r in rows}
    return [f"{name}@{ctx}" for ctx, name in plan if (ctx, name) not in done]


def is_complete(plan: list[tuple[int, str]], rows: list[dict]) -> bool:
    """Every planned row was measured, none with an error."""
    return not pending(plan, rows) and not any("error" in r for r in rows)


def file_plan(data: dict) -> tuple[list[int], list[str], list[tuple[int, str]]]:
    """``(contexts, configs, plan)`` a results file planned: its ``contexts`` x ``configs`` (a merge keeps the first
    part's), widened by its rows' and its ``not_run`` entries' (a merge unites the parts'), contexts ascending,
    configs in :data:`CONFIGS` order (bf16 first), plan context-major as :func:`main` runs it."""
    listed = []
    for item in data.get("not_run") or []:
        name, _, ctx = str(item).rpartition("@")
        check(bool(name) and ctx.isdigit(), f"not_run entry {item!r} is not config@context")
        listed.append((int(ctx), name))
    rows = data.get("rows", [])
    contexts = sorted({int(c) for c in data.get("contexts") or []} | {r["context"] for r in rows}
                      | {c for c, _ in listed})
    names = set(data.get("configs") or []) | {r["config"] for r in rows} | {n for _, n in listed}
    configs = [n for n in CONFIGS if n in names] + sorted(names - set(CONFIGS))
    return contexts, configs, [(c, n) for c in contexts for n in configs]


def resummarise(path: str) -> int:
    """``--summarise``: the summary of the file's rows, and its ``not_run`` / ``complete`` from its planned grid
    (:func:`file_plan`) minus its rows, written back in place."""
    from kvlearn.results import read_results

    try:
        data = read_results(path)
        check(data.get("kind") == "kaizen_memory", f"{path} is not a kaizen_memory results file "
                                                   f"(kind {data.get('kind')!r})")
        contexts, configs, plan = file_plan(data)
    except (OSError, ValueError, KeyError, KVLearnError) as e:
        print(f"kaizen_memory: error: {e}", file=sys.stderr)
        return 2
    rows = data["rows"]
    data["contexts"], data["configs"] = contexts, configs
    data["not_run"] = pending(plan, rows)
    data["complete"] = is_complete(plan, rows)
    data["summary"] = summarise(rows, tuple(contexts) or (0,))
    write_results(path, data)
    print(f"rewrote the summary of {path}: {len(rows)} row(s), not run: {', '.join(data['not_run']) or 'none'}, "
          f"complete: {data['complete']}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--out", default=None, help="results file (default: results/kaizen_memory_h200.json, "
                                                "runs/smoke/kaizen_memory.json with --smoke)")
    ap.add_argument("--contexts", default="16384,32768,65536,131072", help="comma list of context lengths, in order")
    ap.add_argument("--configs", default="all", help=f"comma list of {','.join(CONFIGS)} or 'all' (bf16 always runs)")
    ap.add_argument("--decode", type=int, default=16, help="timed decode steps per row")
    ap.add_argument("--warmup", type=int, default=3, help="untimed decode steps before them")
    ap.add_argument("--chunk", type=int, default=4096, help="prefill chunk (tokens per forward)")
    ap.add_argument("--progress-tokens", type=int, default=16384,
                    help="the prefill prints its elapsed time every this many tokens (rounded to whole chunks)")
    ap.add_argument("--intermediate", type=int, default=2048, help="MLP width (Qwen2.5-14B: 13824; cut)")
    ap.add_argument("--vocab", type=int, default=4096, help="vocabulary (Qwen2.5-14B: 152064; cut)")
    ap.add_argument("--mla-rank", type=int, default=128, help="MLA latent width r")
    ap.add_argument("--rope-dim", type=int, default=64, help="MLA decoupled RoPE key width d_R")
    ap.add_argument("--kivi-group", type=int, default=32, help="KIVI group size G (tokens per key group)")
    ap.add_argument("--kivi-residual", type=int, default=128, help="KIVI full-precision window R (multiple of G)")
    ap.add_argument("--minutes", type=float, default=60.0, help="time guard: no row starts after it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny shape on the CPU (checks the script in seconds)")
    ap.add_argument("--summarise", default=None, metavar="PATH",
                    help="only recompute the summary of a results file (e.g. after merging parts), in place")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:  # argparse already printed its one-line error
        return int(e.code or 0)
    if args.summarise is not None:
        return resummarise(args.summarise)
    smoke_defaults = {"contexts": "256,512", "chunk": 128, "decode": 2, "warmup": 1, "intermediate": 128,
                      "vocab": 256, "kivi_group": 16, "kivi_residual": 32, "progress_tokens": 256}
    if args.smoke:  # smoke sizes unless given on the command line
        given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in argv if a.startswith("--")}
        for k, v in smoke_defaults.items():
            if k not in given:
                setattr(args, k, v)
    try:
        contexts = parse_ints(args.contexts, "--contexts")
        configs = parse_configs(args.configs)
        for opt in ("decode", "chunk", "intermediate", "vocab", "kivi_group", "kivi_residual", "progress_tokens"):
            check(getattr(args, opt) >= 1, f"--{opt.replace('_', '-')}={getattr(args, opt)} is invalid: expected >= 1")
        check(args.warmup >= 0, f"--warmup={args.warmup} is invalid: expected >= 0")
        check(args.kivi_residual % args.kivi_group == 0,
              f"--kivi-residual={args.kivi_residual} is invalid: expected a multiple of --kivi-group={args.kivi_group}")
        check(args.minutes >= 0, f"--minutes={args.minutes} is invalid: expected >= 0")
        shape = SMOKE_SHAPE if args.smoke else FULL_SHAPE
        if any(c in MLA_CONFIGS for c in configs):
            from kvlearn.kaizen.mla import check_rank, check_rope_dim

            check_rank(args.mla_rank, shape["kv_heads"], shape["head_dim"])
            check_rope_dim(args.rope_dim, shape["kv_heads"], shape["head_dim"])
        check(args.smoke or torch.cuda.is_available(), "this benchmark needs a CUDA device (or --smoke on the CPU)")
    except KVLearnError as e:
        print(f"kaizen_memory: error: {e}", file=sys.stderr)
        return 2

    out = Path(args.out or ("runs/smoke/kaizen_memory.json" if args.smoke else "results/kaizen_memory_h200.json"))
    device = torch.device("cpu" if args.smoke else "cuda")
    dtype = torch.bfloat16
    command = " ".join(["python", "benchmarks/kaizen_memory.py"] + [shell_word(portable_path(a)) for a in argv])
    start = time.monotonic()
    deadline = start + 60 * args.minutes
    steps = args.warmup + args.decode
    model_info = {**shape, "family": "qwen2 (random weights)", "intermediate": args.intermediate, "vocab": args.vocab,
                  "dtype": "bfloat16", "cut": "MLP and vocabulary cut (Qwen2.5-14B: intermediate 13824, vocab "
                                              "152064); attention and KV shapes are the 14B's",
                  "mla": {"rank": args.mla_rank, "rope_dim": args.rope_dim, "conversion": "random (uncalibrated)"},
                  "kivi": {"bits": 2, "group": args.kivi_group, "residual": args.kivi_residual}}
    plan = [(ctx, name) for ctx in contexts for name in configs]
    rows: list[dict] = []

    def save() -> None:
        """Write the file as it stands: every planned row without a row yet is in ``not_run`` (a kill between two
        saves leaves the truth)."""
        add_ratios(rows)
        results = make_results("kaizen_memory", rows, device=str(device), command=command, model=model_info,
                               contexts=list(contexts), configs=list(configs),
                               wall_seconds=round(time.monotonic() - start, 1), not_run=pending(plan, rows),
                               complete=is_complete(plan, rows),
                               summary=summarise(rows, contexts), torch=torch.__version__, smoke=args.smoke)
        write_results(out, results)

    save()  # before the model is built: a run killed before its first row leaves a file listing every row
    model = build_model(shape, args.intermediate, args.vocab, max(contexts) + steps + 1, dtype, device, args.seed)
    swap = None
    if any(c in MLA_CONFIGS for c in configs):
        swap = AttentionSwap(model, random_mla_modules(model, args.mla_rank, args.rope_dim, args.seed + 1),
                             args.mla_rank, args.rope_dim)
    print(f"{'config':<10} {'context':>8} {'cache MiB':>10} {'/cost':>7} {'peak MiB':>9} {'ms/token':>9}", flush=True)
    for i, (ctx, name) in enumerate(plan):
        if time.monotonic() >= deadline:  # the rows not started stay in not_run (pending)
            print(f"time guard ({args.minutes} min): {len(plan) - i} row(s) not started", flush=True)
            break
        if swap is not None:
            swap.set(name in MLA_CONFIGS)
        try:
            row = measure(name, ctx, model, args, device)
        except Exception as exc:  # noqa: BLE001 - one failing row (e.g. out of memory) must not lose the others
            import traceback

            traceback.print_exc()
            row = {"method": name, "config": name, "budget": ctx, "context": ctx,
                   "error": f"{type(exc).__name__}: {exc}"[:400]}
        finally:
            if swap is not None:
                swap.set(False)
        rows.append(row)
        save()
        if "error" in row:
            print(f"{name:<10} {ctx:>8} error: {row['error']}", flush=True)
        else:
            peak = "-" if row["peak_bytes"] is None else f"{row['peak_bytes'] / 2**20:.0f}"
            print(f"{name:<10} {ctx:>8} {row['cache_bytes'] / 2**20:>10.1f} {row['cache_over_cost_model']:>7.4f} "
                  f"{peak:>9} {row['decode_ms_per_token']:>9.2f}", flush=True)
    save()
    print(f"wrote {out} ({time.monotonic() - start:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
