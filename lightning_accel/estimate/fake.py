"""A model built on the meta device, turned into fake CPU tensors in the dtypes a strategy keeps.

Meta tensors have shapes and no memory, but no device either: autocast and the CPU's kernel
choices need a device. Fake tensors (``FakeTensorMode``) have both and still no memory, so
a recipe's network built on meta (the pre-run check's way) becomes a network that runs a
training step, its parameters in the dtypes the strategy would give them, with nothing
allocated. Tied parameters stay tied. Nothing here imports Lightning.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

# (qualified name, parameter) -> the dtype the strategy computes it in
DtypeOf = Callable[[str, nn.Parameter], torch.dtype]


def as_stored(_name: str, param: nn.Parameter) -> torch.dtype:
    """Each parameter in its own dtype (plain fp32 training, the fp32 masters of offload)."""
    return param.dtype


def fake_parameters(module: nn.Module, mode: FakeTensorMode, dtype_of: DtypeOf = as_stored) -> None:
    """Replace every parameter and buffer of ``module`` by a fake CPU tensor, in place; parameters
    in ``dtype_of(name, param)`` (floating ones only), buffers in their own dtype.

    One that already is a fake CPU tensor of ``mode`` in that dtype stays as it is (a fake tensor
    holds no values, so a new one would be the same): the second call, to the device dtypes after
    the optimizer's, keeps a frozen base instead of making its hundreds of weights again."""
    made: dict[int, torch.Tensor] = {}
    names = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}

    def kept(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
        return isinstance(tensor, FakeTensor) and tensor.fake_mode is mode and tensor.device.type == "cpu" and tensor.dtype == dtype

    with mode:
        for owner in module.modules():
            for key, param in list(owner._parameters.items()):
                if param is None:
                    continue
                if id(param) not in made:
                    dtype = dtype_of(names[id(param)], param) if param.is_floating_point() else param.dtype
                    if kept(param, dtype):
                        made[id(param)] = param
                    else:
                        made[id(param)] = nn.Parameter(torch.empty(param.shape, dtype=dtype, device="cpu"), requires_grad=param.requires_grad)
                owner._parameters[key] = made[id(param)]
            for key, buffer in list(owner._buffers.items()):
                if buffer is None:
                    continue
                if id(buffer) not in made:
                    made[id(buffer)] = buffer if kept(buffer, buffer.dtype) else torch.empty(buffer.shape, dtype=buffer.dtype, device="cpu")
                owner._buffers[key] = made[id(buffer)]


def fake_attributes(module: nn.Module, mode: FakeTensorMode) -> None:
    """Replace the meta tensors ``module``'s submodules hold as plain attributes or in a dict
    attribute (torchmetrics' metric states and their ``_defaults``, neither parameters nor
    buffers) by fake CPU tensors, in place."""

    def meta(value: object) -> bool:
        return isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and value.is_meta

    with mode:
        for owner in module.modules():
            for key, value in list(vars(owner).items()):
                if meta(value):
                    setattr(owner, key, torch.empty(value.shape, dtype=value.dtype, device="cpu"))
                elif isinstance(value, dict) and not key.startswith("_modules"):
                    for k, v in list(value.items()):
                        if meta(v):
                            value[k] = torch.empty(v.shape, dtype=v.dtype, device="cpu")
