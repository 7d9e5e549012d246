"""LiveBytes counts what ops create, once, until it is dropped: closed-form sizes on fake tensors."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_accel.estimate.live_bytes import LiveBytes


def test_new_storages_counted_views_and_inputs_not() -> None:
    mode = FakeTensorMode()
    with mode:
        x = torch.empty(256, 128)  # created before the counter: not counted
        w = torch.empty(512, 128)
    counter = LiveBytes()
    with mode, counter:
        h = x @ w.t()  # w.t() is a view of a tensor made before: nothing new
        assert counter.now == 256 * 512 * 4
        h.relu_()  # in place: nothing new
        y = h.to(torch.bfloat16)
        assert counter.now == 256 * 512 * 4 + 256 * 512 * 2
        del h
        assert counter.now == 256 * 512 * 2
        z = y.view(-1)  # a view of y: nothing new
        del y
        assert counter.now == 256 * 512 * 2  # z keeps the storage alive
        del z
    assert counter.now == 0
    assert counter.peak == 256 * 512 * 6


def test_window_peak_restarts_at_mark() -> None:
    counter = LiveBytes()
    with FakeTensorMode(), counter:
        a = torch.empty(1000)
        del a
        assert counter.mark() == 0
        b = torch.empty(10)
        assert counter.window_peak == 40
        assert counter.peak == 4000
        del b


def test_every_tensor_an_op_returns_is_counted_lists_and_tuples_too() -> None:
    mode = FakeTensorMode()
    with mode:
        x = torch.empty(256, 128)
        ys = [torch.empty(10), torch.empty(20)]
    counter = LiveBytes()
    with mode, counter:
        values, indices = torch.sort(x)  # a tuple of two new tensors
        assert counter.now == 256 * 128 * (4 + 8)
        parts = torch.split(values, 64)  # views of values: nothing new
        assert counter.now == 256 * 128 * (4 + 8)
        sums = torch._foreach_add(ys, 1.0)  # a list of new tensors
        assert counter.now == 256 * 128 * (4 + 8) + 30 * 4
        del values, indices, parts, sums
    assert counter.now == 0
