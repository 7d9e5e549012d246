"""torch's fused CPU optimizer kernels, handed to this thread's interceptor while one is open.

torch.optim's fused Adam, AdamW, SGD and Adagrad call ``torch._fused_adam_`` (and the three
others) by name at every step. While an interceptor (:class:`.shadow_fold.ShadowFold`) is open
on any thread, each of the four names holds a stand-in: on a thread with an open interceptor
the innermost one is offered the call; everywhere else, or where it declines, what the name
held before runs as it would have. The last interceptor to close puts the names back.

Why names and not a ``TorchFunctionMode`` around the whole ``optimizer.step()``: a mode
dispatches every torch call of the step through Python (~270 a step in docs/offload.md's fit,
most of them ``_init_group``'s), ~2 ms a step that plain training does not pay; the stand-in
costs one Python call per kernel call. A wrapper that already stood on a name (a test counting
calls) still runs: its own call of the kernel is intercepted by a mode around that one call.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode

# torch's kernels themselves, whatever later wraps the names on ``torch``
KERNELS: dict[Callable[..., Any], str] = {
    torch._fused_adam_: "adam", torch._fused_adamw_: "adamw", torch._fused_sgd_: "sgd", torch._fused_adagrad_: "adagrad",
}
REAL = {kind: kernel for kernel, kind in KERNELS.items()}
NAMES = {"adam": "_fused_adam_", "adamw": "_fused_adamw_", "sgd": "_fused_sgd_", "adagrad": "_fused_adagrad_"}


class Interceptor(Protocol):
    def intercept(self, kind: str, kernel: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> bool:
        """Run the call of ``kernel`` (torch's own, of ``kind``) and return True, or return False to let it run as is."""
        ...


_open = threading.local()  # .stack: this thread's open interceptors, innermost last
_lock = threading.Lock()
_held: dict[str, Any] = {}  # name -> what it held before the stand-in (empty: no stand-ins in place)
_stand_ins: dict[str, Callable[..., Any]] = {}
_open_count = 0  # in all threads


def _stand_in(kind: str, before: Any) -> Callable[..., Any]:
    real = REAL[kind]

    def fused_kernel(*args: Any, **kwargs: Any) -> Any:
        stack = getattr(_open, "stack", None)
        if not stack:
            return before(*args, **kwargs)
        if before is real:
            return None if stack[-1].intercept(kind, real, list(args), kwargs) else real(*args, **kwargs)
        with _KernelCall(stack[-1]):  # a wrapper runs; its call of the kernel is offered to the interceptor
            return before(*args, **kwargs)

    fused_kernel.__name__ = fused_kernel.__qualname__ = NAMES[kind]
    fused_kernel.__wrapped__ = before  # type: ignore[attr-defined]
    return fused_kernel


class _KernelCall(TorchFunctionMode):
    """Around a wrapper that stood on a kernel's name before the names were taken: the kernel call
    inside it goes to ``interceptor`` (a mode around that one call only, not around the whole step)."""

    def __init__(self, interceptor: Interceptor) -> None:
        super().__init__()
        self.interceptor = interceptor

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> Any:
        kind = KERNELS.get(func)
        if kind is not None and self.interceptor.intercept(kind, func, list(args), kwargs or {}):
            return None
        return func(*args, **(kwargs or {}))


def push(interceptor: Interceptor) -> None:
    """Open ``interceptor`` on this thread (innermost); the first open one anywhere takes the names."""
    global _open_count
    stack = getattr(_open, "stack", None)
    if stack is None:
        stack = _open.stack = []
    with _lock:
        if _open_count == 0:
            for kind, name in NAMES.items():
                before = getattr(torch, name)
                _held[name] = before
                _stand_ins[name] = _stand_in(kind, before)
                setattr(torch, name, _stand_ins[name])
        _open_count += 1
    stack.append(interceptor)


def pop(interceptor: Interceptor) -> None:
    """Close ``interceptor`` on this thread (the innermost unless closed out of order); the last one open
    anywhere puts back what each name held, unless something replaced the stand-in meanwhile."""
    global _open_count
    stack = _open.stack
    del stack[len(stack) - 1 - stack[::-1].index(interceptor)]
    with _lock:
        _open_count -= 1
        if _open_count == 0:
            for name, before in _held.items():
                if getattr(torch, name) is _stand_ins[name]:
                    setattr(torch, name, before)
            _held.clear()
            _stand_ins.clear()
