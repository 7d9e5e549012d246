"""Synthetic token and image batches whose per-batch latency and size are configurable.

Prefetch tuning needs a loader whose cost is known: each item sleeps ``latency_s``
(standing in for I/O, which releases the GIL), optionally burns ``cpu_work_s`` of CPU time
(standing in for Python-side decoding, which holds it) and carries an array of a
chosen shape. Item ``i`` is a pure function of ``(seed, i)``, so it is identical in
every worker process, after re-creation, and under any sampling order.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence, Sized

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Subset, get_worker_info

from lightning_accel.data.loaders import check_num_workers, distributed_shard, seeded_loader

__all__ = [
    "SyntheticArrays",
    "SyntheticDataModule",
    "SyntheticImages",
    "SyntheticStream",
    "SyntheticTokens",
    "item_generator",
]

_KINDS = ("images", "tokens", "arrays")
_TILE = 1 << 16  # random values drawn per item at most; larger arrays repeat them


def item_generator(seed: int, index: int) -> torch.Generator:
    """A generator seeded from ``(seed, index)`` only.

    ``SeedSequence`` mixes the pair, so nearby seeds or indices give unrelated streams
    (``seed + index`` would make seed 1's item 0 equal seed 0's item 1).
    """
    state = np.random.SeedSequence([seed, index]).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


def _fill(shape: tuple[int, ...], generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Standard-normal values of ``shape``; beyond ``_TILE`` values a random tile repeats.

    Drawing 12M normals costs ~0.1 s, which would swamp the configured latency; the
    tile keeps an item's cost at the unavoidable memory write (~20 ms for 48 MB).
    """
    numel = math.prod(shape)
    if numel <= _TILE:
        return torch.randn(shape, generator=generator).to(dtype)
    tile = torch.randn(_TILE, generator=generator)
    return tile.repeat(math.ceil(numel / _TILE))[:numel].view(shape).to(dtype)


def _spin(seconds: float) -> None:
    # A Python busy loop holds the GIL, like decoding code does; sleep would not. It
    # counts this thread's CPU time, so a fixed amount of work takes longer in wall
    # time when workers outnumber cores, exactly as real decoding would.
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def _positive(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} is not a positive integer; pass data.{name}=<an integer >= 1>")
    return value


