"""A procedurally drawn image classification set (a real, learnable task, generated offline).

Each image shows one shape (the class) at a random position, size and colour on a
random background, plus Gaussian noise. Unlike random tensors it can be learned, so a
recipe's accuracy says whether training works; unlike CIFAR it needs no download.
Image ``i`` of a split depends only on ``(seed, split, i)``: changing ``train_samples``
does not change the images that remain.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import TensorDataset

from lightning_accel.data.loaders import LoaderDataModule

__all__ = ["SHAPE_KINDS", "ShapesDataModule", "render_shapes"]

# Class k is SHAPE_KINDS[k]; num_classes=n uses the first n.
SHAPE_KINDS = ("circle", "square", "triangle", "cross", "hbars", "vbars", "ring", "diagonal")
_SPLITS = {"train": 0, "val": 1, "test": 2}
_N_PARAMS = 9  # per image: cx, cy, radius, 3 x foreground colour, 3 x background colour


def _shape_mask(kind: int, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Boolean mask of shape ``SHAPE_KINDS[kind]`` in the shapes' own unit coordinates.

    ``u`` (right) and ``v`` (down) are pixel offsets from the shape's centre divided by
    its radius, so every shape spans roughly [-1, 1] whatever its size.
    """
    inside = (np.abs(u) <= 1) & (np.abs(v) <= 1)
    name = SHAPE_KINDS[kind]
    if name == "circle":
        return u**2 + v**2 <= 1
    if name == "square":
        return (np.abs(u) <= 0.8) & (np.abs(v) <= 0.8)
    if name == "triangle":  # apex up
        return inside & (np.abs(u) <= (v + 1) / 2)
    if name == "cross":
        return inside & ((np.abs(u) <= 0.3) | (np.abs(v) <= 0.3))
    if name == "hbars":  # three horizontal bars
        return inside & (np.floor((v + 1) * 2.5) % 2 == 0)
    if name == "vbars":  # three vertical bars
        return inside & (np.floor((u + 1) * 2.5) % 2 == 0)
    if name == "ring":
        return (u**2 + v**2 <= 1) & (u**2 + v**2 >= 0.55**2)
    return inside & (np.abs(u - v) <= 0.4)  # diagonal bar


def render_shapes(params: np.ndarray, labels: np.ndarray, noise: np.ndarray, image_size: int) -> np.ndarray:
    """Draw images (n, 3, S, S) in roughly [-1, 1] from per-image parameters (n, 9).

    Vectorized over images: 4096 images of 32x32 take well under a second.
    """
    s = image_size
    grid = np.arange(s, dtype=np.float32) + 0.5  # pixel centres
    cx, cy, radius = (params[:, i, None, None] for i in range(3))  # each (n, 1, 1)
    u = (grid[None, None, :] - cx) / radius  # (n, 1, S)
    v = (grid[None, :, None] - cy) / radius  # (n, S, 1)
    mask = np.zeros((len(params), 1, s, s), dtype=bool)  # (n, 1, S, S)
    for kind in np.unique(labels):
        # Each kind is drawn only for its own images: 1/num_classes of the work of all.
        rows = labels == kind
        mask[rows, 0] = _shape_mask(int(kind), u[rows], v[rows])
    fg = params[:, 3:6, None, None]  # (n, 3, 1, 1)
    bg = params[:, 6:9, None, None]
    image = np.where(mask, fg, bg).astype(np.float32)  # (n, 3, S, S) in [0, 1]
    # In place: these arrays are 50 MB at the defaults, and copies dominate the time.
    image += noise
    np.clip(image, 0.0, 1.0, out=image)
    # Map [0, 1] to [-1, 1] (zero-centred inputs, the usual normalization for small nets).
    image *= 2.0
    image -= 1.0
    return image


