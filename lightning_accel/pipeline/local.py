"""The single-process pipeline: a model's blocks placed stage by stage on local devices.

The user's modules are not wrapped: each block keeps its place and name in the model
(so checkpoints keep the user's parameter names and load into the unpipelined model),
and gets an instance-level ``forward`` that moves its inputs to its stage's device and,
for micro-batches before ``checkpoint_stop``, re-materializes its activations in the
backward pass (``torch.utils.checkpoint``) instead of storing them. Modules outside
the blocks run on the stage of the block registered before them (the first stage when
none is), which attaches an embedding to the first stage and a head to the last. The
model's output is moved back to the first device, where the batch and its targets live.
BatchNorm layers never update their running statistics during recomputation; with
``deferred_batch_norm`` they update them once per batch, from the whole batch
(:mod:`lightning_accel.pipeline.batchnorm`); call :meth:`finish_batch` after the last
micro-batch.

On CUDA the host issues micro-batch ``i + 1``'s first stage while later devices still
run micro-batch ``i`` (kernel launches and device-to-device copies are asynchronous), so
the stages overlap on the devices' own streams; on CPU the micro-batches run one after
another and only the arithmetic of GPipe (memory, exact gradients) applies.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint
from torch.utils.hooks import RemovableHandle

from lightning_accel.models.block_policy import Block
from lightning_accel.pipeline.batchnorm import DeferredBatchNorm
from lightning_accel.pipeline.partition import stage_of_block

__all__ = ["CHECKPOINT_MODES", "LocalPipeline", "checkpoint_stop"]

CHECKPOINT_MODES = ("always", "except_last", "never")


def checkpoint_stop(mode: str, chunks: int) -> int:
    """The policy as one integer: micro-batches with index < this are re-materialized.

    ``except_last`` keeps the last micro-batch's activations because its backward runs
    first, right after its forward, so recomputing it would buy no memory.
    """
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint must be one of {', '.join(CHECKPOINT_MODES)}, got {mode!r}")
    return {"always": chunks, "except_last": chunks - 1, "never": 0}[mode]


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, Tensor):
        return value if value.device == device else value.to(device, non_blocking=True)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_to(v, device) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _to(v, device)) for k, v in value.items())
    return value


def _direct_tensors(module: nn.Module) -> list[Tensor]:
    return [*module.parameters(recurse=False), *module.buffers(recurse=False)]


class LocalPipeline:
    """Blocks of ``net`` split into ``len(balance)`` stages on ``devices``, in one process.

    ``place()`` moves the modules and installs the per-block forwards; ``restore()``
    removes them and leaves a plain model. Around each micro-batch's forward, enter
    ``microbatch(i)`` so the blocks know whether to re-materialize.
    """

    def __init__(
        self,
        net: nn.Module,
        blocks: Sequence[Block],
        balance: Sequence[int],
        devices: Sequence[torch.device],
        checkpoint_stop: int = 0,
        deferred_batch_norm: bool = False,
    ) -> None:
        if sum(balance) != len(blocks):
            raise ValueError(f"balance {list(balance)} sums to {sum(balance)} but there are {len(blocks)} blocks")
        if len(devices) < len(balance):
            raise ValueError(f"{len(balance)} stages need {len(balance)} devices, got {len(devices)}")
        self.net = net
        self.blocks = list(blocks)
        self.balance = list(balance)
        self.devices = [torch.device(d) for d in devices[: len(balance)]]
        self.checkpoint_stop = checkpoint_stop
        self._current: int | None = None
        self._handles: list[RemovableHandle] = []
        self._patched: list[nn.Module] = []
        self.deferred_batch_norm = deferred_batch_norm
        self._batch_norm: DeferredBatchNorm | None = None

    @property
    def stages(self) -> int:
        return len(self.balance)

    def assignment(self) -> dict[str, int]:
        """Stage of every module that owns parameters or buffers (its qualified name -> stage)."""
        stage_of = stage_of_block(self.balance)
        block_stage = {b.name: stage_of[k] for k, b in enumerate(self.blocks)}
        out: dict[str, int] = {}
        current = 0
        inside: str | None = None
        for name, module in self.net.named_modules():
            if name in block_stage:
                current, inside = block_stage[name], name
                out[name] = current
                continue
            if inside is not None and name.startswith(f"{inside}."):
                continue  # inside a block: moved with it
            if _direct_tensors(module):
                out[name] = current
        return out

    def place(self) -> None:
        """Move every module to its stage's device and install the staged forwards."""
        self.restore()
        assignment = self.assignment()
        modules = dict(self.net.named_modules())
        owner: dict[int, tuple[str, int]] = {}
        for name, stage in assignment.items():
            is_block = any(b.name == name for b in self.blocks)
            tensors = list(modules[name].parameters()) if is_block else _direct_tensors(modules[name])
            for t in tensors:
                seen = owner.setdefault(id(t), (name, stage))
                if self.devices[seen[1]] != self.devices[stage]:
                    raise ValueError(
                        f"a tensor is shared by {seen[0] or 'the model'} (stage {seen[1]}, {self.devices[seen[1]]}) "
                        f"and {name} (stage {stage}, {self.devices[stage]}); a pipeline cannot hold one tensor on two "
                        "devices. HINT: untie the weights (e.g. GPT(tie_weights=False)) or put both stages on one device"
                    )
        for name, stage in assignment.items():
            module, device = modules[name], self.devices[stage]
            if any(b.name == name for b in self.blocks):
                module.to(device)
                self._patch_block(module, device)
            else:
                module._apply(lambda t, d=device: t.to(d), recurse=False)  # its own tensors only
                self._handles.append(module.register_forward_pre_hook(self._mover(device), with_kwargs=True))
        first = self.devices[0]
        self._handles.append(self.net.register_forward_hook(lambda _m, _a, out: _to(out, first)))
        # a training forward inside microbatch(i) is a micro-batch of this batch; one outside it is a recomputation,
        # which must not update BatchNorm running statistics a second time
        self._batch_norm = DeferredBatchNorm(self.net, lambda: self._current is not None, self.deferred_batch_norm)

    def finish_batch(self) -> None:
        """Call after the last micro-batch's forward: commits deferred BatchNorm statistics."""
        if self._batch_norm is not None:
            self._batch_norm.commit()

    def restore(self) -> None:
        """Remove the staged forwards and hooks; the model is a plain model again (modules stay where they are)."""
        for handle in self._handles:
            handle.remove()
        for module in self._patched:
            module.__dict__.pop("forward", None)
        self._handles, self._patched = [], []
        if self._batch_norm is not None:
            self._batch_norm.detach()
            self._batch_norm = None

    @contextmanager
    def microbatch(self, index: int) -> Iterator[None]:
        """Run the forward of micro-batch ``index`` inside this context."""
        previous, self._current = self._current, index
        try:
            yield
        finally:
            self._current = previous

    def _mover(self, device: torch.device) -> Any:
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            return _to(args, device), _to(kwargs, device)

        return hook

    def _patch_block(self, block: nn.Module, device: torch.device) -> None:
        original = block.forward  # the class's bound forward

        def staged_forward(*args: Any, **kwargs: Any) -> Any:
            args, kwargs = _to(args, device), _to(kwargs, device)
            current = self._current
            if current is not None and current < self.checkpoint_stop and torch.is_grad_enabled():
                return checkpoint(original, *args, use_reentrant=False, **kwargs)
            return original(*args, **kwargs)

        block.forward = staged_forward  # type: ignore[method-assign]  # instance attribute: names and state_dict untouched
        self._patched.append(block)
