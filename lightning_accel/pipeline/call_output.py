"""The output of a pipelined model call, sent from the last stage's rank to every rank of the pipeline.

Why: each rank of a pipeline runs the user's step once per batch, as each rank of DDP does, so that what the step does
after the model's call (its loss, ``self.log``, ``self.all_gather``, what it appends or returns, a counter, a file rank
0 writes) happens on every rank. Only the last stage's rank computes the model's output; :meth:`CallOutput.deliver`
gives the others a copy of it (detached: only the last rank's loss starts the backward).

Cost, per call: the output's bytes once to every other rank of the pipeline (one ``broadcast`` per dtype, e.g. the
final hidden states of a transformers ``LlamaModel``: one stage boundary's activation). The output's structure
(containers, ``ModelOutput`` fields, non-tensor values, each tensor's dtype and shape) crosses the ranks only when it
changes (``broadcast_object_list``); a step whose structure is the last one's costs one small header broadcast more.
No Lightning here.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["CallOutput", "flatten", "unflatten"]


class _Slot:
    """Where tensor ``index`` sits in an output's structure."""

    def __init__(self, index: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.index, self.dtype, self.shape = index, dtype, shape

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Slot) and (self.index, self.dtype, self.shape) == (other.index, other.dtype, other.shape)

    def __reduce__(self) -> tuple:
        return (_Slot, (self.index, self.dtype, self.shape))


def flatten(value: Any) -> tuple[Any, list[Tensor]]:
    """``value``'s structure, each tensor a :class:`_Slot`, and its tensors in order (detached)."""
    tensors: list[Tensor] = []

    def walk(v: Any) -> Any:
        if isinstance(v, Tensor):
            tensors.append(v.detach())
            return _Slot(len(tensors) - 1, v.dtype, tuple(v.shape))
        return _rebuild(v, walk)

    return walk(value), tensors


def unflatten(structure: Any, tensors: list[Tensor]) -> Any:
    """The value :func:`flatten` took apart, with ``tensors`` in its slots."""

    def walk(v: Any) -> Any:
        if isinstance(v, _Slot):
            return tensors[v.index]
        return _rebuild(v, walk)

    return walk(structure)


def _rebuild(value: Any, fn: Any) -> Any:
    """``value`` (a container, or anything else as it is) with ``fn`` applied to its items, its type kept
    (named tuples, dicts, transformers' ``ModelOutput``)."""
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(fn(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(fn(v) for v in value)
    if isinstance(value, Mapping):
        items = {k: fn(v) for k, v in value.items()}
        if hasattr(value, "__dataclass_fields__"):  # a ModelOutput: its fields by keyword
            return type(value)(**items)
        return type(value)(items)
    return value


class CallOutput:
    """Delivers each call's output from global rank ``src`` (the last stage's) to every rank of ``group``, onto ``device``."""

    def __init__(self, src: int, group: dist.ProcessGroup | None, device: torch.device) -> None:
        self.src, self.group, self.device = src, group, device
        self._structure: bytes | None = None  # the last structure every rank holds (pickled)
        self._known: Any = None

    def deliver(self, value: Any) -> Any:
        """On ``src``: sends ``value`` and returns it as it is; elsewhere: returns the copy (every rank calls it)."""
        sending = dist.get_rank() == self.src
        header = torch.zeros(1, dtype=torch.int64, device=self.device)
        tensors: list[Tensor] = []
        if sending:
            structure, tensors = flatten(value)
            try:
                packed = pickle.dumps(structure)
            except Exception as err:  # noqa: BLE001
                raise TypeError(
                    f"the pipelined model's call returned {type(value).__name__} holding a value that does not pickle "
                    f"({type(err).__name__}: {err}); every rank of the pipeline gets a copy of it: return tensors and "
                    "tuples, lists, dicts or dataclasses of them"
                ) from err
            header[0] = int(packed != self._structure)
        dist.broadcast(header, src=self.src, group=self.group)
        if int(header[0]):
            box: list[Any] = [packed if sending else None]
            dist.broadcast_object_list(box, src=self.src, group=self.group)
            self._structure, self._known = box[0], pickle.loads(box[0])
        slots = _slots(self._known)
        received: list[Tensor | None] = [None] * len(slots)
        for dtype in sorted({s.dtype for s in slots}, key=str):  # one broadcast per dtype
            same = [s for s in slots if s.dtype == dtype]
            wire = torch.uint8 if dtype == torch.bool else dtype  # gloo sends no bool
            if sending:
                flat = torch.cat([tensors[s.index].reshape(-1).to(self.device, wire) for s in same])
            else:
                flat = torch.empty(sum(_numel(s.shape) for s in same), dtype=wire, device=self.device)
            dist.broadcast(flat, src=self.src, group=self.group)
            offset = 0
            for s in same:
                n = _numel(s.shape)
                received[s.index] = flat[offset : offset + n].view(s.shape).to(dtype)
                offset += n
        return value if sending else unflatten(self._known, received)  # type: ignore[arg-type]


def _slots(structure: Any) -> list[_Slot]:
    found: list[_Slot] = []

    def walk(v: Any) -> Any:
        if isinstance(v, _Slot):
            found.append(v)
            return v
        return _rebuild(v, walk)

    walk(structure)
    return sorted(found, key=lambda s: s.index)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
