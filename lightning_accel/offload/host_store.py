"""Host-resident fp32 master parameters, their low-precision shadows, and gradient buffers.

The parameters of every offloaded unit live in host memory as fp32 masters (pinned when
the device is CUDA, so copies can run asynchronously). When the device computes in
bf16/fp16, a pinned low-precision *shadow* of each weight matrix is kept too and refreshed
after every optimizer step: the bus then carries half the bytes, and the conversion
happens once per step on the host instead of once per copy. Gradients arriving from the
device are accumulated here in fp32 until the optimizer step.

With ``snapshot=True`` (the one-step delayed update) every parameter gets a shadow of its
own, fp32 ones included: the device computes on the shadows while the host optimizer
rewrites the masters, and the shadows catch up once that step is done. It costs one more
copy of the parameters in host memory (fp32: twice the masters' bytes in all).

A frozen parameter (``requires_grad=False``: a fine-tune's base) gets none of this. The
host keeps the one tensor the user gave, in its dtype or tensor subclass (bf16, fp16, a
torchao ``NF4Tensor``), pinned on CUDA; it streams as stored, is never written, and the
model computes on it as it would without offload. ``master[p]`` and ``shadow[p]`` are that
tensor itself, so the optimizer paths, which only see parameters with gradients, never
touch it, and it costs its stored size once (:func:`~lightning_accel.offload.stored.stored_nbytes`).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from lightning_accel.offload.plan import Unit
from lightning_accel.stored import pinned, stored_nbytes


class HostStore:
    """Masters, shadows and gradient buffers for the parameters of offloaded units."""

    def __init__(self, units: list[Unit], compute_dtype: torch.dtype, pin: bool, snapshot: bool = False) -> None:
        self.compute_dtype = compute_dtype
        self.pin = pin
        self.snapshot = snapshot
        self.master: dict[nn.Parameter, Tensor] = {}
        self.shadow: dict[nn.Parameter, Tensor] = {}
        self.grads: dict[nn.Parameter, Tensor] = {}
        self.frozen: set[nn.Parameter] = set()
        # the bf16 gradient each fp32 buffer was widened from, and both tensors' versions then (see add_grad)
        self.low_grads: dict[nn.Parameter, tuple[Tensor, int, Tensor, int]] = {}
        self._keep_low = False
        for unit in units:
            for name, param in unit.params:
                if not param.requires_grad:
                    self._keep_frozen(param)
                    continue
                if not param.is_floating_point():
                    raise TypeError(f"parameter {name} is {param.dtype}; L2L offload keeps fp32 masters of floating-point parameters only")
                # fp32 masters; a float64 model (a reference run) keeps float64 and computes in it
                keep = torch.float64 if param.dtype == torch.float64 else torch.float32
                master = param.data.detach().to("cpu", keep)
                if pin:
                    master = master.pin_memory()
                param.data = master
                self.master[param] = master
                # Matrices (linear, conv, embedding weights: nearly all the bytes) travel in
                # the compute dtype; vectors (biases, norm scales) stay fp32, as autocast
                # and the CPU's layer_norm kernels expect.
                same = compute_dtype == torch.float32 or keep == torch.float64 or master.ndim < 2
                if not same:
                    self.shadow[param] = self._low(master)
                elif snapshot:
                    self.shadow[param] = master.clone().pin_memory() if pin else master.clone()
                else:
                    self.shadow[param] = master
            for owner, buf_name, _ in unit.buffers:
                buf = owner._buffers[buf_name]
                if buf is not None:
                    owner._buffers[buf_name] = buf.detach().to("cpu").pin_memory() if pin else buf.detach().to("cpu")

    def _keep_frozen(self, param: nn.Parameter) -> None:
        stored = param.data if param.device.type == "cpu" else param.data.to("cpu")
        if self.pin:
            stored = pinned(stored)
        if stored is not param.data:
            param.data = stored
        self.master[param] = self.shadow[param] = stored
        self.frozen.add(param)

    def _low(self, master: Tensor) -> Tensor:
        low = master.to(self.compute_dtype)
        return low.pin_memory() if self.pin else low

    def refresh_shadows(self, params: list[nn.Parameter] | None = None) -> None:
        """Re-derive the shadows of ``params`` (default: all) after their masters changed
        (optimizer step, checkpoint load)."""
        for param in self.master if params is None else params:
            master, shadow = self.master[param], self.shadow[param]
            if shadow is not master:
                shadow.copy_(master)

    def add_grad(self, param: nn.Parameter, grad: Tensor, owned: bool) -> None:
        """Accumulate a host-side gradient (any float dtype) into the fp32 buffer.

        ``owned``: nobody else holds ``grad`` (autograd's own tensor), so an fp32 one can be
        kept as the buffer without a copy; a reused staging buffer is copied.

        With :meth:`keep_low` on, the bf16 gradient of a parameter with a low-precision shadow
        is kept beside the buffer widened from it (:meth:`exact_low_grads`): the host step's C
        kernel reads it instead, 2 B a parameter instead of 4. On a GPU it is the pinned staging
        buffer, kept anyway; on the CPU device it is the device's own gradient (autograd's, in
        the device's memory, which there is the host's) held until the step instead of freed
        after the widening: 2 B a matrix parameter, not counted in :meth:`host_bytes`.
        """
        buf = self.grads.get(param)
        if buf is None:
            dtype = self.master[param].dtype
            buf = self.grads[param] = grad.to(dtype) if owned else grad.to(dtype, copy=True)
            if self._keep_low and grad.dtype == torch.bfloat16 and dtype == torch.float32 and grad.is_contiguous() \
                    and self.shadow[param] is not self.master[param]:
                self.low_grads[param] = (grad, grad._version, buf, buf._version)
        else:
            buf.add_(grad)
            self.low_grads.pop(param, None)  # (the sum is no bf16 tensor's widening)

    def keep_low(self, keep: bool) -> None:
        """Whether :meth:`add_grad` keeps the bf16 gradients from now on (off: what it kept is released)."""
        self._keep_low = keep
        if not keep:
            self.low_grads.clear()

    def exact_low_grads(self, params: Iterable[nn.Parameter] | None = None) -> dict[nn.Parameter, Tensor]:
        """The kept bf16 gradients (of ``params``, default all) whose fp32 widening is still exactly
        ``param.grad``: the same buffer, neither tensor written since (clipping, unscaling, a user's
        hook, an all-reduce bump the version counter; replacing ``param.grad`` breaks the identity)."""
        kept = self.low_grads
        out = {}
        for param in kept if params is None else params:
            entry = kept.get(param)
            if entry is not None:
                low, low_version, buf, buf_version = entry
                if param.grad is buf and buf._version == buf_version and low._version == low_version:
                    out[param] = low
        return out

    def drop_low_grads(self, params: Iterable[nn.Parameter]) -> None:
        """Release the kept bf16 gradients of ``params`` (stepped)."""
        for param in params:
            self.low_grads.pop(param, None)

    def install_grads(self) -> None:
        """Expose the accumulated gradients as ``param.grad`` for clipping and the optimizer."""
        for param, grad in self.grads.items():
            param.grad = grad

    def clear_grads(self) -> None:
        """Drop the gradients after the optimizer step (and the ``param.grad`` references)."""
        for param in self.grads:
            param.grad = None
        self.grads.clear()
        self.low_grads.clear()

    def weight_bytes(self) -> int:
        """Bytes of the host weights: frozen tensors as stored, masters, and shadows that are copies."""
        total = sum(stored_nbytes(m) for m in self.master.values())
        return total + sum(stored_nbytes(s) for p, s in self.shadow.items() if s is not self.master[p])

    def host_bytes(self) -> int:
        """:meth:`weight_bytes` plus the gradient buffer each trainable parameter holds from its
        first gradient to the step (counted whether or not a step is under way)."""
        grads = sum(m.numel() * m.element_size() for p, m in self.master.items() if p not in self.frozen)
        return self.weight_bytes() + grads

    def numel(self) -> int:
        """Parameters the store holds (frozen and trainable)."""
        return sum(p.numel() for p in self.master)
