"""Where the Hydra config tree and the recipes live, installed or in a checkout.

``conf/`` and ``recipes/`` sit at the top of the repository; the wheel maps them to the
data packages ``lightning_accel.conf`` and ``lightning_accel.recipes`` (see
pyproject.toml), so an installed package reads them through importlib.resources and a
source checkout reads the directories beside the package.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

_CHECKOUT_ROOT = Path(__file__).resolve().parents[2]


def _data_dir(package: str, checkout_name: str) -> Path:
    try:
        path = Path(str(importlib.resources.files(package)))
    except ModuleNotFoundError:  # a plain source checkout on sys.path, nothing installed
        path = _CHECKOUT_ROOT / checkout_name
    if not path.is_dir():
        raise FileNotFoundError(
            f"lightning_accel's {checkout_name}/ directory is missing (looked in {path}); "
            "reinstall the package: pip install --force-reinstall lightning-accel"
        )
    return path


def conf_dir() -> Path:
    """The directory holding the Hydra config groups (trainer/, model/, data/, ...)."""
    return _data_dir("lightning_accel.conf", "conf")


def recipes_dir() -> Path:
    """The directory holding one YAML per ready recipe."""
    return _data_dir("lightning_accel.recipes", "recipes")
