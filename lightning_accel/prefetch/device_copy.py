"""One-batch-ahead copy to the accelerator on a side CUDA stream.

While the step computes batch ``i`` on the current stream, batch ``i + 1`` (pinned if
it is not already) is copied on a side stream. Before batch ``i + 1`` is handed out the
current stream waits for the copy (``wait_stream``), and each copied tensor is marked
with ``record_stream`` so the caching allocator does not reuse its memory while the
compute stream may still read it. Without CUDA the wrapper hands batches through
untouched: there is no copy to overlap.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch


def _map(batch: Any, fn: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, dict):
        return type(batch)({k: _map(v, fn) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_map(v, fn) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_map(v, fn) for v in batch)
    return batch


class CudaPrefetchIterable:
    """Iterate ``source`` with each batch already on ``device``, copied one batch ahead."""

    def __init__(self, source: Iterable, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"device={device} is not a CUDA device; CudaPrefetchIterable only overlaps CUDA copies")
        self.source = source
        self.device = device

    def __len__(self) -> int:
        return len(self.source)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        # sampler, batch_sampler, dataset: Lightning reads them off the loader it was given.
        if name == "source":
            raise AttributeError(name)
        return getattr(self.source, name)

    def _copy(self, batch: Any, stream: torch.cuda.Stream) -> Any:
        def move(t: torch.Tensor) -> torch.Tensor:
            if t.device.type == "cpu" and not t.is_pinned():
                t = t.pin_memory()  # a non_blocking copy from pageable memory would be synchronous
            return t.to(self.device, non_blocking=True)

        with torch.cuda.stream(stream):
            return _map(batch, move)

    def __iter__(self) -> Iterator:
        stream = torch.cuda.Stream(device=self.device)
        iterator = iter(self.source)
        try:
            pending = self._copy(next(iterator), stream)
        except StopIteration:
            return
        while True:
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(stream)
            _map(pending, lambda t: t.record_stream(current) if t.device.type == "cuda" else None)
            ready = pending
            try:
                pending = self._copy(next(iterator), stream)  # overlaps with the step on `ready`
            except StopIteration:
                yield ready
                return
            yield ready
