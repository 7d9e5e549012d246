"""Recipes composed once per test process and edited per case: a composition costs ~0.3 s, one job's checks
(:func:`lightning_accel.config.preflight.check_job`) 0.02-0.2 s, so a table of bad values edits copies of a few
compositions instead of composing each case."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from lightning_accel.config.compose import compose_recipe, resolve_recipe

_COMPOSED: dict[tuple[str, ...], DictConfig] = {}


def composed(recipe: str, groups: tuple[str, ...] = ()) -> DictConfig:
    """A copy of ``recipe`` composed with group selections (``strategy=gpipe``), Hydra's node included."""
    key = (recipe, *groups)
    if key not in _COMPOSED:
        _COMPOSED[key] = compose_recipe(recipe, list(groups), with_hydra=True)
    return _COMPOSED[key].copy()


def edited(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """Hydra's ``key=value`` / ``+key=value`` / ``~key`` applied to a composed config, values parsed as Hydra parses them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for text in overrides:
        override = parser.parse_override(text)
        key = override.key_or_group
        with open_dict(cfg):
            if override.is_delete():
                parent, _, leaf = key.rpartition(".")
                del (OmegaConf.select(cfg, parent) if parent else cfg)[leaf]
            else:
                OmegaConf.update(cfg, key, override.value(), merge=False, force_add=override.is_add())
    return cfg


def job(recipe: str, overrides: list[str]) -> tuple[DictConfig, Path]:
    """``recipe`` with ``overrides``: group selections composed (cached), the rest edited in; and the recipe's file."""
    groups = tuple(o for o in overrides if "=" in o and "." not in o.split("=", 1)[0] and not o.startswith(("+", "~")))
    return edited(composed(recipe, groups), [o for o in overrides if o not in groups]), resolve_recipe(recipe)
