"""Importing the optional libraries a model builder needs, with the install line when one is missing.

``model=hf_causal_lm`` needs transformers and ``model=litgpt`` needs litgpt; both come
with the ``hf`` extra. The builder modules import their library when they are imported,
so ``lightning-accel validate`` (which imports every ``_target_``) reports a missing one
as one line before any run starts, instead of a traceback minutes into it.
"""

from __future__ import annotations

import importlib
from types import ModuleType

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
