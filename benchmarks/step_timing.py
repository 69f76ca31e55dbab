"""The timing harness the step benchmarks share (``retrofit_step_speed.py``, ``kaizen_overheads.py``): a timed
callable with its row (:class:`Timed`), warm-up then interleaved rounds (:func:`measure`), and random models of a
named shape with the testbed vocabulary (:func:`random_model_folder`).

Every ratio these benchmarks report is measured in one process under the same machine conditions: each callable is
warmed up on its own (compiles), then the timed calls are interleaved in rounds, the order rotated per round; CUDA
events after a synchronize (the host clock on the CPU), the median per row. A callable that raises is recorded in
its row and dropped, and the others go on.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

GIB = 2**30
SHAPES = {  # Qwen3Config fields; vocabulary: the testbed tokenizer's
    "qwen3-0.6b": dict(num_hidden_layers=28, hidden_size=1024, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, max_position_embeddings=40960),
    "qwen3-1.7b": dict(num_hidden_layers=28, hidden_size=2048, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=6144, max_position_embeddings=40960),
    "tiny": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 intermediate_size=96, max_position_embeddings=512),  # --smoke
}
SHAPE_KEYS = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "intermediate_size", "vocab_size")


def random_model_folder(shape: str, folder: Path, tokenizer_from: str, device: torch.device) -> str:
    """A randomly initialised ``Qwen3ForCausalLM`` of ``SHAPES[shape]`` with the testbed vocabulary, saved to
    ``folder`` with ``tokenizer_from``'s tokenizer files: a checkpoint folder the trainers load as they load a
    trained teacher."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kvlearn.hf import copy_tokenizer_files
    from kvlearn.testbed.tokenizer import VOCAB_SIZE

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB_SIZE, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                         tie_word_embeddings=True, **SHAPES[shape])
    with torch.device(device):
        model = Qwen3ForCausalLM(config)
    model.save_pretrained(folder)
    copy_tokenizer_files(tokenizer_from, folder)
    return str(folder)


def model_shape(config) -> dict:
    """The shape fields of a Hugging Face model config, for a results file."""
    return {k: getattr(config, k) for k in SHAPE_KEYS}


