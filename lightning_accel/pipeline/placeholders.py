"""The other ranks' tensors on a pipeline rank: ``meta`` placeholders, and what comparing one with a tensor answers.

A split module keeps its full structure on every rank (names, shapes and dtypes, what checkpoints and summaries read),
the blocks of other ranks' stages as tensors on the ``meta`` device, which hold no values. Code that walks every
parameter and compares values then meets a placeholder: Lightning's ``BaseFinetuning.filter_on_optimizer`` asks
``torch.equal(p, param)`` of each parameter it is about to add to an optimizer against every parameter already there,
and ``aten::equal`` has no meta kernel. :func:`placeholders_equal_nothing` gives it one while a split module trains: a
placeholder equals no tensor (it holds no value to be equal), so the comparison goes on to the parameters this rank
holds, and the placeholder is added like any other, for the strategy to leave to the rank that holds it. No Lightning
here.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["placeholders_equal_nothing"]


def _equal_nothing(a: Tensor, b: Tensor) -> bool:
    return False


def placeholders_equal_nothing() -> Callable[[], None]:
    """From now on ``torch.equal`` with a ``meta`` tensor answers False (torch's own raises); returns the call that
    undoes it."""
    library = torch.library.Library("aten", "IMPL")
    library.impl("equal", _equal_nothing, "Meta")
    return library._destroy
