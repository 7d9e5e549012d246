"""DevicePrefetcher: a no-op that says so once on CPU; a one-batch-ahead copy on CUDA.

Without a GPU here, the CUDA path's wiring is checked with a stand-in: a model that reports a CUDA device and
:class:`OnCpu`, a :class:`CudaPrefetchIterable` (its forwarding of the loader's attributes and length included)
whose copy hands the batches through and counts them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch
from torch.utils.data import DataLoader

from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_accel.callbacks import DevicePrefetcher, PrefetchTuner
from lightning_accel.callbacks import device_prefetcher
from lightning_accel.prefetch import CudaPrefetchIterable, TunableLoader


def test_cpu_path_is_a_no_op_and_says_so_once(caplog, sleepy, recorder, make_trainer):
    loader = DataLoader(sleepy(10), batch_size=3)
    plain, prefetched = recorder(), recorder()
    make_trainer([]).fit(plain, loader)
    callback = DevicePrefetcher()
    with caplog.at_level(logging.INFO):
        t = make_trainer([callback], max_epochs=2)
        t.fit(prefetched, loader)
    messages = [r.getMessage() for r in caplog.records if "DevicePrefetcher" in r.getMessage()]
    assert messages == ["DevicePrefetcher: no CUDA device (training on cpu); batches are not copied ahead"]
    assert not callback.active
    assert t.fit_loop._combined_loader.flattened[0] is loader  # the loader was left alone
    assert len(prefetched.batches) == 2 * len(plain.batches)
    for a, b in zip(plain.batches, prefetched.batches):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert a[1].device.type == b[1].device.type == "cpu"


def test_copy_iterable_refuses_a_cpu_device():
    with pytest.raises(ValueError, match=r"device=cpu is not a CUDA device"):
        CudaPrefetchIterable([], torch.device("cpu"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_copy_is_one_batch_ahead_and_exact():
    batches = [(torch.full((256, 256), float(i)), torch.tensor([i])) for i in range(5)]
    device = torch.device("cuda", 0)
    out = []
    for x, y in CudaPrefetchIterable(batches, device):
        assert x.device == device and y.device == device
        out.append((x * 2).sum().item())  # compute on the current stream after the side-stream copy
    assert out == [2.0 * 256 * 256 * i for i in range(5)]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_trainer_receives_device_batches(sleepy, recorder, make_trainer):
    loader = DataLoader(sleepy(9), batch_size=3)
    model, callback = recorder(), DevicePrefetcher()
    make_trainer([callback], accelerator="gpu").fit(model, loader)
    assert callback.active
    assert sorted(model.indices) == list(range(9))
    assert all(b[1].is_cuda for b in model.batches)


class OnCpu(CudaPrefetchIterable):
    """The CUDA copy's stand-in: built as the real one is, hands each batch through and counts it."""

    def __init__(self, source, device: torch.device) -> None:
        self.source, self.device, self.read = source, device, 0

    def __iter__(self) -> Iterator:
        for batch in self.source:
            self.read += 1
            yield batch


@pytest.fixture
def on_cuda(recorder, monkeypatch):
    """A recorder model that says it is on CUDA, with the copy replaced by :class:`OnCpu`."""
    monkeypatch.setattr(device_prefetcher, "CudaPrefetchIterable", OnCpu)

    class OnCuda(recorder):
        @property
        def device(self) -> torch.device:
            return torch.device("cuda", 0)

    return OnCuda


def test_the_copy_wraps_the_train_loader_and_every_batch_comes_once_in_order(caplog, sleepy, on_cuda, make_trainer):
    loader, callback, model = DataLoader(sleepy(10), batch_size=3), DevicePrefetcher(), on_cuda()
    with caplog.at_level(logging.INFO):
        trainer = make_trainer([callback], max_epochs=2)
        trainer.fit(model, loader)
    served = trainer.fit_loop._combined_loader.flattened[0]
    assert isinstance(served, OnCpu) and served.source is loader and served.read == 8  # 4 batches, 2 epochs
    assert model.indices == list(range(10)) * 2
    assert callback.active and [r.getMessage() for r in caplog.records if "DevicePrefetcher" in r.getMessage()] == [
        "DevicePrefetcher: copying batch i+1 to cuda:0 on a side stream while batch i computes"
    ]
    assert "process_dataloader" not in vars(trainer.strategy)


