"""Tensors as they are stored: their bytes, their plain parts, their copies to a device.

A frozen weight is kept exactly as the user gave it, and that may be a tensor subclass
whose ``dtype`` says nothing about its bytes: torchao's ``NF4Tensor`` reports bfloat16 but
stores 4-bit codes plus double-quantized scalers (about 0.52 bytes a parameter). Such
wrapper subclasses describe their storage through ``__tensor_flatten__`` (the protocol
torch.compile and FSDP2 rely on), so the bytes, the stream bookkeeping and the
collectives (L2L's host store and streamer, the pipeline's weight transfers) go through the
plain tensors inside, and the subclass's own ops (``.to(device)``, ``pin_memory``,
``F.linear``) do the rest. Nothing here imports Lightning.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def plain_parts(tensor: Tensor) -> list[Tensor]:
    """The plain tensors that hold ``tensor``'s data: itself, or a wrapper subclass's inner ones."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor]
    names, _ = tensor.__tensor_flatten__()  # type: ignore[attr-defined]
    return [part for name in names for part in plain_parts(getattr(tensor, name))]


def stored_nbytes(tensor: Tensor) -> int:
    """Bytes ``tensor`` occupies as stored (an NF4 weight: its codes and scalers, not numel x 2)."""
    return sum(part.numel() * part.element_size() for part in plain_parts(tensor))


def is_plain(tensor: Tensor) -> bool:
    """A tensor whose bytes are its ``numel * element_size`` (no wrapper subclass)."""
    return not is_traceable_wrapper_subclass(tensor)


def pinned(tensor: Tensor) -> Tensor:
    """``tensor`` in page-locked host memory (a subclass pins its inner tensors through its own op)."""
    return tensor if tensor.is_pinned() else tensor.pin_memory()


def to_device(tensor: Tensor, device: torch.device, non_blocking: bool) -> Tensor:
    """A copy of ``tensor`` on ``device`` in its stored form: a plain tensor into a fresh
    buffer, a subclass through its own ``.to`` (which moves its inner tensors)."""
    if is_plain(tensor):
        out = torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        out.copy_(tensor, non_blocking=non_blocking)
        return out
    return tensor.to(device, non_blocking=non_blocking)


def record_stream(tensor: Tensor, stream: torch.cuda.Stream) -> None:
    """``Tensor.record_stream`` for every plain part (subclasses do not forward it)."""
    for part in plain_parts(tensor):
        part.record_stream(stream)