def _draw(seed: int, split: int, count: int, num_classes: int, image_size: int, noise: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Images (count, 3, S, S) float32 and labels (count,) int64 for one split."""
    s = image_size
    params = np.empty((count, _N_PARAMS), dtype=np.float32)
    noises = np.empty((count, 3, s, s), dtype=np.float32)
    # Classes cycle 0..n-1, so every split is balanced to within one image per class.
    labels = np.arange(count) % num_classes
    for i in range(count):
        rng = np.random.default_rng([seed, split, i])
        radius = rng.uniform(0.2, 0.4) * s
        # Keep the shape inside the frame: its extent is about one radius from the centre.
        cx, cy = rng.uniform(radius, s - radius, size=2)
        # Light-on-dark or dark-on-light at random, so brightness alone tells nothing.
        light, dark = rng.uniform(0.6, 1.0, size=3), rng.uniform(0.0, 0.35, size=3)
        fg, bg = (light, dark) if rng.random() < 0.5 else (dark, light)
        params[i] = (cx, cy, radius, *fg, *bg)
        noises[i] = rng.standard_normal((3, s, s), dtype=np.float32) * noise
    images = render_shapes(params, labels, noises, s)
    return torch.from_numpy(images), torch.from_numpy(labels.astype(np.int64))


class ShapesDataModule(LoaderDataModule):
    """Shape classification with ``num_classes`` of the kinds in ``SHAPE_KINDS``."""

    test_option = "data.test_samples=<an integer >= 1>"

    def __init__(
        self,
        num_classes: int = 6,
        image_size: int = 32,
        train_samples: int = 4096,
        val_samples: int = 512,
        test_samples: int = 0,
        batch_size: int = 64,
        noise: float = 0.1,
        seed: int = 1234,
        num_workers: int = 0,
        pin_memory: bool = False,
    ) -> None:
        super().__init__(batch_size=batch_size, seed=seed, num_workers=num_workers, pin_memory=pin_memory)
        if isinstance(num_classes, bool) or not isinstance(num_classes, int) or not 2 <= num_classes <= len(SHAPE_KINDS):
            raise ValueError(f"num_classes={num_classes!r} is not in [2, {len(SHAPE_KINDS)}]; pass data.num_classes=<2..{len(SHAPE_KINDS)}>")
        if isinstance(image_size, bool) or not isinstance(image_size, int) or image_size < 8:
            raise ValueError(f"image_size={image_size!r} is below 8 pixels, too small to draw shapes; pass data.image_size=<8 or more, e.g. 32>")
        if isinstance(train_samples, bool) or not isinstance(train_samples, int) or train_samples < 1:
            raise ValueError(f"train_samples={train_samples!r} is not a positive integer; pass data.train_samples=<an integer >= 1>")
        for name, value in (("val_samples", val_samples), ("test_samples", test_samples)):  # num_workers: LoaderDataModule's
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} is not an integer >= 0; pass data.{name}=<0 or more>")
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r} is not a positive integer; pass data.batch_size=<an integer >= 1>")
        if not 0.0 <= noise:
            raise ValueError(f"noise={noise!r} is negative; pass data.noise=<a standard deviation >= 0, e.g. 0.1>")
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r} is not an integer >= 0; pass data.seed=<0 or more>")
        self.num_classes = num_classes
        self.image_size = image_size
        self.train_samples = train_samples
        self.val_samples = val_samples
        self.test_samples = test_samples
        self.noise = float(noise)

    @property
    def input_shape(self) -> tuple[int, int, int]:
        """``(3, image_size, image_size)``: what a model's first layer receives per item."""
        return (3, self.image_size, self.image_size)

    def _split(self, name: str, count: int) -> TensorDataset:
        images, labels = _draw(self.seed, _SPLITS[name], count, self.num_classes, self.image_size, self.noise)
        return TensorDataset(images, labels)

    def setup(self, stage: str | None = None) -> None:
        # Drawn once, then served from memory: a few MB, and no per-item cost in workers.
        if self.train_set is None:
            self.train_set = self._split("train", self.train_samples)
            self.val_set = self._split("val", self.val_samples)
            self.test_set = self._split("test", self.test_samples)
