"""Manipulation of micro-batches: scatter a batch (or a model call's arguments) into M chunks and gather them back.

A batch is whatever a DataLoader yields: a tensor, or tuples, lists and dicts of them
(and of values that are not tensors, which every chunk shares). Every tensor in one
batch is split along dimension 0 into the same M pieces, with ``torch.tensor_split``
semantics (sizes differ by at most one, larger pieces first), so micro-batch ``i`` of
the inputs always lines up with micro-batch ``i`` of the targets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["batch_size", "call_batch_size", "gather", "gather_output", "map_tensors", "scatter", "scatter_call", "tensors_in"]


def tensors_in(batch: Any) -> list[Tensor]:
    """Every tensor in ``batch`` (nested tuples, lists and mappings), in order."""
    if isinstance(batch, Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for v in batch.values() for t in tensors_in(v)]
    if isinstance(batch, (tuple, list)):
        return [t for v in batch for t in tensors_in(v)]
    return []


def map_tensors(value: Any, fn: Callable[[Tensor], Any]) -> Any:
    """``value`` with ``fn`` applied to every tensor in it (nested tuples, named tuples, lists and dicts keep their types)."""
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(map_tensors(v, fn) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return type(value)((k, map_tensors(v, fn)) for k, v in value.items())
    return value


def batch_size(batch: Any) -> int:
    """The size of dimension 0 shared by every tensor in ``batch``.

    Raises ``ValueError`` when there is no tensor, a scalar tensor, or tensors disagree,
    because then no split lines inputs up with targets.
    """
    tensors = tensors_in(batch)
    if not tensors:
        raise ValueError(
            f"cannot split a batch of type {type(batch).__name__} into micro-batches: it holds no tensor; "
            "yield tensors (or tuples/lists/dicts of tensors) from the DataLoader"
        )
    if any(t.ndim == 0 for t in tensors):
        raise ValueError("cannot split a batch holding a 0-d tensor into micro-batches; give every tensor a batch dimension")
    sizes = sorted({t.size(0) for t in tensors})
    if len(sizes) != 1:
        raise ValueError(
            f"cannot split the batch into micro-batches: its tensors have different sizes in dimension 0 ({sizes}); "
            "every tensor in a batch must share the batch dimension"
        )
    return sizes[0]


def _split(batch: Any, chunks: int) -> list[Any]:
    if isinstance(batch, Tensor):
        return list(torch.tensor_split(batch, chunks, dim=0))
    if isinstance(batch, Mapping):
        parts = {k: _split(v, chunks) for k, v in batch.items()}
        return [type(batch)((k, parts[k][i]) for k in batch) for i in range(chunks)]  # type: ignore[call-arg]
    if isinstance(batch, (tuple, list)):
        columns = [_split(v, chunks) for v in batch]
        rows = [[col[i] for col in columns] for i in range(chunks)]
        if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
            return [type(batch)(*row) for row in rows]
        return [type(batch)(row) for row in rows]
    return [batch] * chunks  # not a tensor: every micro-batch shares it


def scatter(batch: Any, chunks: int) -> list[Any]:
    """Split ``batch`` into ``chunks`` micro-batches along dimension 0, keeping its structure."""
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive int, got {chunks!r}; e.g. chunks=4 splits each batch into 4 micro-batches")
    check_chunks(chunks, batch_size(batch))
    return _split(batch, chunks)


def check_chunks(chunks: int, size: int) -> None:
    """Refuse splitting a batch of ``size`` samples into ``chunks`` micro-batches when some would be empty.
    :func:`scatter` asks it of every batch, ``GPipeStrategy`` of the first batch its network sees, and
    ``lightning_accel.config.preflight`` of the configured batch size before any work."""
    if chunks > size:
        raise ValueError(
            f"chunks={chunks} is greater than the batch size {size}: some micro-batches would be empty; "
            f"set chunks <= {size} or raise the DataLoader's batch_size to at least {chunks}"
        )


def gather(microbatches: Sequence[Any]) -> Any:
    """Concatenate micro-batches (as :func:`scatter` made them) back into one batch."""
    if not microbatches:
        raise ValueError("cannot gather zero micro-batches")
    first = microbatches[0]
    if isinstance(first, Tensor):
        return torch.cat(list(microbatches), dim=0)
    if isinstance(first, Mapping):
        return type(first)((k, gather([m[k] for m in microbatches])) for k in first)  # type: ignore[call-arg]
    if isinstance(first, (tuple, list)):
        columns = [gather([m[i] for m in microbatches]) for i in range(len(first))]
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            return type(first)(*columns)
        return type(first)(columns)
    return first


def _first_tensor(args: tuple, kwargs: dict[str, Any]) -> Tensor:
    first = next(iter(tensors_in(list(args)) or tensors_in(kwargs)), None)
    if first is None or first.ndim == 0:
        raise ValueError("cannot split a forward call into micro-batches: its first tensor argument has no batch dimension")
    return first


def call_batch_size(args: tuple, kwargs: dict[str, Any]) -> int:
    """The batch size of a model call: dimension 0 of its first tensor argument (see :func:`scatter_call`)."""
    return _first_tensor(args, kwargs).size(0)


def scatter_call(args: tuple, kwargs: dict[str, Any], chunks: int) -> tuple[list[tuple[tuple, dict[str, Any]]], list[int]]:
    """A model call's arguments as ``chunks`` calls on micro-batches, and the micro-batch sizes.

    The batch size is dimension 0 of the first tensor argument (positional first); every
    tensor of that size in dimension 0 is split (``torch.tensor_split``), everything else
    (a shared mask, position ids of batch 1, flags) goes to every call as it is.
    """
    first = _first_tensor(args, kwargs)
    size = first.size(0)

    def split(value: Any) -> list[Any]:
        if isinstance(value, Tensor) and value.ndim > 0 and value.size(0) == size:
            return list(torch.tensor_split(value, chunks, dim=0))
        if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
            columns = [split(v) for v in value]
            return [type(value)(col[i] for col in columns) for i in range(chunks)]
        if isinstance(value, dict):
            parts = {k: split(v) for k, v in value.items()}
            return [{k: parts[k][i] for k in value} for i in range(chunks)]
        return [value] * chunks

    split_args, split_kwargs = split(tuple(args)), split(dict(kwargs))
    sizes = [t.size(0) for t in torch.tensor_split(first, chunks, dim=0)]
    return list(zip(split_args, split_kwargs)), sizes


def gather_output(outputs: Sequence[Any], sizes: Sequence[int]) -> tuple[Any, bool]:
    """The micro-batch outputs of a model call as the whole batch's output, and whether a scalar had to be averaged.

    Tensors whose dimension 0 is each micro-batch's size are concatenated (logits, hidden
    states); a 0-d tensor (a loss or auxiliary loss the model computed itself) becomes the
    size-weighted mean of the micro-batches' values, which equals the whole batch's only for
    a mean over equally weighted samples; mappings (transformers' ``ModelOutput``), tuples and
    lists keep their types; anything else is the first micro-batch's.
    """
    averaged = False

    def join(values: Sequence[Any]) -> Any:
        nonlocal averaged
        first = values[0]
        if isinstance(first, Tensor):
            if first.ndim == 0:
                averaged = True
                total = sum(sizes)
                return sum(v * (n / total) for v, n in zip(values, sizes))
            if all(isinstance(v, Tensor) and v.ndim > 0 and v.size(0) == n for v, n in zip(values, sizes)):
                return torch.cat(list(values), dim=0)
            return first
        if isinstance(first, Mapping):
            joined = {k: join([v[k] for v in values]) for k in first}
            return type(first)(**joined) if hasattr(first, "__dataclass_fields__") else type(first)(joined)  # type: ignore[call-arg]
        if isinstance(first, (tuple, list)):
            columns = [join([v[i] for v in values]) for i in range(len(first))]
            return type(first)(*columns) if hasattr(first, "_fields") else type(first)(columns)
        return first

    return join(outputs), averaged

