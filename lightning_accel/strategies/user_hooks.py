"""Which of Lightning's hooks the user's code overrides, and what it calls there: where a strategy must show what
Lightning shows (or refuse, before the first step, what it cannot)."""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden


def overrides(module: pl.LightningModule | None, *hooks: str) -> bool:
    """Whether ``module`` or one of its Trainer's callbacks overrides one of ``hooks`` (e.g. ``"on_after_backward"``,
    where Lightning shows every gradient)."""
    if module is None:
        return False
    trainer = module._trainer
    owners = [module, *(trainer.callbacks if trainer is not None else [])]
    return any(is_overridden(hook, owner) for hook in hooks for owner in owners)


def calls_in(module: Any, hook: str, method: str) -> bool:
    """Whether the user's own ``hook`` of ``module`` (its class's, not Lightning's default) calls a method named ``method``
    (``self.all_gather(...)``), read from its source before it runs. Code it cannot read (no source: a REPL, compiled)
    and calls made through helpers are not seen: a strategy that refuses on this also guards the call itself."""
    function = getattr(type(module), hook, None)
    if function is None or not is_overridden(hook, module):
        return False
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return False
    return any(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == method
               for node in ast.walk(tree))
