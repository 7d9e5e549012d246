"""Copies between pipeline stages on CUDA copy streams, so they overlap the stages' compute.

A tensor crossing from one stage to the next is copied on a copy stream of each CUDA
device involved, not on the devices' compute streams (torchgpipe's design): the copy
waits only for the producer's compute so far, and the consumer's compute waits only for
the copy, so stage ``j`` computes micro-batch ``i`` while micro-batch ``i + 1`` is copied
in. ``record_stream`` tells the caching allocator which streams use each tensor, so its
memory is not reused while a copy still reads it. Gradients travel back the same way
(:class:`_Copy`'s backward).

Where no CUDA device is involved (every CPU pipeline, every test on a CPU machine) a copy
is a plain ``.to(device)``, exactly what the executor did before streams existed.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_accel.pipeline.microbatch import map_tensors

__all__ = ["StageCopier"]


class _Copy(torch.autograd.Function):
    """A differentiable copy to ``device`` on copy streams; the gradient returns on copy streams too."""

    @staticmethod
    def forward(ctx: Any, copier: StageCopier, device: torch.device, tensor: Tensor) -> Tensor:
        ctx.copier, ctx.source = copier, tensor.device
        return copier._copy(tensor, device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, None, Tensor]:
        return None, None, ctx.copier._copy(grad, ctx.source)


class StageCopier:
    """Moves (nested) values to a stage's device: on per-device CUDA copy streams when a CUDA
    device is involved, with a plain ``.to()`` otherwise."""

    def __init__(self, devices: list[torch.device]) -> None:
        self.enabled = torch.cuda.is_available() and any(torch.device(d).type == "cuda" for d in devices)
        self.streams: dict[torch.device, torch.cuda.Stream] = {}

    def __call__(self, value: Any, device: torch.device) -> Any:
        return map_tensors(value, lambda t: self._tensor(t, device))

    def _tensor(self, tensor: Tensor, device: torch.device) -> Tensor:
        if tensor.device == device:
            return tensor
        if not self.enabled or "cuda" not in (tensor.device.type, device.type):
            return tensor.to(device, non_blocking=True)
        if tensor.requires_grad and torch.is_grad_enabled():
            return _Copy.apply(self, device, tensor)
        return self._copy(tensor, device)

    def _stream(self, device: torch.device) -> torch.cuda.Stream | None:
        if device.type != "cuda":
            return None
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        if device not in self.streams:
            self.streams[device] = torch.cuda.Stream(device)
        return self.streams[device]

    def _copy(self, tensor: Tensor, device: torch.device) -> Tensor:
        """Copy ``tensor`` to ``device`` on the copy streams of both ends (CUDA only)."""
        source_stream, target_stream = self._stream(tensor.device), self._stream(device)
        if source_stream is not None:
            source_stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the producer has written it
        with torch.cuda.stream(source_stream), torch.cuda.stream(target_stream):  # stream(None) is a no-op
            # to the host: blocking, because the host reads it next (a non-blocking copy lands in pinned memory
            # that is not yet written when .to() returns)
            out = tensor.to(device, non_blocking=device.type == "cuda")
        if source_stream is not None:
            tensor.record_stream(source_stream)  # read on the copy stream: keep its memory until the copy is done
        if target_stream is not None:
            compute = torch.cuda.current_stream(device)
            compute.wait_stream(target_stream)  # the stage computes on it only once it has arrived
            out.record_stream(compute)  # allocated on the copy stream, used on the compute stream
        return out
