"""Bytes alive while a computation runs: a dispatch mode that counts every storage an op creates.

Under :class:`LiveBytes` each tensor an ATen op returns has its storage counted once, from
the op that made it until Python drops the last reference to it (a weak reference's
finalizer). The tensors may be fake (``FakeTensorMode``): their storages have sizes and no
memory, so a step of a 7B model is counted in seconds, with nothing allocated. Views and
in-place results share an input's storage and add nothing; tensors created before the mode
(parameters, the batch) are not counted. Nothing here imports Lightning.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class LiveBytes(TorchDispatchMode):
    """``now``: bytes alive that ops under the mode created; ``peak``: the most at once since
    entering; ``window_peak``: the most since the last :meth:`mark`."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.peak = 0
        self.window_peak = 0
        self._sizes: dict[int, int] = {}

    def mark(self) -> int:
        """Start a new window at the bytes alive now; returns them."""
        self.window_peak = self.now
        return self.now

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        made = _tensors(out)
        if made:
            # a view or an in-place op returns an input's storage: nothing new (it may predate the mode)
            given = {t.untyped_storage()._cdata for t in _tensors((args, kwargs))}
            for tensor in made:
                if tensor.untyped_storage()._cdata not in given:
                    self._count(tensor.untyped_storage())
        return out

    def _count(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key in self._sizes:  # returned twice
            return
        size = storage.nbytes()
        self._sizes[key] = size
        self.now += size
        self.peak = max(self.peak, self.now)
        self.window_peak = max(self.window_peak, self.now)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.now -= self._sizes.pop(key, 0)


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or results: ``tree_leaves``' tensors for what an ATen op
    takes and returns (tensors, lists and tuples of them, a kwargs dict), in a fraction of its
    time: it ran twice on every op of a traced step and took a tenth of the trace."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    found: list[torch.Tensor] = []
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            found.append(node)
        elif isinstance(node, (list, tuple)):
            stack.extend(node)
        elif isinstance(node, dict):
            stack.extend(node.values())
    return found
