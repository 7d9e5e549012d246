"""The CUDA-only operations of the offload in one layer: page-locked buffers, the copy stream, events.

Everything that differs between a GPU and the CPU device goes through :class:`DeviceMemory`, so the offload's
code paths are the same on both and the tests here run them. On CUDA the layer pins (page-locked buffers the
copies run from asynchronously), makes a copy stream and records events on it; on the CPU device it pins
nothing, has no stream and its events are already done. Either way it counts the bytes it was asked to pin
(``pinned_bytes``), so a test can hold what the host pins to the tier's plan: only the buffers in flight (the
gradient and weight rings of :mod:`.staging`, the tier's I/O buffers), never a whole copy of the model.

:class:`StandIn` is the GPU code path on the CPU device: the weights and gradients cross through the same rings
as on CUDA (``staged``), in plain memory, with the same counting. :func:`for_device` is where the offload gets
its layer; :func:`standing_in` makes it hand out a stand-in for the CPU device (tests). Nothing here imports
Lightning.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor


class DeviceMemory:
    """Pinned buffers, the copy stream and events for ``device`` (CUDA), or their stand-ins (the CPU device)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        # weights and gradients cross through the pinned rings (:mod:`.staging`); the CPU device computes on the host's
        self.staged = self.cuda
        self.pinned_bytes = 0  # bytes asked to be pinned, all together (buffers are made once and reused)
        self.requests: list[int] = []  # each request's bytes
        self._lock = threading.Lock()

    # -- page-locked memory ----------------------------------------------------------
    def empty_pinned(self, nbytes: int) -> Tensor:
        """``nbytes`` of page-locked host memory (uint8), counted."""
        with self._lock:
            self.pinned_bytes += nbytes
            self.requests.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)

    # -- streams and events ------------------------------------------------------------
    def new_stream(self) -> torch.cuda.Stream | None:
        return torch.cuda.Stream(self.device) if self.cuda else None

    def on(self, stream: torch.cuda.Stream | None) -> Any:
        """A context running the work it encloses on ``stream`` (the CPU device: inline)."""
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    def event(self, stream: torch.cuda.Stream | None = None, timing: bool = False) -> torch.cuda.Event | None:
        """An event recorded on ``stream`` (default: the current stream); None on the CPU device (already done)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=timing)
        event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return event

    def wait(self, stream: torch.cuda.Stream | None, event: torch.cuda.Event | None) -> None:
        """``stream`` waits for ``event`` before its next work."""
        if stream is not None and event is not None:
            stream.wait_event(event)

    @staticmethod
    def synchronize(event: torch.cuda.Event | None) -> None:
        """Block until ``event`` is done."""
        if event is not None:
            event.synchronize()

    @staticmethod
    def record_stream(tensor: Tensor, stream: torch.cuda.Stream | None) -> None:
        """``tensor``'s memory is not reused until ``stream``'s work queued now is done."""
        if stream is not None:
            tensor.record_stream(stream)


class StandIn(DeviceMemory):
    """The GPU code path on the CPU device: weights and gradients cross through the pinned rings as on CUDA, in plain
    memory; what would be pinned is counted (``pinned_bytes``) and each request is listed (``requests``)."""

    def __init__(self, device: torch.device | None = None) -> None:
        super().__init__(device or torch.device("cpu"))
        self.staged = True


_stand_in: DeviceMemory | None = None


def for_device(device: torch.device) -> DeviceMemory:
    """The layer for ``device``: CUDA's, or the CPU device's; the one :func:`standing_in` holds for its device type."""
    if _stand_in is not None and _stand_in.device.type == device.type:
        return _stand_in
    return DeviceMemory(device)


@contextmanager
def standing_in(memory: DeviceMemory) -> Iterator[DeviceMemory]:
    """While open, the layer of ``memory``'s device type is ``memory``: a :class:`StandIn` (the GPU code path on the CPU
    device), or one :class:`DeviceMemory` for CUDA that every part of the offload shares, so its count is the run's."""
    global _stand_in
    before, _stand_in = _stand_in, memory
    try:
        yield memory
    finally:
        _stand_in = before
