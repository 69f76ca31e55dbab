"""How far a GQA -> MLA conversion (:func:`kvlearn.kaizen.mla.convert_to_mla`) moves the logits, on tiny random models.

    PYTHONPATH=src python benchmarks/mla_conversion_error.py --out results/mla_conversion_error.json

Tiny random models (2 layers, 2 KV heads of 16, 4 query heads; Qwen3 with k_norm and q_norm weights drawn in
[0.25, 2], Llama without q/k norm), float32 on the CPU, calibrated on 4 x 64 random tokens and evaluated on 2 x 40
others (the same setting as ``tests/kaizen/test_mla_conversion.py``). One row per (model, variant, measurement):

* ``rope_dim`` sweep: ``d_R`` in 8 / 16 / 24 / 32 at the full latent ``r = 64``;
* ``width`` sweep: one conversion at ``r = 64``, ``d_R = 16`` served at every latent prefix ``d`` in 8 / 16 / 32 / 64.

``error`` is the relative logits error ``||logits_MLA - logits_GQA|| / ||logits_GQA||``. Random weights say little
about trained models; the file documents the approximation's shape (it falls with ``d_R`` and ``d``, and CARE beats
plain SVD), not its size on a real model.
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from kvlearn.kaizen import sharing  # noqa: E402
from kvlearn.kaizen.actions import Backbone, KaizenConfig  # noqa: E402
from kvlearn.kaizen.mla import convert_to_mla  # noqa: E402
from kvlearn.results import make_results, write_results  # noqa: E402

VOCAB, KV, HEAD_DIM = 64, 2, 16
FULL_RANK = 2 * KV * HEAD_DIM


def tiny(kind: str, seed: int = 3):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=KV, head_dim=HEAD_DIM, max_position_embeddings=256, attn_implementation="sdpa")
    if kind == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**kw)).eval()
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.k_norm.weight.uniform_(0.25, 2.0)
                layer.self_attn.q_norm.weight.uniform_(0.25, 2.0)
        return model
    return LlamaForCausalLM(LlamaConfig(**kw)).eval()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@torch.no_grad()
def sweep(kind: str, variant: str) -> list[dict]:
    base = tiny(kind)
    g = torch.Generator().manual_seed(5)
    cal, ids = torch.randint(0, VOCAB, (4, 64), generator=g), torch.randint(0, VOCAB, (2, 40), generator=g)
    ref = base(input_ids=ids).logits
    rows = []
    for rope_dim in (8, 16, 24, 32):
        model = convert_to_mla(copy.deepcopy(base), rope_dim, cal, rank=FULL_RANK, variant=variant)
        rows.append({"model": kind, "variant": variant, "sweep": "rope_dim", "rope_dim": rope_dim, "rank": FULL_RANK,
                     "width": FULL_RANK, "error": round(rel(model(input_ids=ids).logits, ref), 6)})
    model = sharing.attach(convert_to_mla(copy.deepcopy(base), 16, cal, rank=FULL_RANK, variant=variant))
    backbone = Backbone.from_model(model)
    for d in backbone.widths:
        out = model(input_ids=ids, kaizen_config=KaizenConfig.static(backbone, rank=d), use_cache=False).logits
        rows.append({"model": kind, "variant": variant, "sweep": "width", "rope_dim": 16, "rank": FULL_RANK,
                     "width": d, "error": round(rel(out, ref), 6)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="results/mla_conversion_error.json", help="results file")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = [r for kind in ("qwen3", "llama") for variant in ("svd", "care") for r in sweep(kind, variant)]
    for r in rows:
        print(f"{r['model']:6} {r['variant']:4} {r['sweep']:8} d_R={r['rope_dim']:2} d={r['width']:2}  {r['error']:.4f}")
    write_results(args.out, make_results("mla_conversion_error", rows, device="cpu",
                                         command="python benchmarks/mla_conversion_error.py --out " + args.out))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
