"""Temporarily replacing a method on one instance, and putting it back.

Several mechanisms wrap one object's method, either for the length of a block
(:func:`swapped`: the optimizer's ``step`` during a host update) or from a setup call to a
teardown call (:func:`patch`: a block's ``forward`` from a strategy's setup to its teardown).
Doing it by hand invites a subtle bug: an instance may already carry its own attribute of
that name (an LR scheduler wraps ``optimizer.step`` on the instance; accelerate's hooks set
``module.forward`` on the instance), which must come back as it was, while a method that
came from the class must leave no instance attribute behind (else a later class-level
patch, or pickling, sees a stale bound method). Both helpers share that one restore rule.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

__all__ = ["Patch", "patch", "remove_all", "swapped"]

_MISSING = object()


class Patch:
    """One instance attribute set by :func:`patch`; :meth:`remove` puts back what was there.

    Like torch's hook handles: keep it, call ``remove()`` at teardown (more than once is
    harmless). Several patches of one attribute are removed in the reverse order of
    setting them, as nested ``with`` blocks would be.
    """

    def __init__(self, obj: Any, name: str, value: Any) -> None:
        self.obj, self.name = obj, name
        self._own = vars(obj).get(name, _MISSING)
        self._removed = False
        setattr(obj, name, value)

    def remove(self) -> None:
        """Restore the instance's own attribute if it had one, else delete the instance
        attribute (the class's method shows through again)."""
        if self._removed:
            return
        self._removed = True
        if self._own is _MISSING:
            vars(self.obj).pop(self.name, None)
        else:
            setattr(self.obj, self.name, self._own)


def patch(obj: Any, name: str, value: Any) -> Patch:
    """Set ``obj.<name> = value`` until the returned handle's ``remove()``."""
    return Patch(obj, name, value)


def remove_all(patches: list[Patch]) -> None:
    """Remove every patch in ``patches``, the last set first (as nested ``with`` blocks would unwind, so that two
    patches of one attribute restore the first one's original), and empty the list."""
    for installed in reversed(patches):
        installed.remove()
    patches.clear()


@contextmanager
def swapped(obj: Any, name: str, value: Any) -> Iterator[None]:
    """Set ``obj.<name> = value`` inside the block, then restore as :meth:`Patch.remove` does."""
    handle = patch(obj, name, value)
    try:
        yield
    finally:
        handle.remove()