def _non_negative(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{name}={value!r} is not a number >= 0; pass data.{name}=<seconds, e.g. 0.01>")
    return float(value)


def _shape(value: Sequence[int]) -> tuple[int, ...]:
    # Hydra hands over a ListConfig; a tuple of plain ints is what torch wants.
    try:
        shape = tuple(int(s) for s in value)
    except (TypeError, ValueError):
        shape = ()
    if not shape or any(s <= 0 for s in shape):
        raise ValueError(f"shape={value!r} is not a list of positive integers; pass data.shape=[3,32,32] or similar")
    return shape


def _dtype(value: str | torch.dtype) -> torch.dtype:
    dtype = getattr(torch, value, None) if isinstance(value, str) else value
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype={value!r} is not a torch floating dtype; pass data.dtype=float32, float16 or bfloat16")
    return dtype


class _SyntheticItems(Dataset):
    """Shared cost model: validate the index, pay latency and CPU work, then build item."""

    def __init__(self, length: int, latency_s: float, cpu_work_s: float, seed: int) -> None:
        self.length = _positive("length", length)
        self.latency_s = _non_negative("latency_s", latency_s)
        self.cpu_work_s = _non_negative("cpu_work_s", cpu_work_s)
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r} is not an integer >= 0; pass data.seed=<0 or more>")
        self.seed = seed

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < self.length:
            raise IndexError(f"item {index} out of range for {self.length} items")
        if self.latency_s:
            time.sleep(self.latency_s)
        if self.cpu_work_s:
            _spin(self.cpu_work_s)
        return self._make(item_generator(self.seed, index))

    def _make(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


class SyntheticTokens(_SyntheticItems):
    """``(x, y)`` int64 token windows of shape ``(seq_len,)``, ``y`` = ``x`` shifted by one."""

    def __init__(
        self,
        length: int,
        seq_len: int = 128,
        vocab_size: int = 256,
        latency_s: float = 0.0,
        seed: int = 1234,
        cpu_work_s: float = 0.0,
    ) -> None:
        super().__init__(length, latency_s, cpu_work_s, seed)
        self.seq_len = _positive("seq_len", seq_len)
        self.vocab_size = _positive("vocab_size", vocab_size)

    def _make(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(self.vocab_size, (self.seq_len + 1,), generator=generator)  # (T+1,) int64
        return tokens[:-1], tokens[1:]


class SyntheticImages(_SyntheticItems):
    """``(image, label)``: a float32 standard-normal image of ``shape`` and an int64 class."""

    def __init__(
        self,
        length: int,
        shape: Sequence[int] = (3, 32, 32),
        num_classes: int = 10,
        latency_s: float = 0.0,
        seed: int = 1234,
        cpu_work_s: float = 0.0,
    ) -> None:
        super().__init__(length, latency_s, cpu_work_s, seed)
        self.shape = _shape(shape)
        self.num_classes = _positive("num_classes", num_classes)

    def _make(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        label = torch.randint(self.num_classes, (), generator=generator)  # () int64
        return _fill(self.shape, generator, torch.float32), label


class SyntheticArrays(_SyntheticItems):
    """``(array, target)``: a large array (default 48 MB, like seed 004's items) and a ``(1,)`` target.

    The default ``latency_s=0.5`` matches that workload: slow storage, big items.
    """

    def __init__(
        self,
        length: int,
        shape: Sequence[int] = (4, 1_000_000, 3),
        latency_s: float = 0.5,
        dtype: str | torch.dtype = "float32",
        seed: int = 1234,
        cpu_work_s: float = 0.0,
    ) -> None:
        super().__init__(length, latency_s, cpu_work_s, seed)
        self.shape = _shape(shape)
        self.dtype = _dtype(dtype)

    def _make(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        target = torch.randn(1, generator=generator).to(self.dtype)  # (1,)
        return _fill(self.shape, generator, self.dtype), target


class SyntheticStream(IterableDataset):
    """A map-style dataset streamed in index order, sharded across DataLoader workers.

    Worker ``w`` of ``n`` yields chunks ``w, w + n, w + 2n, ...`` of ``chunk``
    consecutive indices, so every index appears exactly once over all workers. With
    ``chunk = batch_size`` each worker emits whole batches and the loader yields
    exactly ``ceil(len / batch_size)`` batches, which is what ``len()`` promises
    Lightning. Shards over workers only; under DDP give each rank its own dataset.
    """

    def __init__(self, dataset: Dataset, chunk: int = 1) -> None:
        if not isinstance(dataset, Sized):
            raise TypeError(f"dataset {type(dataset).__name__} has no len(); pass a map-style dataset such as SyntheticImages")
        self.dataset = dataset
        self.chunk = _positive("chunk", chunk)

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        n = len(self)
        for start in range(worker * self.chunk, n, workers * self.chunk):
            for index in range(start, min(start + self.chunk, n)):
                yield self.dataset[index]


class SyntheticDataModule(L.LightningDataModule):
    """Train/val loaders over synthetic items, for measuring input pipelines, not accuracy.

    Validation items are items ``num_samples ...`` of the same stream, so they never
    repeat a training item. ``iterable=True`` serves a ``SyntheticStream`` (no
    shuffling) to exercise the iterable-dataset path of a prefetcher.
    """

    def __init__(
        self,
        kind: str = "images",
        num_samples: int = 1024,
        val_samples: int = 128,
        batch_size: int = 32,
        latency_s: float = 0.0,
        cpu_work_s: float = 0.0,
        shape: Sequence[int] | None = None,
        seq_len: int = 128,
        vocab_size: int = 256,
        num_classes: int = 10,
        dtype: str = "float32",
        num_workers: int = 0,
        pin_memory: bool = False,
        prefetch_factor: int | None = None,
        iterable: bool = False,
        seed: int = 1234,
    ) -> None:
        super().__init__()
        if kind not in _KINDS:
            raise ValueError(f"data.kind={kind!r} is not one of {', '.join(_KINDS)}; pass data.kind=images, tokens or arrays")
        _positive("num_samples", num_samples)
        _positive("batch_size", batch_size)
        if isinstance(val_samples, bool) or not isinstance(val_samples, int) or val_samples < 0:
            raise ValueError(f"val_samples={val_samples!r} is not an integer >= 0; pass data.val_samples=<0 or more>")
        check_num_workers(num_workers)
        if prefetch_factor is not None:
            _positive("prefetch_factor", prefetch_factor)
            if num_workers == 0:
                raise ValueError(f"prefetch_factor={prefetch_factor} needs worker processes; pass data.num_workers=<1 or more> or data.prefetch_factor=null")
        self.kind = kind
        self.num_samples = num_samples
        self.val_samples = val_samples
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.prefetch_factor = prefetch_factor
        self.iterable = iterable
        self.seed = seed
        self.vocab_size = vocab_size
        self.num_classes = num_classes
        # One dataset covers train and val: train is [0, num_samples), val the next val_samples.
        total = num_samples + val_samples
        self.dataset: _SyntheticItems
        if kind == "tokens":
            self.dataset = SyntheticTokens(total, seq_len, vocab_size, latency_s, seed, cpu_work_s)
        elif kind == "images":
            self.dataset = SyntheticImages(total, shape or (3, 32, 32), num_classes, latency_s, seed, cpu_work_s)
        else:
            self.dataset = SyntheticArrays(total, shape or (4, 1_000_000, 3), latency_s, dtype, seed, cpu_work_s)

    def _loader(self, indices: range, shuffle: bool) -> DataLoader:
        subset = Subset(self.dataset, indices)
        extra = {"prefetch_factor": self.prefetch_factor} if self.prefetch_factor is not None else {}
        common = dict(
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            persistent_workers=self.num_workers > 0,
            **extra,
        )
        if self.iterable:
            return DataLoader(SyntheticStream(subset, chunk=self.batch_size), **common)
        return seeded_loader(subset, batch_size=self.batch_size, shuffle=shuffle, seed=self.seed,
                             num_workers=self.num_workers, pin_memory=self.pin_memory,
                             shard=distributed_shard(self.trainer), **extra)

    def train_dataloader(self) -> DataLoader:
        return self._loader(range(self.num_samples), shuffle=True)

    def val_dataloader(self) -> DataLoader | list:
        if self.val_samples == 0:
            return []  # Lightning then skips validation instead of failing
        return self._loader(range(self.num_samples, self.num_samples + self.val_samples), shuffle=False)
