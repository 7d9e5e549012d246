"""The host optimizer step on torch's fused CPU kernels, for the user's own optimizer.

On an accelerator the host step is offload training's critical path. Since torch 2.4,
SGD, Adam, AdamW and Adagrad have fused CPU kernels (``fused=True`` on CPU tensors),
but with ``foreach``/``fused`` left unset torch steps CPU tensors with its per-tensor
loop: measured on a 2-core x86_64 machine, AdamW over 20M fp32 parameters takes 33 ms
that way and 6.6 ms fused (DeepSpeed's CPU Adam, ZeRO-Offload's answer, is as fast as
the fused kernel). So the host parameters of a user's ``AdamW(lr=...)`` step on the
fused kernel, and nothing else about the optimizer changes:

- the step runs on a *temporary view* of the user's param groups (:func:`update_groups`):
  each group's host parameters split off with ``fused=True``, the rest (parameters kept
  on the accelerator) with the user's flags; the user's groups are put back after the
  update, so ``state_dict()``, checkpoints, LR schedulers and logging see them unchanged;
- the state is the optimizer's own and the same either way (a CPU parameter's ``step``
  is a float32 scalar on the CPU, fused or not), so checkpoints load into plain runs;
- an explicit ``fused=False`` or ``foreach=...`` is honoured, as are ``differentiable``,
  complex parameters and sparse gradients (no fused kernel: those keep torch's choice).

When the device computes in bf16/fp16, the update also writes each parameter's
low-precision shadow in the same pass over its master (:mod:`.shadow_fold`), instead of a
second pass that reads every master again: a block's working set (parameters, gradients,
two moments: 200 MB at GPT-2 medium width) is far beyond the cache, so stepping block by
block and refreshing each block's shadows right after it gained nothing measurable.

Each update carries the profiler label ``l2l/host_step`` (``torch.profiler.record_function``),
after the closure: the forward and backward it runs stay outside.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
import contextlib
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.profiler import record_function

from lightning_accel.offload.shadow_fold import ShadowFold
from lightning_accel.patching import swapped

# torch.optim classes with a fused CPU kernel (torch >= 2.4; still these four in 2.13)
FUSED_CPU: tuple[type[Optimizer], ...] = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad)

@dataclass(frozen=True)
class HostKernel:
    """Which implementation steps an optimizer's host parameters, and why (one line)."""

    fused: bool  # switched to torch's fused CPU kernel by us
    why: str


def _switchable(group: dict[str, Any]) -> bool:
    """The user left the implementation to torch (``fused``/``foreach`` unset) and the
    group has no flag the fused kernel refuses."""
    return group.get("fused") is None and group.get("foreach") is None and not group.get("differentiable") \
        and not group.get("capturable")


def choose_host_kernel(optimizer: Optimizer) -> HostKernel:
    """Decide once per optimizer whether its host parameters switch to the fused CPU kernel."""
    name = type(optimizer).__name__
    # the exact class: a subclass may override step() with a rule the kernel does not know
    if type(optimizer) not in FUSED_CPU:
        return HostKernel(False, f"{name} has no fused CPU kernel in torch {torch.__version__.split('+')[0]}: "
                                 "host parameters step on its own implementation")
    groups = optimizer.param_groups
    if any(g.get("fused") for g in groups):
        return HostKernel(False, f"{name}(fused=True) as configured: host parameters step on torch's fused CPU kernel")
    if not any(_switchable(g) for g in groups):
        set_ = {k: groups[0].get(k) for k in ("fused", "foreach") if groups[0].get(k) is not None}
        set_.update({k: True for k in ("differentiable", "capturable") if groups[0].get(k)})
        flags = ", ".join(f"{k}={v!r}" for k, v in set_.items())
        return HostKernel(False, f"{name}({flags}) as configured: host parameters step on torch's non-fused implementation")
    return HostKernel(True, f"{name}: host parameters step on torch's fused CPU kernel (foreach/fused were unset; "
                            "pass fused=False to keep torch's default)")


def _fusable(param: Tensor) -> bool:
    grad = param.grad
    return param.device.type == "cpu" and param.is_floating_point() and not (grad is not None and grad.is_sparse)


def update_groups(optimizer: Optimizer, params: Iterable[Tensor] | None = None, fuse: bool = True) -> list[dict[str, Any]]:
    """The param groups for one update: the parameters in ``params`` only (None: all), and,
    when ``fuse``, each switchable group's CPU parameters split off with ``fused=True``.

    Split further by whether a parameter already has state, because SGD's fused kernel
    takes momentum buffers all present or all absent (a parameter first getting a gradient
    mid-training has none yet). Every group is a new dict holding the user's values.
    """
    keep = None if params is None else {id(p) for p in params}
    out: list[dict[str, Any]] = []
    for group in optimizer.param_groups:
        chosen = [p for p in group["params"] if keep is None or id(p) in keep]
        if not chosen:
            continue
        if not (fuse and _switchable(group)):
            out.append({**group, "params": chosen})
            continue
        host = [p for p in chosen if _fusable(p)]
        rest = [p for p in chosen if not _fusable(p)]
        for part in ([p for p in host if optimizer.state.get(p)], [p for p in host if not optimizer.state.get(p)]):
            if part:
                out.append({**group, "params": part, "fused": True, "foreach": False})
        if rest:
            out.append({**group, "params": rest})
    return out


