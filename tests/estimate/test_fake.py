"""A meta network made fake: every tensor a fake CPU one in the dtype asked, ties kept, fakes of that dtype kept as they are."""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from lightning_accel.estimate.fake import fake_parameters


def _tied() -> nn.Module:
    with torch.device("meta"):
        net = nn.Sequential(nn.Embedding(100, 16), nn.LayerNorm(16), nn.Linear(16, 100, bias=False))
        net.register_buffer("table", torch.empty(4, 16))
    net[2].weight = net[0].weight
    net[1].requires_grad_(False)
    return net


def test_parameters_become_fake_in_the_dtype_asked_and_stay_tied() -> None:
    net, mode = _tied(), FakeTensorMode()
    fake_parameters(net, mode, lambda _n, p: torch.bfloat16 if p.requires_grad else p.dtype)
    assert all(isinstance(t, FakeTensor) and t.device.type == "cpu" for t in [*net.parameters(), *net.buffers()])
    assert net[0].weight.dtype == torch.bfloat16 and net[1].weight.dtype == torch.float32 and net[2].weight is net[0].weight
    assert net[0].weight.requires_grad and not net[1].weight.requires_grad


def test_a_second_call_keeps_the_fakes_already_in_its_dtype_and_remakes_the_rest() -> None:
    net, mode = _tied(), FakeTensorMode()
    fake_parameters(net, mode)  # the optimizer's dtypes: all fp32
    first = {n: p for n, p in net.named_parameters()}
    table = net.table
    fake_parameters(net, mode, lambda _n, p: torch.bfloat16 if p.requires_grad and p.ndim >= 2 else p.dtype)
    after = dict(net.named_parameters())
    assert after["1.weight"] is first["1.weight"] and after["1.bias"] is first["1.bias"] and net.table is table
    assert after["0.weight"] is not first["0.weight"] and after["0.weight"].dtype == torch.bfloat16 and net[2].weight is net[0].weight
    other = FakeTensorMode()  # another mode's fakes are made again, in that mode
    fake_parameters(net, other)
    assert all(p.fake_mode is other for p in net.parameters()) and net.table.fake_mode is other