def test_a_streams_read_ahead_batch_comes_through_the_copy(on_cuda, make_trainer, endless):
    model = on_cuda()
    trainer = make_trainer([DevicePrefetcher()], max_steps=5)
    trainer.fit(model, DataLoader(endless(), batch_size=1))
    served = trainer.fit_loop._combined_loader.flattened[0]
    assert isinstance(served, OnCpu) and served.read == 6 and model.indices == list(range(5))  # five trained, one ahead


def test_after_the_tuner_the_copy_wraps_the_tuned_loader_and_both_hooks_come_off(sleepy, on_cuda, make_trainer):
    tuner, callback, model = PrefetchTuner(max_workers=2), DevicePrefetcher(), on_cuda()
    trainer = make_trainer([tuner, callback], max_epochs=1)
    trainer.fit(model, DataLoader(sleepy(8), batch_size=2))
    served = trainer.fit_loop._combined_loader.flattened[0]
    assert isinstance(served, OnCpu) and isinstance(served.source, TunableLoader) and served.source is tuner.loader
    assert model.indices == list(range(8)) and served.read == 4
    assert "process_dataloader" not in vars(trainer.strategy)  # the tuner's removed first, under the copy's


def test_a_plain_loader_resumed_mid_epoch_is_kept_and_the_prefetcher_says_why(sleepy, on_cuda, make_trainer, tmp_path):
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    make_trainer([every], max_epochs=1, enable_checkpointing=True).fit(on_cuda(), DataLoader(sleepy(40), batch_size=4))
    plain = on_cuda()  # what Lightning does alone: a loader that cannot skip starts the epoch again
    make_trainer([], max_epochs=1, default_root_dir=tmp_path).fit(
        plain, DataLoader(sleepy(40), batch_size=4), ckpt_path=str(tmp_path / "step=3.ckpt")
    )
    callback, model, loader = DevicePrefetcher(), on_cuda(), DataLoader(sleepy(40), batch_size=4)
    trainer = make_trainer([callback], max_epochs=1, enable_checkpointing=True, default_root_dir=tmp_path)
    said = "DevicePrefetcher: fit resumed part-way through an epoch; batches are copied by Lightning as usual"
    with pytest.warns(UserWarning, match=said):
        trainer.fit(model, loader, ckpt_path=str(tmp_path / "step=3.ckpt"))
    assert trainer.fit_loop._combined_loader.flattened[0] is loader and not callback.active
    assert model.indices == plain.indices and len(plain.indices) == 28  # the epoch's 7 remaining steps
    assert "process_dataloader" not in vars(trainer.strategy)


def test_a_stateful_loader_resumed_mid_epoch_resumes_inside_the_copy(sleepy, on_cuda, make_trainer, tmp_path):
    stateful = pytest.importorskip("torchdata.stateful_dataloader", reason="needs torchdata").StatefulDataLoader
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    make_trainer([every], max_epochs=1, enable_checkpointing=True).fit(on_cuda(), stateful(sleepy(40), batch_size=4))
    callback, model = DevicePrefetcher(), on_cuda()
    trainer = make_trainer([callback], max_epochs=1, enable_checkpointing=True, default_root_dir=tmp_path)
    trainer.fit(model, stateful(sleepy(40), batch_size=4), ckpt_path=str(tmp_path / "step=3.ckpt"))
    assert callback.active and isinstance(trainer.fit_loop._combined_loader.flattened[0], OnCpu)
    assert model.indices == list(range(12, 40))  # the checkpoint's position reached the loader through the copy


def test_a_fit_that_raises_leaves_the_strategy_as_it_was(sleepy, on_cuda, make_trainer):
    class Fails(on_cuda):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("boom")

    trainer = make_trainer([DevicePrefetcher()])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(Fails(), DataLoader(sleepy(4), batch_size=2))
    assert "process_dataloader" not in vars(trainer.strategy)


def test_of_several_train_loaders_the_first_is_copied_ahead_and_it_says_so(sleepy, on_cuda, make_trainer):
    class TwoLoaders(on_cuda):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch["a"], batch_idx)

    callback, model = DevicePrefetcher(), TwoLoaders()
    trainer = make_trainer([callback])
    a, b = DataLoader(sleepy(6), batch_size=2), DataLoader(sleepy(6), batch_size=2)
    with pytest.warns(UserWarning, match="DevicePrefetcher: 2 train loaders; the first one's batches are copied ahead, "):
        trainer.fit(model, {"a": a, "b": b})
    first, second = trainer.fit_loop._combined_loader.flattened
    assert isinstance(first, OnCpu) and first.source is a and second is b and model.indices == list(range(6))
    assert callback.active and first.read == 3
