"""Which part of a LightningModule ``torch.compile`` has wrapped around a pipeline's blocks, for a strategy that cannot run
it compiled to say so.

The three ways a Lightning user compiles a model: ``self.net = torch.compile(self.net)`` (in ``__init__`` or
``configure_model``: an ``OptimizedModule`` in the module tree), ``self.net.compile()`` (``nn.Module.compile``, in place:
the module's ``_compiled_call_impl``), and ``trainer.fit(torch.compile(model))`` (Lightning unwraps it and compiles the
module's ``forward`` and steps: its ``_compiler_ctx``). A compiled block (or a part of one) is fine: a stage runs a block
whole; a compiled module that holds blocks would trace across the stage boundaries.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch._dynamo.eval_frame import OptimizedModule

__all__ = ["compiled_around"]


def compiled_around(module: nn.Module, blocks: Sequence[nn.Module]) -> str | None:
    """How a compiled part of ``module`` (a LightningModule) holds some of ``blocks``, in the user's words
    (``"net = torch.compile(net)"``), or None."""
    if getattr(module, "_compiler_ctx", None) is not None:
        return f"trainer.fit(torch.compile({type(module).__name__}(...)))"
    inside = {id(b) for b in blocks}
    for name, sub in module.named_modules():
        compiled = isinstance(sub, OptimizedModule) or getattr(sub, "_compiled_call_impl", None) is not None
        if compiled and id(sub) not in inside and any(id(m) in inside for m in sub.modules()):
            label = name or "self"
            return f"{label} = torch.compile({label})" if isinstance(sub, OptimizedModule) else f"{label}.compile()"
    return None
