"""User arrays: rows served intact, a seeded disjoint split, and one-line errors for bad files."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_accel.data.arrays import ArrayDataModule


def _arrays(rows: int = 100) -> tuple[np.ndarray, np.ndarray]:
    # Column 0 holds the row number, so every served row can be traced back.
    x = np.random.default_rng(0).normal(size=(rows, 4))
    x[:, 0] = np.arange(rows)
    y = np.arange(rows) % 3
    return x, y


@pytest.fixture
def npz(tmp_path: Path) -> Path:
    x, y = _arrays()
    path = tmp_path / "data.npz"
    np.savez(path, x=x, y=y, extra=np.zeros(3))
    return path


def _rows(loader: torch.utils.data.DataLoader) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*loader)
    return torch.cat(xs), torch.cat(ys)


def test_npz_rows_are_served_intact_and_split_disjointly(npz: Path) -> None:
    x, y = _arrays()
    dm = ArrayDataModule(str(npz), val_fraction=0.1, batch_size=16)
    assert (dm.num_rows, dm.num_val, dm.input_shape, dm.target_shape) == (100, 10, (4,), ())
    train_x, train_y = _rows(dm.train_dataloader())
    val_x, val_y = _rows(dm.val_dataloader())
    assert train_x.dtype == torch.float32 and train_y.dtype == torch.long  # float64 -> float32
    train_ids, val_ids = train_x[:, 0].long().tolist(), val_x[:, 0].long().tolist()
    assert len(train_ids) == 90 and len(val_ids) == 10
    assert sorted(train_ids + val_ids) == list(range(100))  # disjoint and complete
    for got_x, got_y, ids in ((train_x, train_y, train_ids), (val_x, val_y, val_ids)):
        assert torch.equal(got_x, torch.from_numpy(x[ids]).float())
        assert torch.equal(got_y, torch.from_numpy(y[ids]))


def test_split_depends_on_the_seed(npz: Path) -> None:
    def val_ids(seed: int) -> list[int]:
        dm = ArrayDataModule(str(npz), seed=seed)
        dm.setup()
        return list(dm.val_set.indices)

    assert val_ids(1) == val_ids(1)
    assert val_ids(1) != val_ids(2)
    assert val_ids(1) == sorted(np.random.default_rng(1).permutation(100)[:10].tolist())


@pytest.mark.parametrize("mmap", [True, False])
def test_npy_pair_with_and_without_mmap(tmp_path: Path, mmap: bool) -> None:
    x, y = _arrays(20)
    np.save(tmp_path / "x.npy", x.astype(np.float32))
    np.save(tmp_path / "y.npy", y.astype(np.int32))
    dm = ArrayDataModule(str(tmp_path / "x.npy"), targets_path=str(tmp_path / "y.npy"), val_fraction=0.25, mmap=mmap)
    dm.setup()
    assert isinstance(dm.train_set.dataset.inputs, np.memmap) is mmap
    item_x, item_y = dm.val_set[0]
    row = dm.val_set.indices[0]
    assert torch.equal(item_x, torch.from_numpy(x[row].astype(np.float32)))
    assert item_y.dtype == torch.long and int(item_y) == y[row]  # int32 -> int64
    assert len(dm.train_set) == 15


def test_no_validation_split(npz: Path) -> None:
    dm = ArrayDataModule(str(npz), val_fraction=0.0)
    assert dm.val_dataloader() == []
    assert len(dm.train_set) == 100


def test_file_errors(tmp_path: Path, npz: Path) -> None:
    missing = tmp_path / "missing.npz"
    with pytest.raises(FileNotFoundError, match=rf"array file '{re.escape(str(missing))}' does not exist; pass data.path="):
        ArrayDataModule(str(missing))
    csv = tmp_path / "data.csv"
    csv.write_text("1,2\n")
    with pytest.raises(ValueError, match=r"has extension '.csv', not .npz or .npy; pass data.path="):
        ArrayDataModule(str(csv))
    with pytest.raises(ValueError, match=r"has no key 'inputs' \(keys: extra, x, y\); pass data.inputs_key=<one of its keys>"):
        ArrayDataModule(str(npz), inputs_key="inputs")
    with pytest.raises(ValueError, match=r"has no key 'label' \(keys: extra, x, y\); pass data.targets_key="):
        ArrayDataModule(str(npz), targets_key="label")
    with pytest.raises(ValueError, match=r"targets_path=.* is only read with a .npy inputs file; drop data.targets_path"):
        ArrayDataModule(str(npz), targets_path=str(npz))
    bad_zip = tmp_path / "bad.npz"
    bad_zip.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match=r"is not a readable .npz .*; pass data.path=<a file written by numpy.savez>"):
        ArrayDataModule(str(bad_zip))


def test_npy_errors(tmp_path: Path) -> None:
    np.save(tmp_path / "x.npy", np.zeros((10, 2)))
    np.save(tmp_path / "y9.npy", np.zeros(9))
    np.save(tmp_path / "scalar.npy", np.float64(3.0))
    (tmp_path / "junk.npy").write_bytes(b"junk")
    x = str(tmp_path / "x.npy")
    with pytest.raises(ValueError, match=r"is a .npy without targets; pass data.targets_path="):
        ArrayDataModule(x)
    with pytest.raises(FileNotFoundError, match=r"targets file '.*nope.npy' is not an existing .npy file; pass data.targets_path="):
        ArrayDataModule(x, targets_path=str(tmp_path / "nope.npy"))
    with pytest.raises(ValueError, match=r"have 10 rows but targets .*y9.npy' have 9; pass arrays with equal first dimensions"):
        ArrayDataModule(x, targets_path=str(tmp_path / "y9.npy"))
    with pytest.raises(ValueError, match=r"scalar.npy' is a scalar; pass an array with one row per example"):
        ArrayDataModule(x, targets_path=str(tmp_path / "scalar.npy"))
    with pytest.raises(ValueError, match=r"targets file '.*junk.npy' is not a NumPy .npy file .*; pass data.targets_path="):
        ArrayDataModule(x, targets_path=str(tmp_path / "junk.npy"))


def test_split_and_loader_argument_errors(npz: Path) -> None:
    with pytest.raises(ValueError, match=r"val_fraction=1.0 is outside \[0, 1\); pass data.val_fraction="):
        ArrayDataModule(str(npz), val_fraction=1.0)
    with pytest.raises(ValueError, match=r"100 rows cannot be split with val_fraction=0.001; pass data.val_fraction=0 or more rows"):
        ArrayDataModule(str(npz), val_fraction=0.001)
    with pytest.raises(ValueError, match=r"batch_size=0 is not an integer >= 1; pass data.batch_size="):
        ArrayDataModule(str(npz), batch_size=0)
