"""Procedural shapes: determinism, balance, value ranges, geometry, and that it is learnable."""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from lightning_accel.data.shapes import SHAPE_KINDS, ShapesDataModule, render_shapes


@pytest.fixture
def one_thread() -> Iterator[None]:
    # Two OpenMP threads on a shared 2-core box spin against other processes: 30x slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _setup(**kwargs: object) -> ShapesDataModule:
    dm = ShapesDataModule(**kwargs)  # type: ignore[arg-type]
    dm.setup()
    return dm


def test_images_are_deterministic_per_seed_split_and_index() -> None:
    a = _setup(train_samples=64, val_samples=16, image_size=16, seed=1)
    b = _setup(train_samples=64, val_samples=16, image_size=16, seed=1)
    assert torch.equal(a.train_set.tensors[0], b.train_set.tensors[0])
    other = _setup(train_samples=64, val_samples=16, image_size=16, seed=2)
    assert not torch.equal(a.train_set.tensors[0], other.train_set.tensors[0])
    # Image i does not depend on how many images were asked for...
    fewer = _setup(train_samples=32, val_samples=16, image_size=16, seed=1)
    assert torch.equal(fewer.train_set.tensors[0], a.train_set.tensors[0][:32])
    # ...and the splits are different draws, not copies.
    assert not torch.equal(a.val_set.tensors[0], a.train_set.tensors[0][:16])


def test_classes_are_balanced_and_values_normalized() -> None:
    dm = _setup(num_classes=6, train_samples=4096, val_samples=100, test_samples=10)
    images, labels = dm.train_set.tensors
    assert images.shape == (4096, 3, 32, 32) and images.dtype == torch.float32
    assert labels.dtype == torch.long
    assert torch.bincount(labels).tolist() == [683, 683, 683, 683, 682, 682]  # 4096 = 6 * 682 + 4
    assert float(images.min()) >= -1.0 and float(images.max()) <= 1.0
    assert abs(float(images.mean())) < 0.1  # zero-centred
    assert len(dm.val_set) == 100 and len(dm.test_set) == 10
    assert dm.input_shape == (3, 32, 32)


def test_noise_free_images_hold_exactly_two_colours() -> None:
    dm = _setup(num_classes=8, train_samples=16, val_samples=0, image_size=24, noise=0.0)
    for image in dm.train_set.tensors[0]:
        pixels = image.flatten(1).T.unique(dim=0)  # distinct RGB triples
        assert len(pixels) == 2  # foreground shape and background, both present


def test_rendered_circle_has_the_area_of_a_circle() -> None:
    # Reference computed another way: a radius-10 disc covers about pi * 100 pixels.
    params = np.array([[32, 32, 10, 1, 1, 1, 0, 0, 0]], dtype=np.float32)  # cx, cy, r, fg, bg
    image = render_shapes(params, np.array([SHAPE_KINDS.index("circle")]), np.zeros((1, 3, 64, 64), np.float32), 64)
    area = int((image[0, 0] > 0).sum())
    assert abs(area - math.pi * 100) < 10
    square = render_shapes(params, np.array([SHAPE_KINDS.index("square")]), np.zeros((1, 3, 64, 64), np.float32), 64)
    assert int((square[0, 0] > 0).sum()) == 16 * 16  # half-side 0.8 * 10 px


def test_a_tiny_cnn_learns_it(one_thread: None) -> None:
    torch.manual_seed(0)
    dm = ShapesDataModule(num_classes=6, image_size=16, train_samples=1024, val_samples=256, batch_size=32, seed=0)
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 16, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveMaxPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(16, 6),
    )
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    steps = 0
    while steps < 150:
        for x, y in dm.train_dataloader():
            loss = torch.nn.functional.cross_entropy(net(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
            if steps == 150:
                break
    x_val, y_val = dm.val_set.tensors
    with torch.no_grad():
        accuracy = float((net(x_val).argmax(1) == y_val).float().mean())
    assert accuracy > 0.7  # chance is 1/6


def test_loaders_and_empty_splits() -> None:
    dm = ShapesDataModule(train_samples=40, val_samples=0, batch_size=16, image_size=8)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (16, 3, 8, 8) and y.shape == (16,)
    assert dm.val_dataloader() == []
    with pytest.raises(ValueError, match=r"the test split is empty; pass data.test_samples="):
        dm.test_dataloader()


def test_bad_arguments_are_rejected() -> None:
    with pytest.raises(ValueError, match=r"num_classes=9 is not in \[2, 8\]; pass data.num_classes=<2..8>"):
        ShapesDataModule(num_classes=9)
    with pytest.raises(ValueError, match=r"image_size=4 is below 8 pixels.*; pass data.image_size="):
        ShapesDataModule(image_size=4)
    with pytest.raises(ValueError, match=r"noise=-0.1 is negative; pass data.noise="):
        ShapesDataModule(noise=-0.1)
    with pytest.raises(ValueError, match=r"val_samples=-1 is not an integer >= 0; pass data.val_samples="):
        ShapesDataModule(val_samples=-1)
