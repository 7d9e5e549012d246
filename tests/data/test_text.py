"""Byte-level text data: windows checked against the raw file bytes, splits, seeding, errors."""

from __future__ import annotations

import re
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_accel.data.corpus import stdlib_corpus
from lightning_accel.data.text import ByteTokenizer, TextDataModule


@pytest.fixture(autouse=True)
def _cache_in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_ACCEL_CACHE", str(tmp_path / "cache"))


@pytest.fixture
def text_file(tmp_path: Path) -> tuple[Path, bytes]:
    """1000 bytes of varied, non-periodic text (windows must be told apart by content)."""
    raw = "".join(f"line {i}: {i * i % 997} é\n" for i in range(200)).encode()[:1000]
    assert len(raw) == 1000
    path = tmp_path / "tiny.txt"
    path.write_bytes(raw)
    return path, raw


def test_tokenizer_round_trips_utf8() -> None:
    tok = ByteTokenizer()
    text = "def f(x):\n    return 'é' * x  # ✓"
    ids = tok.encode(text)
    assert ids.dtype == torch.long
    assert ids.tolist() == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode([0xE2, 0x9C]) == "\ufffd"  # a cut multi-byte character decodes, not raises
    assert tok.vocab_size == 256


def test_split_sizes_are_closed_form(text_file: tuple[Path, bytes]) -> None:
    path, _ = text_file
    dm = TextDataModule(source="file", path=str(path), block_size=16, val_fraction=0.1, test_fraction=0.2)
    # 1000 bytes -> val floor(100), test floor(200), train 700; windows (n - 1) // 16.
    assert dm.split_bounds(1000) == (700, 800)
    assert dm.num_train_windows == 699 // 16 == 43  # known before setup
    dm.setup()
    assert (len(dm.train_set), len(dm.val_set), len(dm.test_set)) == (43, 99 // 16, 199 // 16)
    assert dm.num_train_windows == 43
    assert dm.vocab_size == 256


def test_windows_are_contiguous_regions_of_the_file(text_file: tuple[Path, bytes]) -> None:
    path, raw = text_file
    block = 16
    dm = TextDataModule(source="file", path=str(path), block_size=block, val_fraction=0.1, test_fraction=0.2)
    dm.setup()
    reference = torch.tensor(list(raw))
    for dataset, start, end in ((dm.train_set, 0, 700), (dm.val_set, 700, 800), (dm.test_set, 800, 1000)):
        for i in range(len(dataset)):
            x, y = dataset[i]
            lo = start + i * block
            assert x.dtype == y.dtype == torch.long
            assert torch.equal(x, reference[lo : lo + block])
            assert torch.equal(y, reference[lo + 1 : lo + block + 1])  # x shifted by one
            assert lo + block + 1 <= end  # the last target byte is still inside the region
    # Every train window's bytes precede every val byte: nothing validated was trained on.
    last = len(dm.train_set) - 1
    assert last * block + block + 1 <= 700


def test_same_seed_same_first_batch_other_seed_other_order(text_file: tuple[Path, bytes]) -> None:
    path, _ = text_file

    def first_batch(seed: int) -> torch.Tensor:
        dm = TextDataModule(source="file", path=str(path), block_size=16, batch_size=8, seed=seed)
        return next(iter(dm.train_dataloader()))[0]

    assert torch.equal(first_batch(1), first_batch(1))
    assert not torch.equal(first_batch(1), first_batch(2))
    # Shuffled, yet an epoch still covers each window exactly once.
    dm = TextDataModule(source="file", path=str(path), block_size=16, batch_size=8, seed=1)
    seen = torch.cat([x for x, _ in dm.train_dataloader()])
    expected = torch.stack([dm.train_set[i][0] for i in range(dm.num_train_windows)])
    assert sorted(map(tuple, seen.tolist())) == sorted(map(tuple, expected.tolist()))


def test_val_is_ordered_and_worker_loaders_match(text_file: tuple[Path, bytes]) -> None:
    path, _ = text_file
    serial = TextDataModule(source="file", path=str(path), block_size=8, batch_size=4)
    parallel = TextDataModule(source="file", path=str(path), block_size=8, batch_size=4, num_workers=2)
    loader = parallel.val_dataloader()
    assert loader.persistent_workers and loader.num_workers == 2
    a = torch.cat([x for x, _ in serial.val_dataloader()])
    b = torch.cat([x for x, _ in loader])
    assert torch.equal(a, b)
    assert torch.equal(a[0], serial.val_set[0][0])


def test_empty_val_and_test_splits(text_file: tuple[Path, bytes]) -> None:
    path, _ = text_file
    dm = TextDataModule(source="file", path=str(path), block_size=16, val_fraction=0.0)
    assert dm.val_dataloader() == []  # Lightning skips validation
    with pytest.raises(ValueError, match=r"the test split is empty; pass data.test_fraction="):
        dm.test_dataloader()


def test_stdlib_source_reads_the_corpus(tmp_path: Path) -> None:
    dm = TextDataModule(block_size=32, max_bytes=20_000, cache_dir=str(tmp_path / "c"))
    dm.prepare_data()
    dm.setup()
    corpus = stdlib_corpus(tmp_path / "c", max_bytes=20_000).read_bytes()
    x, y = dm.train_set[0]
    assert bytes(x.tolist()) == corpus[:32]
    assert dm.num_train_windows == (len(corpus) - int(len(corpus) * 0.1) - 1) // 32


def test_fit_on_a_tiny_user_file(text_file: tuple[Path, bytes]) -> None:
    path, _ = text_file

    class Bigram(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.logits = torch.nn.Embedding(256, 256)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.cross_entropy(self.logits(x).flatten(0, 1), y.flatten())

        def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> None:
            x, y = batch
            self.log("val_loss", torch.nn.functional.cross_entropy(self.logits(x).flatten(0, 1), y.flatten()))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.Adam(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    dm = TextDataModule(source="file", path=str(path), block_size=16, batch_size=8)
    trainer = L.Trainer(max_epochs=3, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Bigram(), dm)
    # Uniform guessing scores ln(256) = 5.55; a bigram model of this text does far better.
    assert trainer.callback_metrics["val_loss"] < 3.5


def test_missing_file_fails_in_init(tmp_path: Path) -> None:
    missing = tmp_path / "nope.txt"
    with pytest.raises(FileNotFoundError, match=rf"text file '{re.escape(str(missing))}' does not exist; pass data.path=.* or data.source=stdlib"):
        TextDataModule(source="file", path=str(missing))
    with pytest.raises(FileNotFoundError, match=r"is not a file; pass data.path="):
        TextDataModule(source="file", path=str(tmp_path))
    with pytest.raises(ValueError, match=r"data.source=file needs a path; pass data.path="):
        TextDataModule(source="file")


def test_bad_arguments_fail_in_init(text_file: tuple[Path, bytes]) -> None:
    path, _ = text_file
    with pytest.raises(ValueError, match=r"data.source='web' is not one of stdlib, file; pass data.source=stdlib"):
        TextDataModule(source="web")
    with pytest.raises(ValueError, match=r"data.path='.*tiny.txt' is only read with data.source=file; pass data.source=file or drop data.path"):
        TextDataModule(path=str(path))
    with pytest.raises(ValueError, match=r"has 1000 bytes, leaving 100 for the val split, fewer than block_size \+ 1 = 129; pass a smaller data.block_size"):
        TextDataModule(source="file", path=str(path), block_size=128)
    with pytest.raises(ValueError, match=r"val_fraction \+ test_fraction = 1 leaves no training text"):
        TextDataModule(source="file", path=str(path), val_fraction=0.5, test_fraction=0.5)
    with pytest.raises(ValueError, match=r"val_fraction=1.5 is outside \[0, 1\); pass data.val_fraction="):
        TextDataModule(val_fraction=1.5)
    with pytest.raises(ValueError, match=r"block_size=0 is not a positive integer; pass data.block_size="):
        TextDataModule(block_size=0)
    with pytest.raises(ValueError, match=r"num_workers=-1 is not an integer >= 0; pass data.num_workers="):
        TextDataModule(num_workers=-1)
