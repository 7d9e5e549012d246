"""DevicePrefetcher: a no-op that says so once on CPU; a one-batch-ahead copy on CUDA."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_accel.callbacks import DevicePrefetcher
from lightning_accel.prefetch import CudaPrefetchIterable


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
