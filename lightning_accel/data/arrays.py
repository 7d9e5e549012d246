"""User numpy arrays by path.

Either one ``.npz`` holding inputs and targets under two keys, or an inputs ``.npy``
plus a targets ``.npy`` (``targets_path``). Everything that can be checked from the
files' headers (existence, format, keys, equal lengths, split sizes) is checked in
``__init__``, without reading the data, so the CLI rejects bad input before a run
starts. Rows are split into train / val by a seeded permutation.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from lightning_accel.data.loaders import LoaderDataModule

__all__ = ["ArrayDataModule", "ArrayPairs"]


def _read_header(f: BinaryIO) -> tuple[int, ...]:
    """Shape from an ``.npy`` stream's header, leaving the data unread."""
    version = np.lib.format.read_magic(f)
    if version == (1, 0):
        shape, _, _ = np.lib.format.read_array_header_1_0(f)
    else:  # 2.0 and 3.0 share the header layout; 3.0 only allows UTF-8 field names
        shape, _, _ = np.lib.format.read_array_header_2_0(f)
    return tuple(shape)


def _npy_shape(path: Path, role: str, fix: str) -> tuple[int, ...]:
    try:
        with path.open("rb") as f:
            return _read_header(f)
    except ValueError as err:
        raise ValueError(f"{role} '{path}' is not a NumPy .npy file ({err}); {fix}") from None


def _npz_shapes(path: Path, keys: tuple[tuple[str, str], ...]) -> list[tuple[int, ...]]:
    """Shapes of the members named by ``(option, key)`` pairs of an ``.npz`` (a zip of ``.npy``)."""
    unreadable = f"array file '{path}' is not a readable .npz ({{}}); pass data.path=<a file written by numpy.savez>"
    try:
        z = zipfile.ZipFile(path)
    except zipfile.BadZipFile as err:
        raise ValueError(unreadable.format(err)) from None
    with z:
        present = sorted(n[: -len(".npy")] for n in z.namelist() if n.endswith(".npy"))
        shapes = []
        for option, key in keys:
            if key not in present:
                raise ValueError(f"array file '{path}' has no key '{key}' (keys: {', '.join(present) or 'none'}); pass data.{option}=<one of its keys>")
            try:
                with z.open(f"{key}.npy") as f:
                    shapes.append(_read_header(f))
            except ValueError as err:
                raise ValueError(unreadable.format(err)) from None
        return shapes


def _as_tensor(value: np.ndarray) -> torch.Tensor:
    # Copy out of a read-only memmap; float64 becomes float32 (what models use) and
    # integers become int64 (what embeddings and cross-entropy require).
    array = np.array(value)
    if array.dtype == np.float64:
        array = array.astype(np.float32)
    elif np.issubdtype(array.dtype, np.integer):
        array = array.astype(np.int64)
    return torch.from_numpy(array)


