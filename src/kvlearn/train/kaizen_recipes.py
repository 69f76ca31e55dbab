"""Named KV-Kaizen training recipes: the settings of the runs of record, one name each, so that a user asks for
``kvlearn kaizen-train --recipe 8x`` instead of copying nine options from the docs.

A recipe is a dict of :class:`kvlearn.train.kaizen_train.KaizenTrainConfig` fields; options given on the command
line (or fields given to the config in Python) take precedence over it::

    from kvlearn.train.kaizen_train import KaizenTrainConfig, kaizen_train
    from kvlearn.train.kaizen_recipes import kaizen_recipe
    kaizen_train(KaizenTrainConfig(model="checkpoints/testbed-teacher", out="runs/k8", device="cuda",
                                   **kaizen_recipe("8x")))

Only recipes whose every setting was run on the device with the current trainer are listed (``docs/DESIGN.md``
section 8, "Recipes")."""

from __future__ import annotations

from ..errors import check

__all__ = ["KAIZEN_RECIPES", "SECOND_STAGE", "FIRST_STAGE", "kaizen_recipe", "recipe_options"]

_EIGHT_X = {"targets": (8.0,), "dense_fraction": 0.25, "underuse_weight": 1.0, "share_layers": "auto",
            "share_threshold": 0.2, "lr": 1e-4, "ema_decay": 0.998, "family_weights": (2.0, 1.0, 1.0, 1.0)}

KAIZEN_RECIPES: dict[str, dict] = {
    # the first stage of the 8x recipe of record: a fixed 4,000 steps alone on the GPU
    "8x": {**_EIGHT_X, "steps": 4000},
    # its second stage: 3,000 more steps from the first stage's final/ (or export), at the end temperature
    "8x-refine": {**_EIGHT_X, "steps": 3000, "tau_start": 0.1},
}
SECOND_STAGE = {"8x": "8x-refine"}  # a first stage -> the recipe that continues its final/ (needs init_student)
FIRST_STAGE = {second: first for first, second in SECOND_STAGE.items()}  # the second stages: their first stage


def kaizen_recipe(name: str) -> dict:
    """A copy of recipe ``name``'s config fields; an unknown name is a one-line error listing the recipes."""
    check(name in KAIZEN_RECIPES, f"recipe {name!r} is unknown: expected one of {', '.join(KAIZEN_RECIPES)}")
    return dict(KAIZEN_RECIPES[name])


OPTION_OF_FIELD = {"targets": "--target", "steps": "--steps", "dense_fraction": "--dense-fraction",
                   "underuse_weight": "--underuse-weight", "share_layers": "--share-layers",
                   "share_threshold": "--share-threshold", "lr": "--lr", "ema_decay": "--ema-decay",
                   "family_weights": "--family-weights", "tau_start": "--tau-start"}


def recipe_options(name: str) -> str:
    """Recipe ``name`` as ``kvlearn kaizen-train`` options (``--target 8 --steps 4000 --dense-fraction 0.25 ...``):
    what ``--recipe name`` stands for, for the help and the docs."""
    def text(value) -> str:
        if isinstance(value, tuple):
            return ",".join(text(v) for v in value)
        return f"{value:g}" if isinstance(value, float) else str(value)

    return " ".join(f"{OPTION_OF_FIELD[field]} {text(value)}" for field, value in kaizen_recipe(name).items())
