"""Precision on XLA devices: fp32, bf16 weights (``bf16-true``) or bf16 autocast (``bf16-mixed``).

The XLA way to run bf16 is the dtype itself: ``bf16-true`` casts the module to bfloat16
(the ``XLA_USE_BF16`` variable Lightning's XLAPrecision sets is deprecated in torch_xla
2.x), ``bf16-mixed`` keeps fp32 weights and runs the forward under
``torch.autocast("xla", bfloat16)``. bf16 has fp32's exponent range, so neither needs a
loss scaler; fp16 does, and XLA has none, so ``16-*`` is refused.

The optimizer step ends the step's graph (``torch_xla.sync()``): one graph per optimizer
step, compiled once and replayed, however many micro-batches it accumulates.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.types import Optimizable
from lightning.pytorch.plugins.precision import Precision
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn
from typing_extensions import override

SUPPORTED = ("32-true", "32", "bf16-true", "bf16-mixed")


class XLAPJRTPrecision(Precision):
    """fp32, bf16-true or bf16-mixed on an XLA device; one ``torch_xla.sync()`` per optimizer step."""

    def __init__(self, precision: str = "32-true") -> None:
        precision = str(precision)
        if precision not in SUPPORTED:
            raise ValueError(
                f"precision={precision!r} is not supported on XLA devices (supported: 32-true, bf16-true, bf16-mixed); "
                "fp16 needs a loss scaler, which XLA does not have; use precision='bf16-mixed'"
            )
        self.precision = "32-true" if precision == "32" else precision  # type: ignore[assignment]

    @override
    def convert_module(self, module: nn.Module) -> nn.Module:
        return module.to(torch.bfloat16) if self.precision == "bf16-true" else module

    @override
    def convert_input(self, data: Any) -> Any:
        if self.precision != "bf16-true":
            return data
        return apply_to_collection(data, torch.Tensor, lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t)

    @override
    def forward_context(self) -> Any:
        if self.precision == "bf16-mixed":
            return torch.autocast("xla", dtype=torch.bfloat16)
        if self.precision == "bf16-true":
            return _default_dtype(torch.bfloat16)
        return nullcontext()

    @override
    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizable,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        import torch_xla

        result = super().optimizer_step(optimizer, model, closure, **kwargs)
        torch_xla.sync()  # the step boundary: forward+backward+update become one graph
        return result


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Generator[None, None, None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
