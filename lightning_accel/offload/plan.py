"""The offload plan: which parameters stream to the device together, as which unit.

Decided once, before training, from the block policy (see
:mod:`lightning_accel.models.block_policy`); the executor receives plain data. Each block
is a unit; the parameters outside every block (embeddings, head, final norm) form the
*resident* unit, which either stays on the device for the whole run or streams in at the
start of each step and out at its end (``offload_resident=True``). (The multi-process
pipeline calls the same parameters *shared*, for being on every rank.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor, nn

from lightning_accel.models.block_policy import BlockPolicy, find_blocks


@dataclass
class Unit:
    """Parameters and buffers that move to the device and back together."""

    name: str
    module: nn.Module | None
    params: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    # (owning module, buffer name, qualified name): buffers are swapped in the owner's _buffers
    buffers: list[tuple[nn.Module, str, str]] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return sum(p.numel() for _, p in self.params)

    def nbytes(self, element_size: int) -> int:
        return self.numel * element_size


@dataclass
class OffloadPlan:
    """Blocks in execution order, the resident unit, and the streaming policy."""

    blocks: list[Unit]
    resident: Unit
    prefetch_blocks: int
    offload_resident: bool

    def describe(self) -> str:
        sizes = [u.numel for u in self.blocks]
        return (
            f"{len(self.blocks)} blocks of {min(sizes):,}-{max(sizes):,} parameters, resident unit of "
            f"{self.resident.numel:,} parameters ({'streamed' if self.offload_resident else 'kept on the device'}), "
            f"prefetch depth {self.prefetch_blocks}"
        )


def _buffers(module: nn.Module, prefix: str) -> list[tuple[nn.Module, str, str]]:
    out = []
    for mod_name, mod in module.named_modules():
        for buf_name, buf in mod._buffers.items():
            if isinstance(buf, Tensor):
                out.append((mod, buf_name, ".".join(x for x in (prefix, mod_name, buf_name) if x)))
    return out


def make_plan(model: nn.Module, policy: BlockPolicy = "auto", prefetch_blocks: int = 1, offload_resident: bool = False) -> OffloadPlan:
    """Split ``model``'s parameters into block units and the resident unit.

    A parameter shared between blocks (tied weights) cannot stream with one block and stay
    with another, so it is refused with the fix.
    """
    if prefetch_blocks < 0:
        raise ValueError(f"prefetch_blocks must be >= 0, got {prefetch_blocks}; 1 overlaps the next block's copy with this block's compute")
    blocks = find_blocks(model, policy, stacks="all")  # an encoder-decoder streams both stacks
    owner: dict[int, str] = {}
    units = []
    for block in blocks:
        unit = Unit(block.name, block.module, buffers=_buffers(block.module, block.name))
        for name, param in block.module.named_parameters():
            if id(param) in owner:
                raise ValueError(
                    f"parameter {block.name}.{name} is shared with block {owner[id(param)]}; untie it, or choose blocks "
                    "that do not share parameters"
                )
            owner[id(param)] = block.name
            unit.params.append((f"{block.name}.{name}", param))
        units.append(unit)
    resident = Unit("resident", None)
    in_blocks = {id(b.module) for b in blocks}
    for name, param in model.named_parameters():
        if id(param) not in owner:
            resident.params.append((name, param))
    for mod_name, mod in model.named_modules():
        if any(mod_name == b.name or mod_name.startswith(f"{b.name}.") for b in blocks) or id(mod) in in_blocks:
            continue
        for buf_name, buf in mod._buffers.items():
            if isinstance(buf, Tensor):
                resident.buffers.append((mod, buf_name, f"{mod_name}.{buf_name}" if mod_name else buf_name))
    return OffloadPlan(units, resident, prefetch_blocks, offload_resident)
