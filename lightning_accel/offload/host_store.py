"""Host-resident fp32 master parameters, their low-precision shadows, and gradient buffers.

The parameters of every offloaded unit live in host memory as fp32 masters. When the device
computes in bf16/fp16, a low-precision *shadow* of each weight matrix is kept too and
refreshed after every optimizer step: the bus then carries half the bytes, and the
conversion happens once per step on the host instead of once per copy. Gradients arriving
from the device are accumulated here in fp32 until the optimizer step. Nothing here is
pinned, on CUDA either: the copies to and from the device cross bounded rings of pinned
buffers (:mod:`.staging`), so what is page-locked is what is in flight, not the model.

With ``snapshot=True`` (the one-step delayed update) every parameter gets a shadow of its
own, fp32 ones included: the device computes on the shadows while the host optimizer
rewrites the masters, and the shadows catch up once that step is done. It costs one more
copy of the parameters in host memory (fp32: twice the masters' bytes in all).

A frozen parameter (``requires_grad=False``: a fine-tune's base) gets none of this. The
host keeps the one tensor the user gave, in its dtype or tensor subclass (bf16, fp16, a
torchao ``NF4Tensor``); it streams as stored, is never written, and the
model computes on it as it would without offload. ``master[p]`` and ``shadow[p]`` are that
tensor itself, so the optimizer paths, which only see parameters with gradients, never
touch it, and it costs its stored size once (:func:`~lightning_accel.offload.stored.stored_nbytes`).

What is frozen can change between steps, and the store follows (the executor finds the changes
before each step): a frozen parameter that starts to require grad (gradual unfreezing:
``BaseFinetuning``) is *thawed*, given the master and shadow it would have had if trainable at
planning; frozen again, it goes back to its stored dtype, rounded from the master, and costs its
stored size again. A quantized weight cannot be thawed (:func:`cannot_train`). A parameter whose
``.data`` the user's code replaced is *adopted* (its values become the master's), and parameters
added to or removed from a unit are added or removed.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor, nn

from lightning_accel.offload.plan import Unit
from lightning_accel.stored import is_plain, plain_parts, stored_nbytes


class HostStore:
    """Masters, shadows and gradient buffers for the parameters of offloaded units."""

    def __init__(self, units: list[Unit], compute_dtype: torch.dtype, pin: bool, snapshot: bool = False) -> None:
        self.compute_dtype = compute_dtype
        # the device is a GPU (its copies cross pinned rings, :mod:`.staging`); nothing the store holds is pinned
        self.pin = pin
        self.snapshot = snapshot
        self.master: dict[nn.Parameter, Tensor] = {}
        self.shadow: dict[nn.Parameter, Tensor] = {}
        self.grads: dict[nn.Parameter, Tensor] = {}
        self.frozen: set[nn.Parameter] = set()
        # the bf16 gradient each fp32 buffer was widened from, and both tensors' versions then (see add_grad)
        self.low_grads: dict[nn.Parameter, tuple[Tensor, int, Tensor, int]] = {}
        self._keep_low = False
        self._shown = False  # the buffers are ``param.grad`` now (install_grads), until take_grads or clear_grads
        # parameters frozen at planning that require grad now (gradual unfreezing): the dtype each was stored in
        self.thawed: dict[nn.Parameter, torch.dtype] = {}
        for unit in units:
            for name, param in unit.params:
                self.add(name, param)
            self.add_buffers(unit.buffers)

    # -- what the store holds, and changes to it between steps ------------------------------------
    # Every entry is made and dropped in these methods, whatever the reason (planning, a parameter that starts or
    # stops training, a weight replaced or added by the user's code), so a tier that keeps masters elsewhere (files)
    # has one place to follow: ``master``, ``shadow``, ``frozen`` and ``thawed`` change nowhere else (``grads``
    # also fills and empties every step: add_grad, clear_grads).

    def add(self, name: str, param: nn.Parameter) -> None:
        """Take ``param`` into the store as planning does: frozen, as stored; requiring grad, an fp32 master
        (float64 for a float64 model) and, where the device computes in a low precision, a shadow. ``name`` is
        for the refusals: a weight that cannot train (an integer tensor, a quantized subclass) requiring grad."""
        if not param.requires_grad:
            self._keep_frozen(param)
            return
        if not param.is_floating_point():
            raise TypeError(f"parameter {name} is {param.dtype}; L2L offload keeps fp32 masters of floating-point parameters only")
        refusal = cannot_train(param.data)
        if refusal is not None:
            raise ValueError(f"parameter {name} {refusal}; {KEEP_IT_FROZEN}")
        self._keep_trainable(param)

    def add_buffers(self, buffers: Iterable[tuple[nn.Module, str, str]]) -> None:
        """Move a unit's buffers (owner, name, qualified name) to the host where they are not already."""
        for owner, buf_name, _ in buffers:
            buf = owner._buffers[buf_name]
            if buf is not None and buf.device.type != "cpu":
                owner._buffers[buf_name] = buf.detach().to("cpu")

    def remove(self, param: nn.Parameter) -> None:
        """Forget ``param`` (no longer in its unit: removed or replaced by the user's code). It keeps its data."""
        for table in (self.master, self.shadow, self.grads, self.low_grads, self.thawed):
            table.pop(param, None)
        self.frozen.discard(param)

    def thaw(self, param: nn.Parameter) -> None:
        """A parameter frozen at planning now requires grad (``BaseFinetuning`` unfreezing a backbone): it gets
        what it would have got had it required grad at planning, a master made from its stored values and a
        shadow where the store makes one; its gradient buffer comes with its first gradient. Why here and not a
        refusal: gradual unfreezing is how transfer learning is done in Lightning, and the stored form only
        saves memory while the weight is frozen. A quantized weight has no values to update: refused."""
        stored = self.master[param]
        refusal = cannot_train(stored)
        if refusal is not None:
            raise ValueError(f"the parameter {refusal}; {KEEP_IT_FROZEN}")
        del self.master[param], self.shadow[param]
        self.frozen.discard(param)
        self.thawed[param] = stored.dtype
        self._keep_trainable(param)

    def refreeze(self, param: nn.Parameter) -> None:
        """A thawed parameter is frozen again: back to its stored dtype, rounded from the master, so it costs
        its stored size again and no master, shadow or gradient buffer (its optimizer state is the optimizer's)."""
        dtype = self.thawed.pop(param)
        param.data = self.master[param].to(dtype)
        for table in (self.master, self.shadow, self.grads, self.low_grads):
            table.pop(param, None)
        self._keep_frozen(param)

    def adopt(self, param: nn.Parameter) -> None:
        """The user's code replaced ``param.data`` (``ModelPruning``'s lottery-ticket reset does
        ``param.data = original.data``): its values become the master's (the shadow follows), or for a frozen one
        the stored tensor. Without this the module would compute on a tensor the optimizer, the copies and the
        other ranks never see. A trainable parameter's shape cannot change (its optimizer state has it)."""
        if param in self.frozen:
            self._keep_frozen(param)
            return
        master = self.master[param]
        if param.shape != master.shape:
            raise ValueError(
                f"the parameter's data was replaced by a tensor of shape {tuple(param.shape)}, not {tuple(master.shape)}; "
                "replace the parameter (a new nn.Parameter) or fit again"
            )
        master.copy_(param.data)
        param.data = master
        self.refresh_shadows([param])

    def holds_data_of(self, param: nn.Parameter) -> bool:
        """Whether ``param`` computes on the store's tensor (between steps it must: otherwise its data was replaced)."""
        return _first_part(param.data).data_ptr() == _first_part(self.master[param]).data_ptr()

    def _keep_trainable(self, param: nn.Parameter) -> None:
        # fp32 masters; a float64 model (a reference run) keeps float64 and computes in it
        keep = torch.float64 if param.dtype == torch.float64 else torch.float32
        master = param.data.detach().to("cpu", keep)
        param.data = master
        self.master[param] = master
        # Matrices (linear, conv, embedding weights: nearly all the bytes) travel in
        # the compute dtype; vectors (biases, norm scales) stay fp32, as autocast
        # and the CPU's layer_norm kernels expect.
        same = self.compute_dtype == torch.float32 or keep == torch.float64 or master.ndim < 2
        if not same:
            self.shadow[param] = self._low(master)
        elif self.snapshot:
            self.shadow[param] = master.clone()
        else:
            self.shadow[param] = master

    def _keep_frozen(self, param: nn.Parameter) -> None:
        stored = param.data if param.device.type == "cpu" else param.data.to("cpu")
        if stored is not param.data:
            param.data = stored
        self.master[param] = self.shadow[param] = stored
        self.frozen.add(param)

    def _low(self, master: Tensor) -> Tensor:
        return master.to(self.compute_dtype)

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
        kernel reads it instead, 2 B a parameter instead of 4. On a GPU gradients land through the
        staging ring (:meth:`add_grad_part`), whose buffers are reused: none is kept and the kernel
        reads the fp32 buffer. On the CPU device it is the device's own gradient (autograd's, in
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

    def add_grad_part(self, param: nn.Parameter, part: Tensor, start: int, fresh: bool) -> None:
        """Accumulate one piece of a gradient that arrives in pieces (:class:`.staging.GradRing`): elements ``start`` on
        of the flattened gradient. ``fresh``: the first gradient of ``param`` since its buffer was emptied, copied
        into place (the buffer is made by its first piece); else added. Elementwise, so the buffer equals what
        :meth:`add_grad` makes of the whole tensor, bit for bit. ``part`` is a reused buffer: nothing keeps it."""
        buf = self.grads.get(param)
        if buf is None:
            master = self.master[param]
            buf = self.grads[param] = torch.empty(master.shape, dtype=master.dtype)
        target = buf.view(-1)[start:start + part.numel()]
        if fresh:
            target.copy_(part)
        else:
            target.add_(part)
        self.low_grads.pop(param, None)

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
        """Expose the accumulated gradients as ``param.grad`` (after a backward, for the user's code, clipping and
        the optimizer: where plain training shows them)."""
        for param, grad in self.grads.items():
            param.grad = grad
        self._shown = True

    def take_grads(self) -> None:
        """Before a backward: the shown gradients come back into the store as the user's code left them (zeroed or
        clipped in place, replaced, or set to None: dropped) and ``param.grad`` is None again, so that autograd's
        accumulation into ``param.grad`` does not add them twice."""
        if not self._shown:
            return
        self._shown = False
        for param in list(self.grads):
            grad, buf = param.grad, self.grads[param]
            param.grad = None
            if grad is buf:
                continue
            self.low_grads.pop(param, None)
            if grad is None:
                del self.grads[param]
            else:
                self.grads[param] = grad.detach().to("cpu", buf.dtype, copy=True)

    def clear_grads(self) -> None:
        """Drop the gradients after the optimizer step (and the ``param.grad`` references)."""
        for param in self.grads:
            param.grad = None
        self.grads.clear()
        self.low_grads.clear()
        self._shown = False

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


# the fix, in every refusal of a weight that cannot train
KEEP_IT_FROZEN = "keep it frozen (requires_grad=False) and train an adapter on it (peft LoRA), or load that weight unquantized"


def cannot_train(tensor: Tensor) -> str | None:
    """Why a stored weight cannot get a master and train (the end of a sentence naming it), or None: a quantized
    tensor subclass (torchao's ``NF4Tensor``) holds codes, not values an optimizer could update."""
    if not is_plain(tensor):
        return f"is stored as {type(tensor).__name__} (quantized), which cannot train"
    return None


def _first_part(tensor: Tensor) -> Tensor:
    return plain_parts(tensor)[0]
