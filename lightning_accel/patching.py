"""Temporarily replacing a method on one instance, and putting it back.

Several mechanisms wrap one object's method for the length of a block (the optimizer's
``step`` during a host update, a block's ``forward`` during a pipeline run). Doing it by
hand invites a subtle bug: an instance may already carry its own attribute of that name
(an LR scheduler wraps ``optimizer.step`` on the instance), which must come back as it
was, while a method that came from the class must leave no instance attribute behind
(else a later class-level patch, or pickling, sees a stale bound method).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["swapped"]


@contextmanager
def swapped(obj: Any, name: str, value: Any) -> Iterator[None]:
    """Set ``obj.<name> = value`` inside the block; afterwards restore the instance's own
    attribute if it had one, else delete the instance attribute (the class's method shows
    through again)."""
    missing = object()
    own = vars(obj).get(name, missing)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if own is missing:
            vars(obj).pop(name, None)
        else:
            setattr(obj, name, own)
