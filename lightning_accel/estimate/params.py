"""The model's tensors as training keeps them: per block and outside, trainable or frozen, stored bytes (NF4 too), optimizer state.

Two things are measured rather than assumed. The optimizer state is what the recipe's own
optimizer creates: ``configure_optimizers`` builds it over the fake parameters and one step
runs on fake gradients (AdamW: two moments per trainable parameter and a step count; SGD
without momentum: nothing). A QLoRA base's NF4 bytes are torchao's own layout, read from two
tiny weights quantized for real (:func:`nf4_nbytes`), since on the meta device the base is
left unquantized. Nothing here imports Lightning.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_accel.models.block_policy import Block
from lightning_accel.stored import stored_nbytes


@dataclass(frozen=True)
class Tensors:
    """What one unit holds (a block, or the parameters before or after the blocks)."""

    trainable: int = 0  # elements that get gradients
    matrices: int = 0  # of those, elements in tensors of 2+ dims (offload's low-precision shadows)
    frozen_bytes: int = 0  # frozen parameters as stored (NF4: codes and scalers)
    buffer_bytes: int = 0
    optimizer_bytes: int = 0  # the optimizer state of the trainable ones, as measured

    def __add__(self, other: Tensors) -> Tensors:
        return Tensors(*(a + b for a, b in zip(self._values(), other._values())))

    def _values(self) -> tuple[int, ...]:
        return (self.trainable, self.matrices, self.frozen_bytes, self.buffer_bytes, self.optimizer_bytes)

    def weight_bytes(self, trainable_size: int, matrix_size: int | None = None) -> int:
        """Bytes of the weights with trainable vectors at ``trainable_size`` bytes an element and trainable
        matrices at ``matrix_size`` (default: the same), frozen ones and buffers as stored."""
        matrix = trainable_size if matrix_size is None else matrix_size
        return self.matrices * matrix + (self.trainable - self.matrices) * trainable_size + self.frozen_bytes + self.buffer_bytes


@dataclass(frozen=True)
class Inventory:
    """``blocks[i]``, and the parameters outside the blocks registered before (embeddings) and after them (norm, head)."""

    blocks: list[Tensors]
    before: Tensors
    after: Tensors

    @property
    def rest(self) -> Tensors:
        return self.before + self.after

    @property
    def total(self) -> Tensors:
        return functools.reduce(Tensors.__add__, self.blocks, self.rest)


@functools.cache
def _nf4_fit(block_size: int, scaler_block_size: int, dtype: torch.dtype) -> tuple[float, float]:
    from lightning_accel.models.quantize import load_to_nf4

    to_nf4 = load_to_nf4()
    group = block_size * scaler_block_size
    sizes = [stored_nbytes(to_nf4(torch.zeros(k, group, dtype=dtype), block_size, scaler_block_size)) for k in (1, 2)]
    per_group = sizes[1] - sizes[0]
    return per_group / group, sizes[0] - per_group  # bytes an element, and the constant (lookup table, mean)


def nf4_nbytes(numel: int, block_size: int = 64, scaler_block_size: int = 256, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes torchao's ``to_nf4`` stores for a ``dtype`` weight of ``numel`` elements (its scale
    factors and lookup table keep the weight's dtype)."""
    per_element, constant = _nf4_fit(block_size, scaler_block_size, dtype)
    return round(numel * per_element + constant)


def nf4_weights(net: nn.Module, adapter: Mapping[str, Any] | None) -> dict[str, int]:
    """``qualified weight name -> stored bytes`` of the weights a QLoRA adapter turns into NF4 (left unquantized on meta)."""
    if not adapter or "block_size" not in adapter:
        return {}
    from lightning_accel.models.quantize import block_linears

    block, scaler = int(adapter["block_size"]), int(adapter["scaler_block_size"])
    linears = block_linears(net, adapter.get("quantize_modules"))
    return {
        f"{name}.weight": nf4_nbytes(m.weight.numel(), block, scaler, m.weight.dtype)
        for name, m in linears
        if not m.weight.requires_grad and ".lora_" not in f".{name}"  # peft's adapters are Linears too
    }


@dataclass(frozen=True)
class OptimizerBytes:
    """``state``: bytes the optimizer keeps per parameter name; ``scratch``: the most bytes its
    ``step()`` creates and frees again (torch's foreach kernels: a full-size temporary or two)."""

    state: dict[str, int]
    scratch: int


