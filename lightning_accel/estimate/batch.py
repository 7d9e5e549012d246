"""One training batch of a data module, as fake tensors: its shapes and dtypes, no data read.

The estimate runs the recipe's own training step, so it needs a batch of the size the loader
would give, and the data modules say their item shapes without reading a byte (the text
windows' ``block_size``, the images' ``input_shape``). A data module that does not is refused
with the fix.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode


def item_shapes(datamodule: Any) -> tuple[tuple[tuple[int, ...], torch.dtype], tuple[tuple[int, ...], torch.dtype]]:
    """``((input shape, dtype), (target shape, dtype))`` of one item of ``datamodule``'s training data."""
    from lightning_accel.data import ShapesDataModule, SyntheticDataModule, TextDataModule

    if isinstance(datamodule, TextDataModule):
        return ((datamodule.block_size,), torch.long), ((datamodule.block_size,), torch.long)
    if isinstance(datamodule, ShapesDataModule):
        return (tuple(datamodule.input_shape), torch.float32), ((), torch.long)
    if isinstance(datamodule, SyntheticDataModule) and datamodule.kind == "tokens":
        seq = datamodule.dataset.seq_len
        return ((seq,), torch.long), ((seq,), torch.long)
    if isinstance(datamodule, SyntheticDataModule) and datamodule.kind == "images":
        return (tuple(datamodule.dataset.shape), torch.float32), ((), torch.long)
    raise ValueError(
        f"the estimate does not know the batch shape of {type(datamodule).__name__}; use data=stdlib_text, "
        "text_file, shapes or a tokens/images SyntheticDataModule to estimate this model"
    )


def fake_batch(datamodule: Any, batch_size: int, mode: FakeTensorMode) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` of ``batch_size`` items, fake tensors on the CPU."""
    (x_shape, x_dtype), (y_shape, y_dtype) = item_shapes(datamodule)
    with mode:
        return torch.zeros((batch_size, *x_shape), dtype=x_dtype), torch.zeros((batch_size, *y_shape), dtype=y_dtype)


def batch_nbytes(datamodule: Any, batch_size: int) -> int:
    """Bytes of one batch as the loader hands it over."""
    total = 0
    for shape, dtype in item_shapes(datamodule):
        numel = batch_size
        for n in shape:
            numel *= n
        total += numel * torch.empty((), dtype=dtype).element_size()
    return total
