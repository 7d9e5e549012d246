"""Following what the user's code changed in the planned parameters between two steps.

The plan (:mod:`.plan`) and the host store (:mod:`.host_store`) are made once per fit, but a
Lightning run keeps changing parameters after that, between steps, and plain training follows
every change because the module simply computes on whatever it holds:

- gradual unfreezing (``BaseFinetuning``, ``BackboneFinetuning``, ``requires_grad_`` and
  ``optimizer.add_param_group`` by hand) makes a parameter frozen at planning require grad, and
  freezing one again the reverse;
- ``ModelPruning`` re-parametrizes a weight (``weight`` becomes ``weight_orig``, the same
  parameter under a new name, plus a ``weight_mask`` buffer) and its lottery-ticket reset
  replaces that parameter's ``.data`` with a copy of its initial values;
- code may add, remove or replace a block's parameters.

Left alone, each is wrong in its own way: a thawed weight would step in its stored dtype, or
not at all; a replaced ``.data`` is a tensor the masters, the copies and the other ranks never
see (``l2l_offload_ddp`` ended 0.04-0.08 away from DDP under ``ModelPruning``, in silence: the
owner stepped the replaced tensor, then sent its untouched master to the other ranks); an added
parameter is neither streamed nor averaged. So before each step :func:`find_changes` compares
the model with the plan and the store, and :func:`apply_changes` brings them up to date. What
cannot be followed is refused in one line: a quantized weight set to require grad (it has no
values to update), and a block module replaced by another (the plan streams the module it wrapped).

The comparison walks every module (~30 us a parameter tensor on a loaded 2-core machine: 30 ms
for a GPT of 80 blocks, too much for every step), so a :class:`Watch` decides first whether
anything it looks for can have changed: torch's global registration hooks flag a parameter,
buffer or submodule registered on any module (pruning's ``weight_orig`` and mask, a block
replaced), and a tuple of ``requires_grad`` flags and one of the data pointers of the tensors
the store holds are compared with the last step's (~0.3 us a parameter). A parameter removed
without anything registered (``del module.weight``) goes unnoticed; the store keeps it, which
costs its bytes and changes nothing the model computes. Nothing here imports Lightning.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.module import (
    register_module_buffer_registration_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.utils.hooks import RemovableHandle

from lightning_accel.offload.host_store import KEEP_IT_FROZEN, HostStore, cannot_train
from lightning_accel.offload.plan import OffloadPlan, Unit, block_unit, resident_unit
from lightning_accel.stored import is_plain, plain_parts

RESIDENT = -1  # the resident unit's index, as in the executor and the streamer


@dataclass
class Changes:
    """What differs between the model and the plan or the store before a step (falsy: nothing)."""

    units: list[int] = field(default_factory=list)  # units whose parameters were added, removed or renamed (RESIDENT last)
    adopt: list[nn.Parameter] = field(default_factory=list)  # ``.data`` replaced by the user's code
    thaw: list[nn.Parameter] = field(default_factory=list)  # frozen in the store, requiring grad now
    refreeze: list[nn.Parameter] = field(default_factory=list)  # thawed earlier, frozen again
    trainable_changed: bool = False  # which of the model's parameters require grad is not what it was
    names: dict[nn.Parameter, str] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.units or self.adopt or self.thaw or self.refreeze or self.trainable_changed)

    def describe(self) -> str:
        """One line: what the store now does differently, for the strategy to say."""
        said = []
        for what, params in (("began training (masters made from their stored values)", self.thaw),
                             ("frozen again (back to their stored dtype)", self.refreeze),
                             ("had their .data replaced by the user's code (taken as their masters)", self.adopt)):
            if params:
                said.append(f"{len(params)} parameters {what}: {_names(self.names, params)}")
        if self.units:
            said.append(f"{len(self.units)} units planned again (parameters added, removed or renamed)")
        return "; ".join(said) or "which of the parameters kept on the device require grad changed"


def _names(names: dict[nn.Parameter, str], params: list[nn.Parameter], most: int = 4) -> str:
    shown = ", ".join(names.get(p, "?") for p in params[:most])
    return shown + (f" and {len(params) - most} more" if len(params) > most else "")


class Watch:
    """Whether anything :func:`find_changes` looks for can have changed since :meth:`settle` (see the module
    docstring): a registration anywhere, a ``requires_grad`` flag, or the tensor an offloaded parameter holds."""

    def __init__(self) -> None:
        self.dirty = True  # a module registered a parameter, buffer or submodule since settle (or never settled)
        self.trainable: frozenset[nn.Parameter] = frozenset()  # the model's parameters requiring grad at settle
        self._params: list[nn.Parameter] = []
        self._flags: tuple[bool, ...] = ()
        self._held: list[tuple[nn.Parameter, int, bool]] = []  # offloaded parameter, its stored tensor's pointer, plain
        self._handles: list[RemovableHandle] = []

    def open(self, model: nn.Module) -> None:
        """Start flagging registrations (process-wide hooks: any module's, until :meth:`close`); ``model``'s
        parameters requiring grad now are those of the plan."""
        self._handles = [register(self._mark) for register in (register_module_parameter_registration_hook,
                                                               register_module_buffer_registration_hook,
                                                               register_module_module_registration_hook)]
        self.trainable = frozenset(p for p in model.parameters() if p.requires_grad)
        self.dirty = True

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _mark(self, *_: Any) -> None:
        self.dirty = True

    def settle(self, model: nn.Module, store: HostStore) -> None:
        """``model`` and ``store`` agree with the plan now: remember what to compare the next steps with."""
        self._params = list(model.parameters())
        self._flags = tuple(p.requires_grad for p in self._params)
        self.trainable = frozenset(p for p, flag in zip(self._params, self._flags) if flag)
        self._held = [(p, _pointer(t), is_plain(t)) for p, t in store.master.items()]
        self.dirty = False

    def quiet(self) -> bool:
        """Nothing to compare: no registration, the same flags, every offloaded parameter on its stored tensor."""
        if self.dirty or tuple(p.requires_grad for p in self._params) != self._flags:
            return False
        return all((p.data_ptr() if plain else _pointer(p)) == pointer for p, pointer, plain in self._held)


def _pointer(tensor: Tensor) -> int:
    """Where ``tensor``'s data is (a wrapper subclass: its first inner tensor's)."""
    return plain_parts(tensor)[0].data_ptr()


def find_changes(model: nn.Module, plan: OffloadPlan, store: HostStore, trainable: frozenset[nn.Parameter],
                 owner: str) -> Changes:
    """Compare ``model`` with ``plan`` and ``store`` (``trainable``: the parameters that required grad at the last
    step). Changes nothing; raises the refusals (``owner`` names the strategy in them)."""
    current: list[list[tuple[str, nn.Parameter]]] = []
    for unit in plan.blocks:
        assert unit.module is not None
        _refuse_replaced_block(model, unit, owner)
        current.append([(f"{unit.name}.{n}", p) for n, p in unit.module.named_parameters()])
    everything = list(model.named_parameters())
    in_blocks = {p for params in current for _, p in params}
    resident = [(n, p) for n, p in everything if p not in in_blocks]
    changes = Changes()
    changes.units = [i for i, params in enumerate(current) if not _same(params, plan.blocks[i].params)]
    if not _same(resident, plan.resident.params):
        changes.units.append(RESIDENT)
    changes.trainable_changed = frozenset(p for _, p in everything if p.requires_grad) != trainable
    stays = in_blocks | ({p for _, p in resident} if plan.offload_resident else set())
    held = [p for p in store.master if p in stays]
    changes.adopt = [p for p in held if not store.holds_data_of(p)]
    changes.thaw = [p for p in held if p in store.frozen and p.requires_grad]
    changes.refreeze = [p for p in held if p in store.thawed and not p.requires_grad]
    if not changes:
        return changes
    changes.names = {p: n for n, p in everything}
    added = [p for p in stays if p not in store.master and p.requires_grad]
    for param in [*changes.thaw, *added]:
        refusal = cannot_train(store.master[param] if param in store.master else param.data)
        if refusal is not None:
            raise RuntimeError(
                f"{owner}: parameter {changes.names[param]} {refusal}, and it was set to require grad after the "
                f"offload was planned; {KEEP_IT_FROZEN}"
            )
    return changes


def apply_changes(changes: Changes, model: nn.Module, plan: OffloadPlan, store: HostStore, device: torch.device,
                  unit_of: dict[nn.Parameter, int], send_grads: Callable[[nn.Parameter], None],
                  stop_grads: Callable[[nn.Parameter], None]) -> None:
    """Bring ``plan``, ``store`` and ``unit_of`` (offloaded parameter -> its unit's index) up to date with ``changes``
    (no step under way, every unit released, no update pending). ``send_grads`` / ``stop_grads``: the executor's, for
    the offloaded parameters that start or stop sending gradients to the host (its hooks and staging buffers)."""
    added: list[tuple[int, str, nn.Parameter]] = []
    for index in changes.units:  # blocks first: the resident unit is what they do not hold
        unit = plan.resident if index == RESIDENT else plan.blocks[index]
        fresh = resident_unit(model, plan.blocks) if index == RESIDENT else block_unit(unit.name, unit.module)  # type: ignore[arg-type]
        before, now = {p for _, p in unit.params}, {p for _, p in fresh.params}
        for _, param in unit.params:
            if param not in now and param in unit_of:  # (a parameter moved to another unit is added back there)
                stop_grads(param)
                store.remove(param)
                del unit_of[param]
        unit.params, unit.buffers = fresh.params, fresh.buffers
        added += [(index, name, p) for name, p in unit.params if p not in before]
    for index, name, param in added:
        if index == RESIDENT and not plan.offload_resident:  # kept on the device, as attach placed the resident unit
            param.data = param.data.to(device)
            continue
        store.add(name, param)
        unit_of[param] = index
        if param.requires_grad:
            send_grads(param)
    for index in changes.units:
        unit = plan.resident if index == RESIDENT else plan.blocks[index]
        if index != RESIDENT or plan.offload_resident:
            store.add_buffers(unit.buffers)
        else:
            for owner, name, _ in unit.buffers:
                owner._buffers[name] = owner._buffers[name].to(device)  # type: ignore[union-attr]
    for param in changes.adopt:
        store.adopt(param)
    for param in changes.thaw:
        store.thaw(param)
        send_grads(param)
    for param in changes.refreeze:
        store.refreeze(param)
        stop_grads(param)


def _same(a: list[tuple[str, nn.Parameter]], b: list[tuple[str, nn.Parameter]]) -> bool:
    return len(a) == len(b) and all(na == nb and pa is pb for (na, pa), (nb, pb) in zip(a, b))


def _refuse_replaced_block(model: nn.Module, unit: Unit, owner: str) -> None:
    try:
        found = model.get_submodule(unit.name)
    except AttributeError:
        found = None
    if found is not unit.module:
        now = "removed" if found is None else f"replaced by a {type(found).__name__}"
        raise RuntimeError(
            f"{owner}: block {unit.name} was {now} after the offload was planned, and the plan streams the "
            f"{type(unit.module).__name__} it wrapped; change the model's blocks before fit (each fit plans again)"
        )
