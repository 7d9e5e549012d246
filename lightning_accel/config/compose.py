"""Finding recipes by name or path and composing them with overrides.

A recipe is a primary Hydra config (``recipes/NAME.yaml``) whose defaults start with the
base ``train`` config from ``conf/``; ``conf/`` joins Hydra's search path through the
``hydra.searchpath`` override, so the same override list works for composition here and
for a real Hydra run in :mod:`lightning_accel.cli` (which adds the one override this
composition implies: :data:`lightning_accel.config.pretrained.RUN_OVERRIDE`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from lightning_accel.config.errors import UserError, close_matches, missing_file_line
from lightning_accel.config.locate import conf_dir, recipes_dir
from lightning_accel.config.schema import register_schemas


def recipe_names() -> list[str]:
    """Names of the shipped recipes, sorted."""
    return sorted(p.stem for p in recipes_dir().glob("*.yaml"))


def resolve_recipe(recipe: str) -> Path:
    """The YAML file for a recipe name (``gpt-tiny_cpu``) or a path to a recipe file."""
    as_path = Path(recipe).expanduser()
    if recipe.endswith((".yaml", ".yml")) or as_path.parent != Path("."):
        if not as_path.is_file():
            raise UserError(missing_file_line("recipe file", recipe, "pass a recipe name (see `lightning-accel ls`) or an existing YAML path"))
        if as_path.suffix not in (".yaml", ".yml"):
            raise UserError(f"recipe file '{recipe}' is not a .yaml file (Hydra reads a recipe from NAME.yaml); pass a recipe name "
                            f"(see `lightning-accel ls`) or a YAML path, e.g. lightning-accel cp gpt-tiny_cpu my.yaml to start one")
        return as_path.resolve()
    shipped = recipes_dir() / f"{recipe}.yaml"
    if shipped.is_file():
        return shipped
    names = recipe_names()
    raise UserError(f"unknown recipe '{recipe}'{close_matches(recipe, names)}; `lightning-accel ls` lists the {len(names)} recipes")


def searchpath_override() -> str:
    """The override that puts ``conf/`` (the config groups) on Hydra's search path."""
    return f"hydra.searchpath=[file://{conf_dir()}]"


def compose_recipe(recipe: str | Path, overrides: Sequence[str] = (), *, with_hydra: bool = False,
                   notes: list[str] | None = None) -> DictConfig:
    """Compose a recipe as a run would, without running it. A ``model.net.pretrained_path`` replaces the recipe's
    ``model.net.config`` (:mod:`lightning_accel.config.pretrained`); ``notes`` gets the line saying so."""
    from lightning_accel.config.pretrained import use_directory_config

    path = resolve_recipe(str(recipe))
    register_schemas()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(path.parent), version_base="1.3"):
        cfg = compose(
            config_name=path.stem,
            overrides=[*overrides, searchpath_override()],
            return_hydra_config=with_hydra,
        )
    note = use_directory_config(cfg, overrides)
    if note is not None and notes is not None:
        notes.append(note)
    return cfg
