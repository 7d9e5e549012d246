"""Input pipelines for ``bench prefetch``: JPEG decoding (map-style and a tar stream) and a latency-bound stream.

Nothing is downloaded: :func:`write_jpegs` draws images (smooth colour fields with
noise, so they compress like photographs rather than like noise) and encodes them with
Pillow at bench time. :class:`JpegFiles` decodes one file per item, the way an
``ImageFolder`` does; :class:`JpegTarStream` reads the same images from webdataset-style
tar shards (``000042.jpg`` + ``000042.cls`` per sample) with the standard library's
``tarfile``, one shard per worker at a time, endlessly. Both apply the usual training
transforms: random resized crop, horizontal flip, conversion to a normalised CHW float
tensor; that work, not I/O, is what the loader's workers spend their time on.
:class:`LatencyStream` is issue 15's held-out stream: every item waits ``latency_s`` (I/O),
forever.
"""

from __future__ import annotations

import io
import os
import random
import tarfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_accel.prefetch.stream import PositionStream

MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)  # ImageNet statistics, as torchvision's recipes use
STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def _pil() -> Any:
    try:
        from PIL import Image
    except ImportError:  # pragma: no cover - the bench extra installs it
        raise SystemExit("the JPEG workloads need Pillow: pip install 'lightning-accel[bench]' (or pip install pillow)") from None
    return Image


def write_jpegs(directory: str | Path, count: int, size: tuple[int, int] = (320, 240), seed: int = 0) -> list[Path]:
    """``count`` JPEG files of ``size`` (width, height) in ``directory``, with labels 0-9 in their names."""
    Image = _pil()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    w, h = size
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    paths = []
    for i in range(count):
        a, b, c = rng.uniform(0.005, 0.05, 3)
        phase = rng.uniform(0, 6.28, 3)
        field = np.stack([np.sin(a * xx + phase[0]), np.cos(b * yy + phase[1]), np.sin(c * (xx + yy) + phase[2])], -1)
        pixels = np.clip(127.5 * (field + 1) + rng.normal(0, 12, field.shape), 0, 255).astype(np.uint8)
        path = directory / f"{i:06d}_{i % 10}.jpg"
        Image.fromarray(pixels).save(path, quality=90)
        paths.append(path)
    return paths


def write_shards(paths: list[Path], directory: str | Path, per_shard: int) -> list[Path]:
    """Pack ``paths`` into webdataset-style tars: ``KEY.jpg`` and ``KEY.cls`` per sample, ``per_shard`` samples each."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shards = []
    for s in range(0, len(paths), per_shard):
        shard = directory / f"shard-{s // per_shard:06d}.tar"
        with tarfile.open(shard, "w") as tar:
            for path in paths[s : s + per_shard]:
                key, label = path.stem.split("_")
                tar.add(path, arcname=f"{key}.jpg")
                data = label.encode()
                info = tarfile.TarInfo(f"{key}.cls")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        shards.append(shard)
    return shards


def augment(jpeg: bytes | Path, out: int, rng: random.Random) -> torch.Tensor:
    """Decode, random resized crop to ``out`` x ``out``, random flip, normalise: a ``(3, out, out)`` float tensor."""
    Image = _pil()
    with Image.open(io.BytesIO(jpeg) if isinstance(jpeg, bytes) else jpeg) as image:
        image = image.convert("RGB")
        w, h = image.size
        scale, ratio = rng.uniform(0.35, 1.0), rng.uniform(3 / 4, 4 / 3)
        cw = min(w, int(round((scale * w * h * ratio) ** 0.5)))
        ch = min(h, int(round((scale * w * h / ratio) ** 0.5)))
        x, y = rng.randint(0, w - cw), rng.randint(0, h - ch)
        image = image.resize((out, out), Image.BILINEAR, box=(x, y, x + cw, y + ch))
        if rng.random() < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        pixels = np.asarray(image, dtype=np.float32) / 255.0
    return torch.from_numpy(((pixels - MEAN) / STD).transpose(2, 0, 1).copy())


class JpegFiles(Dataset):
    """Map-style: item ``i`` decodes file ``i`` (an ``ImageFolder``-like dataset); ``(image, label)``."""

    def __init__(self, paths: list[Path], out: int = 128, seed: int = 0) -> None:
        self.paths, self.out, self.seed = list(paths), out, seed

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        path = self.paths[i]
        label = int(path.stem.split("_")[1])
        return augment(path, self.out, random.Random(self.seed * 1_000_003 + i)), torch.tensor(label)


class JpegTarStream(PositionStream):
    """Webdataset-style tar shards read as one endless stream; each worker reads whole shards in turn.

    Position ``p`` is sample ``p mod total`` (the shards repeat, as an endless epoch
    does). The shards' member offsets are indexed once, in the main process, so a
    worker seeks straight to its sample (what webdataset's ``wids`` does) and the stream
    follows the position protocol: a tuned loader takes over at the exact sample.
    """

    def __init__(self, shards: list[Path], out: int = 128, seed: int = 0) -> None:
        self.index: list[tuple[int, int, int, int]] = []  # (shard, jpg offset, jpg size, label)
        for s, shard in enumerate(shards):
            with tarfile.open(shard) as tar:
                members = {m.name: m for m in tar.getmembers()}
                for name in sorted(n for n in members if n.endswith(".jpg")):
                    cls = tar.extractfile(members[name[:-4] + ".cls"])
                    assert cls is not None
                    jpg = members[name]
                    self.index.append((s, jpg.offset_data, jpg.size, int(cls.read())))
        per_shard = len(self.index) // max(1, len(shards))
        super().__init__(length=None, chunk=max(1, per_shard))
        self.shards, self.out, self.seed = [str(s) for s in shards], out, seed
        self._open: tuple[int, Any] | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_open": None}  # file handles stay in the process that opened them

    def read(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        shard, offset, size, label = self.index[position % len(self.index)]
        # A forked worker inherits the parent's handle, and with it a file offset both would move: its own, per process.
        key = (os.getpid(), shard)
        if self._open is None or self._open[0] != key:
            if self._open is not None and self._open[0][0] == key[0]:
                self._open[1].close()
            self._open = (key, open(self.shards[shard], "rb"))  # noqa: SIM115 - kept open while reading the shard
        f = self._open[1]
        f.seek(offset)
        image = augment(f.read(size), self.out, random.Random(self.seed * 1_000_003 + position))
        return image, torch.tensor(label)


class LatencyStream(PositionStream):
    """Issue 15's held-out stream: endless, each item ``latency_s`` of I/O wait; ``(x, position)``."""

    def __init__(self, latency_s: float = 0.2, shape: tuple[int, ...] = (3, 64, 64)) -> None:
        super().__init__(length=None)
        self.latency_s, self.shape = latency_s, shape

    def read(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(self.latency_s)
        return torch.full(self.shape, float(position % 1000)), torch.tensor(position)
