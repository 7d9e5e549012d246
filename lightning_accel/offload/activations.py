"""Block-boundary activations parked in host memory between forward and backward.

A checkpointed block saves only its inputs for backward (everything inside it is
recomputed). Calling the block under :meth:`ActivationOffload.hooks` sends those saved
inputs to host memory as the forward leaves them, and brings each back when the backward
recomputes its block, so the device holds no activation per block at all between the two
passes.

On CUDA the device-to-host copy runs on the streamer's copy stream into pinned memory
(ordered after the compute that made the tensor, which is ``record_stream``-ed so its
memory is not reused early), and the way back is a non-blocking copy on the compute stream
that first waits for it. On a CPU "device" the copy is a real one too (a separate host
tensor), so the bytes counted are bytes copied; there it only costs time.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor

from lightning_accel.offload.stats import OffloadStats


class ActivationOffload:
    """``saved_tensors_hooks`` that move saved tensors to the host and back, counted."""

    def __init__(self, device: torch.device, stats: OffloadStats, copy_stream: torch.cuda.Stream | None = None) -> None:
        self.device = device
        self.stats = stats
        self.cuda = device.type == "cuda"
        self.copy_stream = copy_stream
        self._timed: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def hooks(self) -> AbstractContextManager[Any]:
        """Context manager: tensors autograd saves inside it are parked on the host."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: Tensor) -> tuple[torch.device, Tensor, torch.cuda.Event | None]:
        tensor = tensor.detach()
        nbytes = tensor.numel() * tensor.element_size()
        self.stats.activation_d2h_bytes += nbytes
        if tensor.device.type != "cuda":
            started = time.perf_counter()
            host = tensor.clone()
            self.stats.copy_seconds += time.perf_counter() - started
            return tensor.device, host, None
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        assert self.copy_stream is not None
        computed = torch.cuda.Event()
        computed.record(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(computed)
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.copy_stream)
            host.copy_(tensor, non_blocking=True)
            tensor.record_stream(self.copy_stream)
            done = torch.cuda.Event(enable_timing=True)
            done.record(self.copy_stream)
        self._timed.append((start, done))
        return tensor.device, host, done

    def _unpack(self, packed: tuple[torch.device, Tensor, torch.cuda.Event | None]) -> Tensor:
        device, host, done = packed
        self.stats.activation_h2d_bytes += host.numel() * host.element_size()
        if done is None:
            return host.to(device)  # same device: the host tensor itself
        torch.cuda.current_stream(device).wait_event(done)  # the way out finished before the way back starts
        return host.to(device, non_blocking=True)

    def finish(self) -> None:
        """Add the finished CUDA copies' durations to ``copy_seconds``."""
        for start, end in self._timed:
            end.synchronize()
            self.stats.copy_seconds += start.elapsed_time(end) / 1000.0
        self._timed.clear()
