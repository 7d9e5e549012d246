"""The DataLoader settings a tuner chooses between, as plain data."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class LoaderSettings:
    """Worker parallelism and buffering of a ``DataLoader``; everything else stays the user's."""

    num_workers: int = 0
    prefetch_factor: int | None = None  # batches buffered per worker; None when num_workers == 0
    pin_memory: bool = False
    persistent_workers: bool = False

    def __post_init__(self) -> None:
        if self.num_workers == 0 and (self.prefetch_factor is not None or self.persistent_workers):
            # DataLoader itself rejects these; normalising keeps equal settings equal.
            object.__setattr__(self, "prefetch_factor", None)
            object.__setattr__(self, "persistent_workers", False)

    @property
    def buffered_batches(self) -> int:
        """Batches in flight at once: what the memory budget has to hold."""
        return self.num_workers * (self.prefetch_factor or 2) if self.num_workers else 1

    def as_kwargs(self) -> dict[str, Any]:
        return asdict(self)

    def label(self) -> str:
        if not self.num_workers:
            return f"workers=0 pin={int(self.pin_memory)}"
        return f"workers={self.num_workers} prefetch={self.prefetch_factor or 2} pin={int(self.pin_memory)}"
