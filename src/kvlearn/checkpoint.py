"""``kvlearn.load``: a checkpoint folder back as a model, with the modules a method added restored.

:func:`kvlearn.hf.load_model` loads the base model (and checks the folder); a checkpoint saved after
:func:`kvlearn.kvpop.apply.apply_kvpop` records ``kvpop`` in its ``config.json``, and then KVpop is re-applied and its
scorer and decay weights loaded (:func:`kvlearn.kvpop.apply.load_kvpop`). A checkpoint saved after
:func:`kvlearn.dms.apply.apply_dms` records ``dms``: DMS is re-applied and its gate weights loaded
(:func:`kvlearn.dms.apply.load_dms`). One saved with a KV-Kaizen selector records ``kaizen``, and the selector is
re-attached with its weights (:func:`kvlearn.kaizen.apply.load_kaizen`); one converted to MLA records
``kvlearn_mla_variant`` and its MLA attention is rebuilt (:func:`kvlearn.kaizen.mla.load_mla`). A
``streaming_plus`` checkpoint has no added modules (it loads as a plain model). Keeping this here leaves ``hf`` free of any method.
"""

from __future__ import annotations

import json
import os

import torch

from .hf import load_model


def serving_dtype(device: str | torch.device) -> torch.dtype:
    """The dtype a checkpoint is served in on ``device`` by ``kvlearn eval`` and the table scripts: bf16 weights and
    activations on CUDA, float32 elsewhere. Checkpoint selection validates in it too (``kaizen_train.validate``)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def load(path: str | os.PathLike, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"):
    """The model saved in the folder ``path`` (``save_pretrained``), in eval mode, with KVpop re-applied when it was
    saved with it. Bad folders are one-line :class:`~kvlearn.errors.KVLearnError` s (see
    :func:`kvlearn.hf.load_model`)."""
    config_path = os.path.join(os.fspath(path), "config.json")
    recorded = dms = kaizen = mla = None
    if os.path.isfile(config_path):
        try:
            with open(config_path, encoding="utf-8") as f:
                saved = json.load(f)
            recorded, dms, kaizen = saved.get("kvpop"), saved.get("dms"), saved.get("kaizen")
            mla = saved.get("kvlearn_mla_variant")
        except (ValueError, UnicodeDecodeError, AttributeError):
            recorded = dms = kaizen = mla = None  # load_model reports the bad config in one line
    extra = (".kvpop." if recorded is not None else ".dms." if dms is not None
             else "kaizen_selector." if kaizen is not None else None)
    dropped: tuple[str, ...] = ()
    if mla is not None:
        from .kaizen.mla import MLA_PARAMS

        extra, dropped = MLA_PARAMS + ((extra,) if extra else ()), (".self_attn.v_proj.",)
    model = load_model(path, dtype=dtype, device=device, extra_keys=extra, dropped_keys=dropped)
    if mla is not None:  # a GQA -> MLA conversion (kaizen/mla.py): rebuild the MLA attention first
        from .kaizen.mla import load_mla

        load_mla(model, path)
    if recorded is not None:
        from .kvpop.apply import load_kvpop

        load_kvpop(model, path)
    if dms is not None:
        from .dms.apply import load_dms

        load_dms(model, path)
    if kaizen is not None:
        from .kaizen.apply import load_kaizen

        load_kaizen(model, path)
    return model
