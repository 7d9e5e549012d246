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
        if not sizes:
            return "no blocks (the model has no parameters: nothing streams)"
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
    # an encoder-decoder streams both stacks; a model without a container of blocks, each child with parameters; a
    # model without parameters (an evaluation-only LightningModule) nothing, which is not worth refusing
    nothing = isinstance(policy, str) and policy == "auto" and not any(True for _ in model.parameters())
    blocks = [] if nothing else find_blocks(model, policy, stacks="all", children=True)
    owner: dict[int, str] = {}
    units = []
    for block in blocks:
        unit = block_unit(block.name, block.module)
        for name, param in unit.params:
            if id(param) in owner:
                raise ValueError(
                    f"parameter {name} is shared with block {owner[id(param)]}; untie it, or choose blocks "
                    "that do not share parameters"
                )
            owner[id(param)] = block.name
        units.append(unit)
    return OffloadPlan(units, resident_unit(model, units), prefetch_blocks, offload_resident)


def block_unit(name: str, module: nn.Module) -> Unit:
    """The unit of block ``module`` (qualified name ``name``): its parameters and buffers as they are now (at
    planning, and again for a block whose parameters or buffers changed since)."""
    return Unit(name, module, [(f"{name}.{n}", p) for n, p in module.named_parameters()], _buffers(module, name))


def resident_unit(model: nn.Module, blocks: list[Unit]) -> Unit:
    """The parameters and buffers of ``model`` outside every block, as they are now."""
    resident = Unit("resident", None)
    in_blocks = {id(p) for unit in blocks for _, p in unit.params}
    block_modules = {id(u.module) for u in blocks}
    for name, param in model.named_parameters():
        if id(param) not in in_blocks:
            resident.params.append((name, param))
    for mod_name, mod in model.named_modules():
        if any(mod_name == b.name or mod_name.startswith(f"{b.name}.") for b in blocks) or id(mod) in block_modules:
            continue
        for buf_name, buf in mod._buffers.items():
            if isinstance(buf, Tensor):
                resident.buffers.append((mod, buf_name, f"{mod_name}.{buf_name}" if mod_name else buf_name))
    return resident
