"""Every rank of a multi-process run composes its own config: one that differs from rank 0's is refused by name.

Lightning starts the other ranks of a DDP or pipeline run by re-running the command line through Hydra
(``lightning_accel.cli.RECIPE_ENV``), so each rank composes the recipe again, in its own environment: an
``${oc.env:...}`` value, a file the recipe reads or a package version can make its composition differ from the one
rank 0 checked. Each rank therefore runs preflight itself (cheap: the network is built on the meta device), and
compares its composition with rank 0's before the process group exists, so before any collective work:

- rank 0 :func:`publish`\\ es the fingerprint of its composed config (every key's resolved value, Hydra's own node
  left out: each rank's run directory and job name differ by design) in :data:`CONFIG_ENV`, which the ranks it starts
  inherit;
- a re-launched rank :func:`check_rank`\\ s its own against it: a different hash is a ``UserError`` naming the rank and
  the first keys that differ.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_accel.config.errors import UserError

__all__ = ["CONFIG_ENV", "check_rank", "fingerprint", "publish"]

CONFIG_ENV = "LIGHTNING_ACCEL_CONFIG"
_MAX_KEYS_BYTES = 64 * 1024  # an environment variable holds ~128 KiB on Linux: past this only the hash travels


def _flat(node: Any, prefix: str = "") -> dict[str, str]:
    if isinstance(node, Mapping):
        out: dict[str, str] = {}
        for key, value in node.items():
            out.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
        return out or {prefix: "{}"}
    if isinstance(node, list):
        return {prefix: json.dumps(node, sort_keys=True, default=str)}
    return {prefix: json.dumps(node, default=str)}


def fingerprint(cfg: DictConfig) -> dict[str, str]:
    """Every key of ``cfg`` but Hydra's (dotted) with its resolved value as JSON; a value that cannot be resolved
    outside a run (``${hydra:...}``) is taken as written."""
    from hydra.core.hydra_config import HydraConfig

    run_cfg = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"])
    previous = HydraConfig.instance().cfg
    if "hydra" in cfg:  # ${hydra:...} resolves against this composition's own Hydra node
        HydraConfig.instance().set_config(cfg)
    try:
        container = OmegaConf.to_container(run_cfg, resolve=True)
    except Exception:
        container = OmegaConf.to_container(run_cfg, resolve=False)
    finally:
        HydraConfig.instance().cfg = previous
    return _flat(container)


def _digest(keys: Mapping[str, str]) -> str:
    return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:16]


def publish(cfg: DictConfig, environ: dict[str, str] | None = None) -> str:
    """Rank 0: put ``cfg``'s fingerprint in :data:`CONFIG_ENV` for the ranks it starts; returns its hash."""
    keys = fingerprint(cfg)
    digest = _digest(keys)
    payload = {"sha256": digest, "keys": keys}
    text = json.dumps(payload, sort_keys=True)
    if len(text) > _MAX_KEYS_BYTES:
        text = json.dumps({"sha256": digest})
    (os.environ if environ is None else environ)[CONFIG_ENV] = text
    return digest


def _rank_name(environ: Mapping[str, str]) -> str:
    local, node = environ.get("LOCAL_RANK", "?"), environ.get("NODE_RANK", "0")
    return f"rank {local}" if node in ("", "0") else f"local rank {local} of node {node}"


def check_rank(cfg: DictConfig, environ: Mapping[str, str] | None = None) -> None:
    """A re-launched rank: refuse a composition whose hash differs from the one rank 0 published (nothing to compare
    when rank 0 published none, e.g. under torchrun, where every process is started alike)."""
    environ = os.environ if environ is None else environ
    text = environ.get(CONFIG_ENV)
    if not text:
        return
    theirs = json.loads(text)
    mine = fingerprint(cfg)
    if _digest(mine) == theirs.get("sha256"):
        return
    who = _rank_name(environ)
    known = theirs.get("keys")
    if isinstance(known, dict):
        differ = [k for k in sorted(set(mine) | set(known)) if mine.get(k) != known.get(k)]
        shown = "; ".join(f"{k}={mine.get(k, '(absent)')} here, {known.get(k, '(absent)')} on rank 0" for k in differ[:3])
        more = f" (and {len(differ) - 3} more)" if len(differ) > 3 else ""
        what = f": {shown}{more}"
    else:
        what = f" (config hash {_digest(mine)} here, {theirs.get('sha256')} on rank 0)"
    raise UserError(
        f"{who} composes the recipe differently from rank 0{what}; start every rank with the same overrides and "
        "environment (an ${oc.env:...} value, a file the recipe reads), or set the value on the command line"
    )