class Timed:
    """One timed callable ``fn()`` (returning the call's log values, or None): its times (ms), memory and row.

    ``fields``: the row's fixed entries; ``memory``: track the peak memory on CUDA (``peak_memory_gib``: the
    process's peak during the calls, every model of the run resident; ``step_peak_memory_gib``: that peak above
    what was allocated before the call); ``first_key``: the row's name for the first call's seconds."""

    def __init__(self, name: str, fn: Callable[[], dict | None], fields: dict, memory: bool = False,
                 first_key: str = "first_call_s"):
        self.name, self.fn, self.fields, self.memory, self.first_key = name, fn, fields, memory, first_key
        self.ms, self.log, self.error = [], None, None
        self.first_call_s = self.peak = self.step_peak = 0.0

    def call(self) -> None:
        self.log = self.fn()

    def timed(self, device: torch.device) -> float:
        """Milliseconds of one call (CUDA events after a synchronize; the host clock on the CPU)."""
        if device.type != "cuda":
            t0 = time.perf_counter()
            self.call()
            return (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        if self.memory:
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        self.call()
        end.record()
        torch.cuda.synchronize()
        if self.memory:
            peak = torch.cuda.max_memory_allocated()
            self.peak, self.step_peak = max(self.peak, peak / GIB), max(self.step_peak, (peak - base) / GIB)
        return start.elapsed_time(end)

    def row(self) -> dict:
        row = {"name": self.name, **self.fields, self.first_key: round(self.first_call_s, 3),
               "steps_timed": len(self.ms)}
        if self.ms:
            row.update(ms=statistics.median(self.ms), ms_min=min(self.ms), ms_steps=[round(t, 3) for t in self.ms])
        if self.peak:
            row.update(peak_memory_gib=round(self.peak, 3), step_peak_memory_gib=round(self.step_peak, 3))
        if self.log is not None:
            row["last_step"] = self.log
        if self.error:
            row["error"] = self.error
        return row

    def fail(self, exc: BaseException) -> None:
        """Record ``exc`` and drop the callable (and what it holds; the other rows go on)."""
        import traceback

        traceback.print_exc()
        self.error, self.fn = f"{type(exc).__name__}: {exc}"[:400], None
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def warm_up(t: Timed, warmup: int) -> None:
    """``warmup`` untimed calls of ``t`` (the first one's seconds kept as ``t.first_call_s`` unless already set); a
    failure is recorded on ``t`` (:meth:`Timed.fail`), never raised: the other rows go on."""
    t0 = time.perf_counter()
    try:
        for i in range(warmup):
            t.call()
            if i == 0 and not t.first_call_s:
                t.first_call_s = time.perf_counter() - t0
    except Exception as exc:  # noqa: BLE001 - one failing callable must not cost the others' rows
        t.fail(exc)


def measure(timed: list[Timed], warmup: int, steps: int, steps_per_round: int, device: torch.device,
            save: Callable[..., object]) -> None:
    """Warm each of ``timed`` up on its own (``warmup`` calls), then time ``steps`` calls of each in interleaved
    rounds of ``steps_per_round`` (the order rotated per round), calling ``save(partial=True)`` after each round."""
    for t in timed:
        t0 = time.perf_counter()
        warm_up(t, warmup)
        print(f"warm-up {t.name}: {time.perf_counter() - t0:.1f} s{' FAILED' if t.error else ''}", flush=True)
    for r in range(math.ceil(steps / steps_per_round)):
        live = [t for t in timed if t.error is None]
        if not live:
            break
        for t in live[r % len(live):] + live[:r % len(live)]:
            try:
                for _ in range(min(steps_per_round, steps - len(t.ms))):
                    t.ms.append(t.timed(device))
            except Exception as exc:  # noqa: BLE001
                t.fail(exc)
        print(f"round {r}: " + ", ".join(f"{t.name} {t.ms[-1]:.2f} ms" for t in timed if t.ms and t.error is None),
              flush=True)
        save(partial=True)


def measure_one_resident(keys: list, build: Callable[[object], Timed], reference, warmup: int, steps: int,
                         device: torch.device, save: Callable[..., object], records: list[Timed]) -> None:
    """Time rows that do not fit in memory together: one row's model resident at a time. The phases are the
    ``reference`` row, then each other key followed by the reference again (``ref, a, ref, b, ref, ...``); a phase
    builds its row (``build(key)``: a fresh :class:`Timed` whose model is created now), warms it up (``warmup``
    calls), times ``steps`` calls and drops the row's model before the next phase builds its own. A key's times
    accumulate over its phases in one record (appended to ``records``, the list ``save`` reads, on its first phase),
    so the reference's median is over every phase around the others; ``save(partial=True)`` after each phase."""
    order = [reference] + [k for key in keys if key != reference for k in (key, reference)]
    by_key: dict = {}
    for key in order:
        t = build(key)
        rec = by_key.setdefault(key, t)
        if rec is t:
            records.append(t)
        elif rec.error is None:
            rec.fn = t.fn
        del t
        if rec.error is None:
            t0 = time.perf_counter()
            warm_up(rec, warmup)
            try:
                for _ in range(steps if rec.error is None else 0):
                    rec.ms.append(rec.timed(device))
            except Exception as exc:  # noqa: BLE001 - one failing row must not cost the others' rows
                rec.fail(exc)
            print(f"phase {rec.name}: {time.perf_counter() - t0:.1f} s" + (" FAILED" if rec.error else
                  f", median so far {statistics.median(rec.ms):.2f} ms"), flush=True)
        rec.fn = None  # the row's model goes before the next phase builds its own
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save(partial=True)


# ----------------------------------------------------------------------------------------------------------------
# the command line both benchmarks share: the model source, the timing counts, the device and the output

DEFAULT_MODEL = "checkpoints/testbed-teacher"


def add_source_options(ap, out_name: str) -> None:
    """``--model`` / ``--shape`` / ``--smoke`` (the model source), ``--warmup``, ``--steps``, ``--steps-per-round``,
    ``--seed``, ``--device`` and ``--out`` (default named after ``out_name``)."""
    ap.add_argument("--model", default=None, help=f"teacher checkpoint folder (default {DEFAULT_MODEL})")
    ap.add_argument("--shape", default=None, help="qwen3-0.6b or qwen3-1.7b: a random teacher of that Qwen3's shape "
                                                  "(testbed vocabulary) instead of --model")
    ap.add_argument("--warmup", type=int, default=None, help="untimed calls per row first (default 3; --smoke 1)")
    ap.add_argument("--steps", type=int, default=None, help="timed calls per row (default 10; --smoke 2)")
    ap.add_argument("--steps-per-round", type=int, default=2, help="calls of each row per interleaved round")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default=None, help="default cuda (--smoke: cpu)")
    ap.add_argument("--smoke", action="store_true", help="tiny random model on the CPU (checks the script)")
    ap.add_argument("--out", default=None, help=f"default results/{out_name}_h200.json (--shape qwen3-0.6b: "
                    f"results/{out_name}_0p6b_h200.json, and so on; --smoke: runs/smoke/{out_name}.json)")