class ArrayPairs(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Row ``i`` of inputs and targets as tensors; works on in-memory arrays and memmaps alike."""

    def __init__(self, inputs: np.ndarray, targets: np.ndarray) -> None:
        self.inputs = inputs  # (n, ...)
        self.targets = targets  # (n, ...)

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return _as_tensor(self.inputs[index]), _as_tensor(self.targets[index])


class ArrayDataModule(LoaderDataModule):
    """Supervised ``(input, target)`` rows from a user's ``.npz`` or pair of ``.npy`` files.

    ``mmap=True`` memory-maps ``.npy`` files so arrays larger than RAM work and worker
    processes share pages; an ``.npz`` is a zip, so it is always read into memory.
    """

    def __init__(
        self,
        path: str,
        inputs_key: str = "x",
        targets_key: str = "y",
        targets_path: str | None = None,
        val_fraction: float = 0.1,
        batch_size: int = 64,
        seed: int = 1234,
        num_workers: int = 0,
        mmap: bool = True,
        pin_memory: bool = False,
    ) -> None:
        super().__init__(batch_size=batch_size, seed=seed, num_workers=num_workers, pin_memory=pin_memory)
        file = Path(path).expanduser()
        if not file.is_file():
            what = "is not a file" if file.exists() else "does not exist"
            raise FileNotFoundError(f"array file '{file}' {what}; pass data.path=<an existing .npz file, or .npy with data.targets_path>")
        if file.suffix not in (".npz", ".npy"):
            raise ValueError(f"array file '{file}' has extension '{file.suffix}', not .npz or .npy; pass data.path=<a .npz file, or .npy with data.targets_path>")
        targets_file = Path(targets_path).expanduser() if targets_path is not None else None
        if file.suffix == ".npz":
            if targets_file is not None:
                raise ValueError(f"targets_path='{targets_file}' is only read with a .npy inputs file; drop data.targets_path and use data.targets_key with '{file}'")
            inputs_shape, targets_shape = _npz_shapes(file, (("inputs_key", inputs_key), ("targets_key", targets_key)))
            names = (f"'{file}'[{inputs_key!r}]", f"'{file}'[{targets_key!r}]")
        else:
            if targets_file is None:
                raise ValueError(f"inputs file '{file}' is a .npy without targets; pass data.targets_path=<a .npy of targets, one row per input>")
            if not targets_file.is_file() or targets_file.suffix != ".npy":
                raise FileNotFoundError(f"targets file '{targets_file}' is not an existing .npy file; pass data.targets_path=<a .npy of targets, one row per input>")
            inputs_shape = _npy_shape(file, "inputs file", "pass data.path=<a file written by numpy.save>")
            targets_shape = _npy_shape(targets_file, "targets file", "pass data.targets_path=<a file written by numpy.save>")
            names = (f"'{file}'", f"'{targets_file}'")
        for name, shape in zip(names, (inputs_shape, targets_shape)):
            if not shape:
                raise ValueError(f"array {name} is a scalar; pass an array with one row per example")
        if inputs_shape[0] != targets_shape[0]:
            raise ValueError(f"inputs {names[0]} have {inputs_shape[0]} rows but targets {names[1]} have {targets_shape[0]}; pass arrays with equal first dimensions")
        if not 0.0 <= val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction!r} is outside [0, 1); pass data.val_fraction=<a fraction such as 0.1>")
        rows = inputs_shape[0]
        n_val = int(rows * val_fraction)  # floor: closed-form split sizes
        if (val_fraction > 0 and n_val == 0) or rows - n_val == 0:
            raise ValueError(f"{rows} rows cannot be split with val_fraction={val_fraction}; pass data.val_fraction=0 or more rows")
        for name, value, low in (("batch_size", batch_size, 1),):  # num_workers: LoaderDataModule's
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r} is not an integer >= {low}; pass data.{name}=<{low} or more>")
        self.path = file
        self.targets_path = targets_file
        self.inputs_key = inputs_key
        self.targets_key = targets_key
        self.val_fraction = val_fraction
        self.mmap = mmap
        self.num_rows = rows
        self.num_val = n_val
        self.input_shape = tuple(inputs_shape[1:])  # per example
        self.target_shape = tuple(targets_shape[1:])

    def _load(self) -> tuple[np.ndarray, np.ndarray]:
        if self.path.suffix == ".npz":
            with np.load(self.path) as z:
                return z[self.inputs_key], z[self.targets_key]
        mode = "r" if self.mmap else None
        return np.load(self.path, mmap_mode=mode), np.load(self.targets_path, mmap_mode=mode)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        dataset = ArrayPairs(*self._load())
        order = np.random.default_rng(self.seed).permutation(self.num_rows)
        # Sorted within each split: memmap reads stay roughly sequential; the loader shuffles.
        self.val_set = Subset(dataset, np.sort(order[: self.num_val]).tolist())
        self.train_set = Subset(dataset, np.sort(order[self.num_val :]).tolist())
