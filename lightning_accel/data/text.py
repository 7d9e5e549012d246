"""Byte-level language-model data from a text file or the stdlib corpus.

Bytes are the tokens (vocabulary 256), so any file works without a trained tokenizer
and nothing is downloaded. The byte stream is cut into contiguous train / val / test
regions (val and test at the end) and each region into windows of ``block_size + 1``
bytes: no window straddles two regions, so no validation byte is ever trained on.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_accel.data.corpus import stdlib_corpus
from lightning_accel.data.loaders import LoaderDataModule

__all__ = ["ByteTokenizer", "ByteWindows", "TextDataModule"]

_SOURCES = ("stdlib", "file")


class ByteTokenizer:
    """UTF-8 bytes as token ids: lossless, vocabulary 256, no training or files needed."""

    vocab_size: int = 256

    def encode(self, text: str) -> torch.Tensor:
        """``str`` -> int64 ids of shape ``(n_bytes,)``."""
        return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        """Ids -> ``str``; a sampled sequence may end mid-character, hence ``errors="replace"``."""
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return bytes(values).decode("utf-8", errors="replace")


class ByteWindows(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping next-byte windows over a uint8 region.

    Window ``i`` reads bytes ``[i*B, i*B + B + 1)``: ``x`` is the first ``B`` of them and
    ``y`` the last ``B`` (``x`` shifted by one). Stride ``B`` makes an epoch one pass
    over the region; consecutive windows share only the one byte that is a target in
    the first and an input in the next.
    """

    def __init__(self, data: torch.Tensor, block_size: int) -> None:
        self.data = data  # (n_bytes,) uint8
        self.block_size = block_size

    def __len__(self) -> int:
        return max(0, (len(self.data) - 1) // self.block_size)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range for {len(self)} windows")
        start = index * self.block_size
        chunk = self.data[start : start + self.block_size + 1].long()  # (B+1,)
        return chunk[:-1], chunk[1:]


def _check_fraction(name: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{name}={value!r} is outside [0, 1); pass data.{name}=<a fraction such as 0.1>")


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}={value!r} is not a positive integer; pass data.{name}=<an integer >= 1>")


class TextDataModule(LoaderDataModule):
    """Next-byte prediction over the stdlib corpus (default) or a user's text file.

    Arguments are validated in ``__init__``, file size included, because the CLI
    builds the datamodule before it creates a run directory: bad input must fail
    there, not minutes later in ``setup``.
    """

    def __init__(
        self,
        source: str = "stdlib",
        path: str | None = None,
        block_size: int = 128,
        batch_size: int = 32,
        val_fraction: float = 0.1,
        test_fraction: float = 0.0,
        seed: int = 1234,
        num_workers: int = 0,
        max_bytes: int = 8_000_000,
        cache_dir: str | None = None,
        pin_memory: bool = False,
    ) -> None:
        super().__init__(batch_size=batch_size, seed=seed, num_workers=num_workers, pin_memory=pin_memory)
        if source not in _SOURCES:
            raise ValueError(f"data.source={source!r} is not one of {', '.join(_SOURCES)}; pass data.source=stdlib or data.source=file")
        if source == "stdlib" and path is not None:
            # Training on the stdlib while the user thinks it is their file would be silent and wrong.
            raise ValueError(f"data.path={path!r} is only read with data.source=file; pass data.source=file or drop data.path")
        if source == "file":
            if path is None:
                raise ValueError("data.source=file needs a path; pass data.path=<an existing UTF-8 text file>")
            file = Path(path).expanduser()
            if not file.is_file():
                what = "is not a file" if file.exists() else "does not exist"
                raise FileNotFoundError(f"text file '{file}' {what}; pass data.path=<an existing UTF-8 text file> or data.source=stdlib")
        for name, value in (("block_size", block_size), ("batch_size", batch_size), ("max_bytes", max_bytes)):
            _check_positive(name, value)
        _check_fraction("val_fraction", val_fraction)
        _check_fraction("test_fraction", test_fraction)
        if val_fraction + test_fraction >= 1.0:
            raise ValueError(
                f"val_fraction + test_fraction = {val_fraction + test_fraction:g} leaves no training text; "
                "pass data.val_fraction and data.test_fraction summing to less than 1"
            )
        self.source = source
        self.path = str(Path(path).expanduser()) if path is not None else None
        self.block_size = block_size
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.max_bytes = max_bytes
        self.cache_dir = cache_dir
        self.tokenizer = ByteTokenizer()
        if source == "file":
            self.split_bounds(Path(self.path).stat().st_size)  # raises now if the file is too small

    @property
    def vocab_size(self) -> int:
        """256: every byte value is a token."""
        return ByteTokenizer.vocab_size

    def text_path(self) -> Path:
        """The file the bytes come from; for ``source="stdlib"`` this builds the cache once."""
        if self.source == "file":
            return Path(self.path)  # type: ignore[arg-type]
        return stdlib_corpus(self.cache_dir, self.max_bytes)

    def split_bounds(self, n_bytes: int) -> tuple[int, int]:
        """``(train_end, val_end)``: train is ``[0, train_end)``, val ``[train_end, val_end)``, test the rest.

        Floors keep the sizes closed-form (``n_val = floor(n * val_fraction)``); each
        requested split must hold at least one window of ``block_size + 1`` bytes.
        """
        n_val = int(n_bytes * self.val_fraction)
        n_test = int(n_bytes * self.test_fraction)
        n_train = n_bytes - n_val - n_test
        need = self.block_size + 1
        where = f"text file '{self.path}'" if self.source == "file" else "the stdlib corpus"
        for name, size, requested in (("train", n_train, True), ("val", n_val, self.val_fraction > 0), ("test", n_test, self.test_fraction > 0)):
            if requested and size < need:
                raise ValueError(
                    f"{where} has {n_bytes} bytes, leaving {size} for the {name} split, fewer than block_size + 1 = {need}; "
                    "pass a smaller data.block_size or a larger text"
                )
        return n_train, n_train + n_val

    @property
    def num_train_windows(self) -> int:
        """Training windows per epoch, from the file size alone (no need to call ``setup``)."""
        if self.train_set is not None:
            return len(self.train_set)
        train_end, _ = self.split_bounds(self.text_path().stat().st_size)
        return max(0, (train_end - 1) // self.block_size)

    def prepare_data(self) -> None:
        # Lightning runs this on one process per node: build the corpus cache there.
        self.text_path()

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        data = torch.from_numpy(np.fromfile(self.text_path(), dtype=np.uint8))  # (n_bytes,) uint8
        train_end, val_end = self.split_bounds(len(data))
        self.train_set = ByteWindows(data[:train_end], self.block_size)
        self.val_set = ByteWindows(data[train_end:val_end], self.block_size)
        self.test_set = ByteWindows(data[val_end:], self.block_size)