def resolve_source(args, defaults: dict, out_name: str, repo: Path) -> None:
    """Check the options of :func:`add_source_options` and fill what was left out (in place): ``args.source``
    (``None`` = ``--model``, a shape of :data:`SHAPES` such as ``"qwen3-0.6b"``, ``"tiny"`` = ``--smoke``), every option named in
    ``defaults[source]`` (``{name: value}``) that is still None, ``args.model``, ``args.device``, ``args.out``."""
    from kvlearn.errors import check, check_int

    shapes = [s for s in SHAPES if s != "tiny"]
    check(args.shape in (None, *shapes), f"--shape={args.shape!r} is unknown: expected {', '.join(shapes)}")
    source = "tiny" if args.smoke else args.shape
    check(not (source and args.model), f"--model and {'--smoke' if args.smoke else '--shape'} exclude each other: "
          "the latter times a random model")
    for name, value in defaults[source].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    args.source, args.model = source, args.model or str(repo / DEFAULT_MODEL)
    args.device = args.device or ("cpu" if args.smoke else "cuda")
    for name, low in (("warmup", 0), ("steps", 1), ("steps_per_round", 1)):
        check_int(f"--{name.replace('_', '-')}", getattr(args, name), low)
    check(args.device == "cpu" or torch.cuda.is_available(),
          f"--device={args.device} requested but CUDA is not available: run on the GPU (or --smoke on the CPU)")
    if args.out is None:  # --model: results/<out_name>_h200.json; qwen3-0.6b: results/<out_name>_0p6b_h200.json
        if source is None:
            args.out = f"results/{out_name}_h200.json"
        elif source == "tiny":
            args.out = f"runs/smoke/{out_name}.json"
        else:
            args.out = f"results/{out_name}_{source.removeprefix('qwen3-').replace('.', 'p')}_h200.json"


def run_main(out_name: str, argv: list[str] | None, parse: Callable, run: Callable) -> int:
    """A benchmark's ``main``: the recorded command (repository-relative), ``parse`` then ``run(args, tmp,
    command)`` in a temporary folder; a :class:`kvlearn.KVLearnError` is one line on stderr and exit code 2."""
    import sys
    import tempfile

    from kvlearn.errors import KVLearnError
    from kvlearn.results import command_line, portable_path

    command = command_line() if argv is None else " ".join(
        ["python", f"benchmarks/{out_name}.py"] + [portable_path(a) for a in argv])
    try:
        args = parse(sys.argv[1:] if argv is None else argv)
        with tempfile.TemporaryDirectory(prefix=f"{out_name}-") as tmp:
            return run(args, Path(tmp), command)
    except KVLearnError as e:
        print(f"{out_name}: error: {e}", file=sys.stderr)
        return 2


def results_saver(out: str, timed: list[Timed], summarize: Callable[[list[dict]], dict], device: torch.device,
                  command: str, fields: dict, start: float) -> Callable[..., dict]:
    """``save(partial)``: the rows of ``timed`` (as they are at the call) with ``summarize(rows)`` written to
    ``out`` as a ``speed`` results file (``partial`` until the last call; ``start``: the run's ``perf_counter``)."""
    from kvlearn.results import make_results, write_results

    def save(partial: bool) -> dict:
        rows = [t.row() for t in timed]
        results = make_results("speed", rows, device=str(device), command=command, **fields,
                               wall_seconds=round(time.perf_counter() - start, 1), summary=summarize(rows),
                               partial=partial)
        write_results(out, results)
        return results

    return save
