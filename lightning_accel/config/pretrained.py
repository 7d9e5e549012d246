"""A ``pretrained_path`` brings its own config: ``lightning-accel run RECIPE model.net.pretrained_path=DIR``.

An hf recipe writes its base's architecture as ``model.net.config`` (random weights, nothing downloaded). A user who
names a ``save_pretrained`` directory means that checkpoint, whose ``config.json`` is the architecture, so at
composition, where Hydra's overrides are known, :func:`use_directory_config` drops the recipe's config for the
directory's (:func:`lightning_accel.models.hf.hf_causal_lm` then loads it) and returns the one line the run prints.
What the user set on the command line is told from what the recipe wrote by those overrides: a key of
``model.net.config`` set there (``model.net.config.hidden_size=64``, or a whole ``model.net.config={...}``) must agree
with ``config.json``, or it is refused in one line naming both values. The recipe's own keys describe its random base
and are not compared.

The CLI hands the run ``model.net.config=null`` (:data:`RUN_OVERRIDE`) after these checks, so the run's own
composition, the ranks it starts and the run directory's ``.hydra`` record are the one the checks saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

__all__ = ["RUN_OVERRIDE", "takes_directory_config", "use_directory_config"]

RUN_OVERRIDE = "model.net.config=null"
_NODE = "model.net.config"


def _hf_net(cfg: DictConfig) -> DictConfig | None:
    net = OmegaConf.select(cfg, "model.net", default=None)
    if not isinstance(net, DictConfig) or not str(net.get("_target_") or "").endswith("hf_causal_lm"):
        return None
    return net


def takes_directory_config(cfg: DictConfig) -> bool:
    """Whether ``cfg`` loads a ``pretrained_path`` through ``hf_causal_lm`` with no config of its own (what the run
    composes once :data:`RUN_OVERRIDE` is added)."""
    net = _hf_net(cfg)
    return net is not None and net.get("pretrained_path") is not None and net.get("config") is None


def _user_keys(overrides: Sequence[str]) -> list[str]:
    """The keys of ``model.net.config`` that ``overrides`` set (``model.net.config.KEY=...``, or those a
    ``model.net.config={...}`` names)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    keys: list[str] = []
    for override in OverridesParser.create().parse_overrides([o for o in overrides if _NODE in o]):
        name = override.key_or_group
        value = override.value() if not override.is_delete() else None
        if name == _NODE and isinstance(value, dict):  # merged into the recipe's: the keys it names
            keys += [str(k) for k in value]
        elif name.startswith(f"{_NODE}."):
            keys.append(name.split(".")[3])
    return list(dict.fromkeys(keys))


def use_directory_config(cfg: DictConfig, overrides: Sequence[str]) -> str | None:
    """Drop the recipe's ``model.net.config`` when ``model.net.pretrained_path`` names a directory, after checking what
    the user set against its ``config.json``; the line saying so, or None when there is nothing to replace."""
    net = _hf_net(cfg)
    if net is None or net.get("pretrained_path") is None or net.get("config") is None:
        return None
    from lightning_accel.models.hf import directory_config

    path = Path(str(net.pretrained_path))
    given: dict[str, Any] = {k: OmegaConf.select(net, f"config.{k}") for k in _user_keys(overrides)}
    given = {k: OmegaConf.to_container(v, resolve=True) if OmegaConf.is_config(v) else v for k, v in given.items()}
    architecture = directory_config(path, given)
    with open_dict(cfg):
        net.config = None
    return f"model.net.pretrained_path={str(path)!r}: its config.json ({architecture}) replaces the recipe's model.net.config"
