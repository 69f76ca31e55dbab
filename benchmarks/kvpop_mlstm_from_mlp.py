"""Build an mLSTM KVpop student that starts where a trained MLP student ends (issue #10, the mLSTM's gap at CR 88%).

The mLSTM scorer with its skip connection scores ``r̂_u = aᵀ SiLU(Norm(h_{u|q})) + b + w2ᵀ SiLU(W1ᵀ x_u + b1)``,
and its skip path has the MLP scorer's form on the same input ``x_u = [k_u; v_u]`` (docs/DESIGN.md section 5,
"The skip connection"). So an MLP student converts exactly: its backbone and decays are copied, its scorer's
``W1, b1, w2`` become the skip path's and its output bias ``b2`` the readout bias ``b``, and the readout weight
``a`` stays 0 (its initialisation): the converted student's scores equal the MLP student's token for token, and the
memory readout enters only as a retrofit (``kvlearn retrofit --init-student <this folder> --scorer mlstm``) trains
``a``. The mLSTM's own projections start as a fresh scorer's (seed ``--seed``).

    python benchmarks/kvpop_mlstm_from_mlp.py --mlp-student checkpoints/testbed-kvpop --out $WORK_DIR/mlstm-from-mlp

The output is a model folder ``kvlearn.load`` reads (with ``--state-in-budget 1``, Table 1's rule: the cache keeps
``ceil(S / T)`` fewer long-range slots for the state), holding the MLP student's tokenizer files and teacher record.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from kvlearn import KVLearnError  # noqa: E402
from kvlearn.errors import check  # noqa: E402

# MLP scorer parameter -> mLSTM scorer parameter (the rest of the mLSTM keeps its initialisation)
MLP_TO_MLSTM = {"w1": "skip_w1", "b1": "skip_b1", "w2": "skip_w2", "b2": "b"}


def convert(mlp_student: str, out: str, state_in_budget: bool = True, seed: int = 0):
    """Write the converted student to ``out`` and return it (float32). One-line errors for a folder that is no MLP
    KVpop student."""
    import kvlearn
    from kvlearn.kvpop.apply import apply_kvpop, recorded_config

    mlp = kvlearn.load(mlp_student, dtype=torch.float32)
    recorded = recorded_config(mlp)
    check(recorded is not None, f"--mlp-student {mlp_student!r} has no KVpop modules: expected a KVpop student folder")
    check(recorded.scorer == "mlp", f"--mlp-student {mlp_student!r} has scorer {recorded.scorer!r}: expected 'mlp'")
    config = dataclasses.replace(recorded, scorer="mlstm", mlstm_skip=True, state_in_budget=bool(state_in_budget))
    model = kvlearn.load(mlp_student, dtype=torch.float32)
    for layer in model.model.layers:  # a plain backbone: the MLP modules go, the mLSTM ones come fresh
        del layer.self_attn.kvpop
    delattr(model.config, "kvpop")
    torch.manual_seed(seed)
    apply_kvpop(model, config)
    source = mlp.state_dict()
    target = model.state_dict()
    with torch.no_grad():
        for name, tensor in target.items():
            if ".kvpop.scorer." in name:
                continue
            check(name in source and source[name].shape == tensor.shape,
                  f"{name}: not in the MLP student, or of another shape")
            tensor.copy_(source[name])  # backbone and decays
        for layer_idx, layer in enumerate(model.model.layers):
            scorer = layer.self_attn.kvpop.scorer
            for mlp_name, mlstm_name in MLP_TO_MLSTM.items():
                value = source[f"model.layers.{layer_idx}.self_attn.kvpop.scorer.{mlp_name}"]
                param = getattr(scorer, mlstm_name)
                check(param is not None and param.shape == value.shape,
                      f"layer {layer_idx}: the mLSTM's {mlstm_name} does not fit the MLP's {mlp_name} "
                      f"{tuple(value.shape)} (expected the skip path's hidden width = the MLP's)")
                param.copy_(value)
            check(bool((scorer.a == 0).all()), "the mLSTM readout weight a must start at 0")
    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "teacher.json"):
        if (Path(mlp_student) / name).exists():
            shutil.copy2(Path(mlp_student) / name, out_dir / name)
    return model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mlp-student", default=str(REPO / "checkpoints" / "testbed-kvpop"), help="a trained MLP KVpop student")
    ap.add_argument("--out", required=True, help="folder of the converted mLSTM student")
    ap.add_argument("--state-in-budget", type=int, choices=(0, 1), default=1,
                    help="count the mLSTM state toward the budget (Table 1's rule; default 1)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the mLSTM's fresh projections")
    args = ap.parse_args(argv)
    try:
        convert(args.mlp_student, args.out, bool(args.state_in_budget), args.seed)
    except KVLearnError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
