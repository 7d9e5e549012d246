"""DataLoaders with a shuffled order that is a function of the seed alone."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset


def seeded_loader(
    dataset: Dataset,
    *,
    batch_size: int,
    shuffle: bool,
    seed: int,
    num_workers: int = 0,
    pin_memory: bool = False,
    **kwargs: Any,
) -> DataLoader:
    """A DataLoader whose shuffle draws from its own ``torch.Generator`` seeded with ``seed``
    (so two runs with the same seed see the same order, whatever else consumed the global
    RNG), with workers kept alive between epochs when there are any."""
    generator = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        generator=generator,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=num_workers > 0,
        **kwargs,
    )
