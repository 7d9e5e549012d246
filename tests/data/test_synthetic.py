"""Synthetic items: determinism per index, configured cost, and worker sharding."""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_accel.data.synthetic import (
    SyntheticArrays,
    SyntheticDataModule,
    SyntheticImages,
    SyntheticStream,
    SyntheticTokens,
    item_generator,
)


class Indices(Dataset):
    """Item i is i: makes lost or duplicated indices visible."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


def _equal(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize(
    "make",
    [
        lambda seed: SyntheticTokens(10, seq_len=12, vocab_size=50, seed=seed),
        lambda seed: SyntheticImages(10, shape=(3, 8, 8), num_classes=4, seed=seed),
        lambda seed: SyntheticArrays(10, shape=(2, 40_000, 3), latency_s=0.0, seed=seed),
    ],
    ids=["tokens", "images", "arrays"],
)
def test_items_depend_only_on_seed_and_index(make) -> None:
    ds = make(7)
    forward = [ds[i] for i in range(len(ds))]
    backward = [make(7)[i] for i in reversed(range(len(ds)))][::-1]  # re-created, other order
    assert all(_equal(a, b) for a, b in zip(forward, backward))
    assert not torch.equal(forward[0][0], forward[1][0])
    assert not torch.equal(forward[0][0], make(8)[0][0])
    # Nearby seeds and indices must not alias: seed 7 item 1 is not seed 8 item 0.
    assert not torch.equal(forward[1][0], make(8)[0][0])


def test_item_generator_is_a_function_of_seed_and_index() -> None:
    a = torch.rand(4, generator=item_generator(3, 9))
    assert torch.equal(a, torch.rand(4, generator=item_generator(3, 9)))
    assert not torch.equal(a, torch.rand(4, generator=item_generator(3, 10)))
    assert not torch.equal(a, torch.rand(4, generator=item_generator(4, 9)))


def test_item_shapes_and_types() -> None:
    x, y = SyntheticTokens(3, seq_len=12, vocab_size=50)[2]
    assert x.shape == y.shape == (12,) and x.dtype == torch.long
    assert torch.equal(x[1:], y[:-1])  # y is x shifted by one
    assert 0 <= int(x.min()) and int(x.max()) < 50

    image, label = SyntheticImages(3, shape=[1, 5, 7], num_classes=4)[0]  # a list, as Hydra gives
    assert image.shape == (1, 5, 7) and image.dtype == torch.float32
    assert label.shape == () and label.dtype == torch.long and 0 <= int(label) < 4

    array, target = SyntheticArrays(2, shape=(4, 100_000, 3), latency_s=0, dtype="float16")[1]
    assert array.shape == (4, 100_000, 3) and array.dtype == torch.float16
    assert target.shape == (1,) and target.dtype == torch.float16
    # Large arrays repeat a tile of normals; the values still look standard normal.
    assert abs(float(array.float().mean())) < 0.05 and 0.9 < float(array.float().std()) < 1.1


def test_default_arrays_match_the_seed_004_workload() -> None:
    ds = SyntheticArrays(2)
    assert ds.shape == (4, 1_000_000, 3) and ds.latency_s == 0.5 and ds.dtype == torch.float32


def test_latency_and_cpu_work_are_honoured() -> None:
    images = SyntheticImages(4, shape=(3, 8, 8), latency_s=0.05)
    start = time.perf_counter()
    for i in range(4):
        images[i]
    elapsed = time.perf_counter() - start
    assert 0.2 <= elapsed < 2.0

    tokens = SyntheticTokens(2, seq_len=8, cpu_work_s=0.05)
    start_cpu = time.process_time()
    tokens[0], tokens[1]
    assert time.process_time() - start_cpu >= 0.09  # busy CPU, not sleep


@pytest.mark.parametrize(("workers", "chunk"), [(0, 1), (2, 1), (2, 3)])
def test_stream_shards_every_index_exactly_once(workers: int, chunk: int) -> None:
    stream = SyntheticStream(Indices(11), chunk=chunk)
    seen = [int(i) for batch in DataLoader(stream, batch_size=2, num_workers=workers) for i in batch]
    assert sorted(seen) == list(range(11))


def test_stream_of_synthetic_items_matches_the_map_style_items() -> None:
    base = SyntheticTokens(9, seq_len=6, vocab_size=1000)
    loader = DataLoader(SyntheticStream(base, chunk=4), batch_size=4, num_workers=2)
    batches = list(loader)
    assert len(batches) == len(loader) == math.ceil(9 / 4)  # chunk = batch size: len() holds
    streamed = sorted(map(tuple, torch.cat([x for x, _ in batches]).tolist()))
    assert streamed == sorted(tuple(base[i][0].tolist()) for i in range(9))


def test_datamodule_train_and_val_are_disjoint_parts_of_one_stream() -> None:
    dm = SyntheticDataModule(kind="tokens", num_samples=10, val_samples=4, batch_size=5, seq_len=6, vocab_size=1000, seed=3)
    reference = SyntheticTokens(14, seq_len=6, vocab_size=1000, seed=3)
    val = torch.cat([x for x, _ in dm.val_dataloader()])
    assert torch.equal(val, torch.stack([reference[i][0] for i in range(10, 14)]))
    train = torch.cat([x for x, _ in dm.train_dataloader()])
    assert sorted(map(tuple, train.tolist())) == sorted(tuple(reference[i][0].tolist()) for i in range(10))


def test_datamodule_shuffle_is_seeded() -> None:
    def first(seed: int) -> torch.Tensor:
        dm = SyntheticDataModule(kind="images", num_samples=64, batch_size=8, shape=(1, 2, 2), seed=seed)
        return next(iter(dm.train_dataloader()))[0]

    assert torch.equal(first(5), first(5))
    assert not torch.equal(first(5), first(6))


def test_datamodule_iterable_mode_and_loader_options() -> None:
    dm = SyntheticDataModule(
        kind="arrays", num_samples=5, val_samples=0, batch_size=2, shape=(3, 4), num_workers=2, prefetch_factor=3, iterable=True
    )
    loader = dm.train_dataloader()
    assert isinstance(loader.dataset, SyntheticStream)
    assert loader.prefetch_factor == 3 and loader.persistent_workers
    sizes = [len(x) for x, _ in loader]
    assert sorted(sizes) == [1, 2, 2] and len(loader) == 3
    assert dm.val_dataloader() == []


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"data.kind='audio' is not one of images, tokens, arrays; pass data.kind="):
        SyntheticDataModule(kind="audio")
    with pytest.raises(ValueError, match=r"prefetch_factor=2 needs worker processes; pass data.num_workers="):
        SyntheticDataModule(prefetch_factor=2)
    with pytest.raises(ValueError, match=r"latency_s=-1 is not a number >= 0; pass data.latency_s="):
        SyntheticImages(4, latency_s=-1)
    with pytest.raises(ValueError, match=r"shape=\[3, 0\] is not a list of positive integers; pass data.shape="):
        SyntheticImages(4, shape=[3, 0])
    with pytest.raises(ValueError, match=r"dtype='int8' is not a torch floating dtype; pass data.dtype="):
        SyntheticArrays(4, dtype="int8")
    with pytest.raises(ValueError, match=r"num_samples=0 is not a positive integer; pass data.num_samples="):
        SyntheticDataModule(num_samples=0)
    with pytest.raises(IndexError, match=r"item 4 out of range for 4 items"):
        SyntheticImages(4)[4]
    with pytest.raises(TypeError, match=r"has no len\(\); pass a map-style dataset"):
        SyntheticStream(iter([1, 2]))  # type: ignore[arg-type]