def measure_optimizer(module: Any, net: nn.Module, mode: FakeTensorMode, foreach: bool = False, scratch: bool = True) -> OptimizerBytes:
    """The state and scratch of ``module``'s optimizer over ``net``'s (fake) parameters: one step
    creates the state, a second step's temporaries are the scratch (``scratch=False``: not
    measured, 0). ``foreach``: step with torch's foreach kernels where the optimizer leaves the
    choice to torch (its default on CUDA; fake CPU tensors would get the per-tensor loop).

    Without the scratch only the state is needed, and a torch optimizer's state for a parameter
    is made from that parameter and its group alone: the steps run over one stand-in per group
    and kind of parameter (:func:`_stand_ins`), each name getting its stand-in's bytes: a 70B
    LoRA's 1120 adapter tensors have five shapes, and the fake step over all of them took a
    quarter of ``estimate``'s time. The scratch needs every parameter (a foreach kernel's
    temporaries span its list).
    """
    from lightning_accel.estimate.live_bytes import LiveBytes
    from lightning_accel.offload.optimizer_state import state_bytes_by_parameter

    params = dict(net.named_parameters())
    optimizers = _optimizers(module.configure_optimizers())
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            if foreach and group.get("foreach", False) is None and not group.get("fused"):
                group["foreach"] = True
    # id(param) -> the parameter whose state it gets, per optimizer (itself, or its stand-in)
    standing = [_stand_ins(optimizer) if not scratch and _per_parameter(optimizer) else None for optimizer in optimizers]
    stepped = {id(p): p for o, s in zip(optimizers, standing) for p in (s.values() if s is not None else params.values())}
    counter = LiveBytes()
    with mode:
        for p in stepped.values():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        for optimizer in optimizers:
            optimizer.step()
        with counter:
            for optimizer in optimizers if scratch else ():
                optimizer.step()
    held = [state_bytes_by_parameter(o) for o in optimizers]
    state = {
        name: sum(b.get(id(p if s is None else s.get(id(p), p)), 0) for b, s in zip(held, standing))
        for name, p in params.items()
    }
    for p in [*params.values(), *stepped.values()]:
        p.grad = None
    return OptimizerBytes(state, counter.peak)


def _per_parameter(optimizer: torch.optim.Optimizer) -> bool:
    """A torch optimizer whose state for a parameter comes from that parameter, its gradient and
    its group only (every one but L-BFGS, which keeps its whole history on the first)."""
    return type(optimizer).__module__.startswith("torch.optim.") and not isinstance(optimizer, torch.optim.LBFGS)


def _stand_ins(optimizer: torch.optim.Optimizer) -> dict[int, nn.Parameter]:
    """Each parameter of ``optimizer`` -> the first of its group with its shape, strides, dtype,
    device and ``requires_grad``; the groups then hold only those (the optimizer is the
    measurement's own, built for it and dropped after)."""
    stand: dict[int, nn.Parameter] = {}
    for group in optimizer.param_groups:
        first: dict[tuple, nn.Parameter] = {}
        for p in group["params"]:
            stand[id(p)] = first.setdefault((tuple(p.shape), p.stride(), p.dtype, p.device, p.requires_grad), p)
        group["params"] = list(first.values())
    return stand


def _optimizers(configured: Any) -> list[torch.optim.Optimizer]:
    if isinstance(configured, torch.optim.Optimizer):
        return [configured]
    if isinstance(configured, Mapping):
        return _optimizers(configured.get("optimizer"))
    if isinstance(configured, (list, tuple)):
        return [o for item in configured for o in _optimizers(item)]
    return []


def inventory(net: nn.Module, blocks: Sequence[Block], stored: Mapping[str, int], state: Mapping[str, int]) -> Inventory:
    """The tensors of ``net`` by unit; ``stored``: stored bytes of frozen weights that differ from
    ``numel x element_size`` (NF4), ``state``: optimizer bytes; both by name in ``net``."""
    where: dict[int, int] = {}
    for k, block in enumerate(blocks):
        for p in block.module.parameters():
            where.setdefault(id(p), k)
        for b in block.module.buffers():
            where.setdefault(id(b), k)
    units: list[Tensors] = [Tensors() for _ in blocks]
    before, after, seen_block = Tensors(), Tensors(), False

    def unit_of(name: str, t: torch.Tensor) -> Tensors:
        if t.requires_grad:
            return Tensors(t.numel(), t.numel() if t.ndim >= 2 else 0, optimizer_bytes=state.get(name, 0))
        return Tensors(frozen_bytes=stored.get(name, t.numel() * t.element_size()))

    for name, p in net.named_parameters():
        k = where.get(id(p))
        if k is not None:
            units[k] += unit_of(name, p)
            seen_block = True
        elif seen_block:
            after += unit_of(name, p)
        else:
            before += unit_of(name, p)
    for b in net.buffers():
        size = Tensors(buffer_bytes=b.numel() * b.element_size())
        k = where.get(id(b))
        if k is not None:
            units[k] += size
        else:
            before += size
    return Inventory(units, before, after)