@contextmanager
def _groups(optimizer: Optimizer, groups: list[dict[str, Any]]) -> Generator[None, None, None]:
    saved = optimizer.param_groups
    optimizer.param_groups = groups
    try:
        yield
    finally:
        optimizer.param_groups = saved


def _folding(fold: ShadowFold) -> contextlib.AbstractContextManager[Any]:
    """``fold`` where it has shadows to write (opening one stands in for torch's fused kernel names:
    nothing to do without shadows)."""
    return fold if fold.shadows else contextlib.nullcontext()


def step_params(optimizer: Optimizer, params: Sequence[Tensor], shadows: Mapping[Tensor, Tensor] | None = None,
                low_grads: Mapping[Tensor, Tensor] | None = None, *, fuse: bool,
                step: Callable[[], Any] | None = None) -> list[Tensor]:
    """``optimizer.step()`` (or ``step()``, the optimizer's own step where ``optimizer.step`` is
    :func:`host_update`'s) restricted to ``params`` (same hyper-parameters and state),
    the CPU ones on the fused kernel when ``fuse``, writing ``shadows`` in the same pass
    where the kernel allows (reading ``low_grads``, see :class:`.ShadowFold`); returns the
    parameters whose shadows were written. Not thread-safe against other users of the
    optimizer: the caller keeps the main thread off it meanwhile."""
    fold = ShadowFold(shadows or {}, low_grads)
    with record_function("l2l/host_step"), _groups(optimizer, update_groups(optimizer, params, fuse)), _folding(fold):
        (step or optimizer.step)()
    return fold.written


@contextmanager
def host_update(
    optimizer: Optimizer,
    fuse: bool,
    shadows: Callable[[], Mapping[Tensor, Tensor]] = dict,
    written: Callable[[list[Tensor]], None] | None = None,
    low_grads: Callable[[], Mapping[Tensor, Tensor]] = dict,
    before_step: Callable[[Callable[..., list[Tensor]]], None] | None = None,
) -> Generator[None, None, None]:
    """For the ``optimizer.step(closure)`` calls inside: run the closure, then update every
    parameter, the CPU ones on the fused kernel, writing the low-precision shadows of
    ``shadows()`` (a parameter -> its shadow, asked after the closure, when the gradients are
    final) in the same pass, reading the bf16 gradients of ``low_grads()`` (asked then too; see
    :class:`.ShadowFold`), and tell ``written`` which shadows were written (the others, of
    parameters the kernel did not step, are the caller's to refresh). Without ``fuse`` the
    step is the user's, untouched (their optimizer may keep counters in its param groups,
    which the temporary groups would drop).

    The optimizer's step hooks (and an LR scheduler's step counter) run once per update
    call, after the closure. Calls from other threads (the block steps overlapping the
    backward, :func:`step_params`) pass straight through.

    ``before_step(step_some)``, after the closure and before the update: the caller steps some
    parameters itself (the NVMe tier's units, through its buffers) with ``step_some(params,
    shadows, low_grads)`` (:func:`step_params` on the optimizer's own step) and takes their
    gradients off; the update then steps the rest. Its calls run the optimizer's step hooks
    each, as the block steps during the backward do.
    """
    step = optimizer.step  # the instance's own wrapper if an LR scheduler put one there
    caller = threading.get_ident()

    def step_some(params: Sequence[Tensor], shadows: Mapping[Tensor, Tensor], low: Mapping[Tensor, Tensor]) -> list[Tensor]:
        return step_params(optimizer, params, shadows, low or None, fuse=fuse, step=step)

    def update(closure: Callable[[], Any] | None = None, **kwargs: Any) -> Any:
        if threading.get_ident() != caller:
            return step(closure, **kwargs)
        if not fuse and before_step is None:
            return _labelled_step(step, closure, **kwargs)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if before_step is not None:
            before_step(step_some)
        if not fuse:
            with record_function("l2l/host_step"):
                step(**kwargs)
            return loss
        with record_function("l2l/host_step"):
            to_write = shadows()
            fold = ShadowFold(to_write, low_grads() if to_write else None)
            with _groups(optimizer, update_groups(optimizer, None, fuse)), _folding(fold):
                step(**kwargs)
            if written is not None and fold.written:
                written(fold.written)
        return loss

    with swapped(optimizer, "step", update):
        yield


def _labelled_step(step: Callable[..., Any], closure: Callable[[], Any] | None, **kwargs: Any) -> Any:
    """The user's ``step(closure)``, untouched, labelled ``l2l/host_step`` from the closure's (first) return on."""
    label = record_function("l2l/host_step")
    if closure is None:
        with label:
            return step(closure, **kwargs)
    opened = False

    def closure_then_label() -> Any:
        nonlocal opened
        result = closure()
        if not opened:
            label.__enter__()
            opened = True
        return result

    try:
        return step(closure_then_label, **kwargs)
    finally:
        if opened:
            label.__exit__(None, None, None)
