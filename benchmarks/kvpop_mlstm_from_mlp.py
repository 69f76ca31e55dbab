"""Build an mLSTM KVpop student that starts where a trained MLP student ends (issue #10, the mLSTM's gap at CR 88%).

The mLSTM scorer with its skip connection scores ``r̂_u = aᵀ SiLU(Norm(h_{u|q})) + b + w2ᵀ SiLU(W1ᵀ x_u + b1)``,
and its skip path has the MLP scorer's form on the same input ``x_u = [k_u; v_u]`` (docs/DESIGN.md section 5,
"The skip connection"). So an MLP student converts exactly: its backbone and decays are copied, its scorer's
``W1, b1, w2`` become the skip path's and its output bias ``b2`` the readout bias ``b``, and the readout weight
``a`` stays 0 (its initialisation): the converted student's scores equal the MLP student's token for token, and the
memory readout enters only as a retrofit (``kvlearn retrofit --init-student <this folder> --scorer mlstm``) trains
``a``. The mLSTM's own projections start as a fresh scorer's (seed ``--seed``).

    python benchmarks/kvpop_mlstm_from_mlp.py --mlp-student checkpoints/testbed-kvpop --out $WORK_DIR/mlstm-from-mlp

Two ablations of a trained mLSTM student (what a retrofit from the converted student changed), each written as a model
folder beside it:

    python benchmarks/kvpop_mlstm_from_mlp.py --zero-readout STUDENT --out DIR      # its readout weight a set to 0
    python benchmarks/kvpop_mlstm_from_mlp.py --graft-scorers FROM --student STUDENT --out DIR
                                                        # STUDENT's backbone with FROM's scorers and decays

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
    from kvlearn.kvpop.apply import CONFIG_KEY, MODULE_NAME, apply_kvpop, attention_modules, recorded_config

    model = kvlearn.load(mlp_student, dtype=torch.float32)
    recorded = recorded_config(model)
    check(recorded is not None, f"--mlp-student {mlp_student!r} has no KVpop modules: expected a KVpop student folder")
    check(recorded.scorer == "mlp", f"--mlp-student {mlp_student!r} has scorer {recorded.scorer!r}: expected 'mlp'")
    config = dataclasses.replace(recorded, scorer="mlstm", mlstm_skip=True, state_in_budget=bool(state_in_budget))
    source = {k: v.clone() for k, v in model.state_dict().items()}  # the MLP student's weights
    for attn in attention_modules(model):  # a plain backbone: the MLP modules go, the mLSTM ones come fresh
        delattr(attn, MODULE_NAME)
    delattr(model.config, CONFIG_KEY)
    torch.manual_seed(seed)
    apply_kvpop(model, config)
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
    _save(model, mlp_student, out)
    return model


def _save(model, source: str, out: str) -> None:
    """``model`` into folder ``out`` with ``source``'s tokenizer files and teacher record (the teacher is unchanged)."""
    from kvlearn.hf import copy_tokenizer_files
    from kvlearn.lineage import TEACHER_FILE

    out_dir = Path(out)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    copy_tokenizer_files(source, out_dir)
    if (Path(source) / TEACHER_FILE).exists():
        shutil.copy2(Path(source) / TEACHER_FILE, out_dir / TEACHER_FILE)


def _kvpop_student(path: str, what: str):
    import kvlearn
    from kvlearn.kvpop.apply import recorded_config

    model = kvlearn.load(path, dtype=torch.float32)
    recorded = recorded_config(model)
    check(recorded is not None, f"{what} {path!r} has no KVpop modules: expected a KVpop student folder")
    return model, recorded


def zero_readout(student: str, out: str):
    """``student`` (an mLSTM KVpop student) with every layer's readout weight ``a`` set to 0, written to ``out``: its
    scores are then ``b`` plus the skip path alone (the memory no longer enters)."""
    model, recorded = _kvpop_student(student, "--zero-readout")
    check(recorded.scorer == "mlstm", f"--zero-readout {student!r} has scorer {recorded.scorer!r}: expected 'mlstm'")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.kvpop.scorer.a.zero_()
    _save(model, student, out)
    return model


def graft_scorers(scorers_from: str, student: str, out: str):
    """``student``'s backbone with the scorers and decays of ``scorers_from`` (the same scorer settings), written to
    ``out``: whether a backbone still serves the scorers another one was trained with."""
    model, recorded = _kvpop_student(student, "--student")
    donor, donor_config = _kvpop_student(scorers_from, "--graft-scorers")
    check(donor_config.scorer == recorded.scorer and donor_config.mlstm_skip == recorded.mlstm_skip,
          f"--graft-scorers {scorers_from!r} has scorer {donor_config.scorer!r} (skip {donor_config.mlstm_skip}), "
          f"--student {student!r} {recorded.scorer!r} (skip {recorded.mlstm_skip}): expected the same")
    source = donor.state_dict()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if ".kvpop." in name:
                tensor.copy_(source[name])
    _save(model, student, out)
    return model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mlp-student", default=str(REPO / "checkpoints" / "testbed-kvpop"), help="a trained MLP KVpop student")
    ap.add_argument("--out", required=True, help="folder of the converted mLSTM student (or of the ablation)")
    ap.add_argument("--zero-readout", default=None, metavar="STUDENT",
                    help="instead: write this mLSTM student with its readout weight a set to 0")
    ap.add_argument("--graft-scorers", default=None, metavar="FROM",
                    help="instead: write --student's backbone with FROM's scorers and decays")
    ap.add_argument("--student", default=None, help="the backbone of --graft-scorers")
    ap.add_argument("--state-in-budget", type=int, choices=(0, 1), default=1,
                    help="count the mLSTM state toward the budget (Table 1's rule; default 1)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the mLSTM's fresh projections")
    args = ap.parse_args(argv)
    try:
        check(not (args.zero_readout and args.graft_scorers), "--zero-readout and --graft-scorers: expected one of them")
        if args.zero_readout:
            zero_readout(args.zero_readout, args.out)
        elif args.graft_scorers:
            check(args.student is not None, "--graft-scorers needs --student (the backbone)")
            graft_scorers(args.graft_scorers, args.student, args.out)
        else:
            convert(args.mlp_student, args.out, bool(args.state_in_budget), args.seed)
    except KVLearnError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
