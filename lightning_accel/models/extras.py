"""Importing the optional libraries a model builder needs, with the install line when one is missing.

``model=hf_causal_lm`` needs transformers and ``model=litgpt`` needs litgpt; both come
with the ``hf`` extra. The builder modules import their library when they are imported,
so ``lightning-accel validate`` (which imports every ``_target_``) reports a missing one
as one line before any run starts, instead of a traceback minutes into it.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

from lightning_accel.config.errors import UserError


class MissingExtraError(UserError, ImportError):
    """An optional library is not installed; the message says which extra brings it."""


def import_extra(module: str, extra: str, needed_by: str) -> ModuleType:
    """``importlib.import_module(module)``, or :class:`MissingExtraError` naming ``extra``.

    Only the library itself being absent is translated; an import error from inside an
    installed library (a broken install, a version clash) keeps its own message.
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name != module.split(".")[0]:
            raise
        raise MissingExtraError(
            f'{needed_by} needs {module.split(".")[0]}, which is not installed; it comes with the {extra} extra: '
            f'pip install "lightning-accel[{extra}]"'
        ) from None


def plain(value: Any) -> Any:
    """``value`` with every mapping a dict and every list a list, recursively.

    Hydra hands a builder its nested config as OmegaConf containers; transformers' config
    dataclasses type-check their fields (``rope_parameters`` must be a ``dict``).
    """
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [plain(v) for v in value]
    return value
