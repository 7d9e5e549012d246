"""What a user's step keeps on its module: items it appends to the module's lists, one per batch on every rank.

Lightning 2 dropped the ``*_epoch_end(outputs)`` argument; its documented pattern is a list on the module that
``training_step`` or ``validation_step`` appends to and ``on_train_epoch_end`` / ``on_validation_epoch_end`` stacks.
Where a multi-process pipeline runs the step per micro-batch (:mod:`~lightning_accel.pipeline.rank_step`; under GPipe
every rank runs it once, :mod:`~lightning_accel.pipeline.whole_step`), the step runs to its end only on the last stage's rank (elsewhere the model's forward stops
at the rank's last block, so anything after it never runs), and in training once per micro-batch. Left alone, the
other ranks' lists stay empty (``torch.stack([])`` fails at epoch end) and the last rank's hold one item per micro-batch.

:class:`KeptLists` notes the length of every list attribute of the module before a step and records what each run of
the step on the last rank appended (:meth:`KeptLists.recording`). The last rank merges the runs' items into what one
step on the whole batch would have appended (:func:`merge_items`: per-sample rows joined, numbers reduced as the loss is,
counts summed); every rank then drops what its own runs appended and appends those (:meth:`KeptLists.settle`), so each
rank's lists hold one item per batch, the values the last rank computed. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_accel.pipeline.microbatch import map_tensors

__all__ = ["KeptLists", "merge_items"]

Appended = dict[str, list[Any]]  # list attribute name -> the items a step appended to it


def _lists(module: nn.Module) -> dict[str, list[Any]]:
    return {name: value for name, value in vars(module).items() if isinstance(value, list)}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def merge_items(values: Sequence[Any], sizes: Sequence[int], reduction: str) -> Any:
    """One item from the items the micro-batches' runs of a step appended at the same position (one each; ``sizes``: the
    micro-batches' sample counts): what a run on the whole batch would have appended.

    - tensors whose first dimension is the micro-batch's size (predictions, per-sample losses): joined in order;
    - a floating-point number or one-element tensor (a loss, an accuracy): reduced as the loss is, the mean weighted by
      ``sizes`` (``reduction="mean"``) or the sum (``"sum"``); an integer one (a count of correct samples): the sum;
      the same value in every run (a batch index, a constant): that value;
    - dicts with the same keys and tuples or lists of the same length: merged entry by entry;
    - anything else: the last run's.
    """
    first = values[0]
    if len(values) == 1 or all(v is first for v in values):
        return first
    if all(isinstance(v, Tensor) for v in values):
        if all(v.dim() >= 1 and v.shape[0] == n and v.shape[1:] == first.shape[1:] for v, n in zip(values, sizes)):
            return torch.cat(list(values))
        if all(v.numel() == 1 and v.shape == first.shape and v.dtype == first.dtype for v in values):
            if all(bool(torch.equal(v, first)) for v in values):
                return first
            if first.is_floating_point() or first.is_complex():
                return _reduced(values, sizes, reduction)
            return torch.stack(list(values)).sum(0).to(first.dtype)
        return values[-1]
    if all(_is_number(v) for v in values):
        if all(v == first for v in values):
            return first
        if any(isinstance(v, float) for v in values):
            return _reduced(values, sizes, reduction)
        return sum(values)
    if all(isinstance(v, Mapping) for v in values) and all(v.keys() == first.keys() for v in values):
        return {k: merge_items([v[k] for v in values], sizes, reduction) for k in first}
    if all(type(v) is type(first) and isinstance(v, (list, tuple)) for v in values) and len({len(v) for v in values}) == 1:
        merged = [merge_items(column, sizes, reduction) for column in zip(*values)]
        return type(first)(*merged) if hasattr(first, "_fields") else type(first)(merged)
    return values[-1]


def _reduced(values: Sequence[Any], sizes: Sequence[int], reduction: str) -> Any:
    if reduction != "mean":
        return sum(values)
    total = sum(sizes)
    return sum(v * (n / total) for v, n in zip(values, sizes))


class KeptLists:
    """The module's list attributes around one step: their lengths before it, and what each recorded run appended."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.start = {name: len(value) for name, value in _lists(module).items()}
        self.runs: list[Appended] = []

    @contextmanager
    def recording(self) -> Iterator[None]:
        """Around one run of the step that ran to its end: what it appended is kept as one run (a run a stage boundary
        stopped raises through, and is not recorded)."""
        before = {name: len(value) for name, value in _lists(self.module).items()}
        yield
        self.runs.append({
            name: value[before[name]:] for name, value in _lists(self.module).items()
            if name in before and len(value) > before[name]
        })

    def merged(self, sizes: Sequence[int], reduction: str) -> Appended:
        """The recorded runs' items as one step on the whole batch would have appended them (:func:`merge_items`, item by
        item, where every run appended as many to a list; else every run's, in order), detached."""
        names = [n for n in self.start if any(n in run for run in self.runs)]
        out: Appended = {}
        for name in names:
            per_run = [run.get(name, []) for run in self.runs]
            if len(per_run) == len(sizes) and len({len(items) for items in per_run}) == 1:
                items = [merge_items(column, sizes, reduction) for column in zip(*per_run)]
            else:
                items = [item for run_items in per_run for item in run_items]
            out[name] = [map_tensors(item, lambda t: t.detach()) for item in items]
        return out

    def settle(self, appended: Appended, device: torch.device) -> None:
        """Every rank: each list back to its length before the step, then ``appended`` (the last rank's merged items)
        added, its tensors on ``device``."""
        lists = _lists(self.module)
        for name, length in self.start.items():
            value = lists.get(name)
            if value is None or len(value) < length:
                continue  # replaced or emptied by the step itself: the user's doing, left alone
            del value[length:]
            value.extend(map_tensors(item, lambda t: t.to(device)) for item in appended.get(name, []))
