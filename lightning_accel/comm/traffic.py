"""Counting the bytes a process all-reduces through ``torch.distributed``.

DDP communication hooks (and PowerSGD's second round inside a future callback) call
``torch.distributed.all_reduce`` by attribute lookup, so replacing that attribute for the
duration of a measurement sees every tensor they send, whatever its dtype or shape.
DDP's built-in C++ reducer does not come through Python: meter the ``"allreduce"`` hook,
which has the same numerics, to measure plain DDP.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist


@dataclasses.dataclass
class Traffic:
    """What one process handed to all-reduce while metered."""

    calls: int = 0
    bytes: int = 0
    bytes_by_dtype: dict[str, int] = dataclasses.field(default_factory=dict)  # "float16" -> bytes

    def reset(self) -> None:
        self.calls = self.bytes = 0
        self.bytes_by_dtype.clear()


@contextmanager
def metered_all_reduce() -> Iterator[Traffic]:
    """Count ``torch.distributed.all_reduce`` calls and bytes in this process while inside."""
    traffic = Traffic()
    lock = threading.Lock()  # future callbacks may run on the backend's threads
    original = dist.all_reduce

    def counting(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        with lock:
            size = tensor.numel() * tensor.element_size()
            dtype = str(tensor.dtype).removeprefix("torch.")
            traffic.calls += 1
            traffic.bytes += size
            traffic.bytes_by_dtype[dtype] = traffic.bytes_by_dtype.get(dtype, 0) + size
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        yield traffic
    finally:
        dist.all_reduce = original
