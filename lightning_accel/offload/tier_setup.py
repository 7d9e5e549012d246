"""The NVMe tier decided and made for one offloaded model and its optimizer (what the strategy calls at set-up).

Sizes come from the host store (masters, shadows, frozen tensors as stored) and from the optimizer
(its per-element state, :mod:`.state_keys`), are planned against the budget (:mod:`.tier_plan`), and
only a plan that puts something on disk makes files (:class:`.tier.NVMeTier`). Nothing here imports
Lightning.
"""

from __future__ import annotations

from torch import nn
from torch.optim import Optimizer

from lightning_accel.offload.disk_io import align_up
from lightning_accel.offload.host_optimizer import PER_PARAMETER
from lightning_accel.offload.host_store import HostStore
from lightning_accel.offload.plan import Unit
from lightning_accel.offload.state_keys import StateKeys, per_element_state, state_nbytes
from lightning_accel.offload.tier import NVMeTier
from lightning_accel.offload.tier_plan import TierPlan, UnitBytes, plan_tier
from lightning_accel.stored import stored_nbytes


def unit_bytes(unit: Unit, store: HostStore, keys: dict[nn.Parameter, StateKeys]) -> UnitBytes:
    """``unit``'s host bytes by kind; state and masters as laid out on disk (each tensor aligned)."""
    state = masters = weights = grads = 0
    for _, param in unit.params:
        if param in store.frozen or not param.requires_grad:
            weights += stored_nbytes(store.shadow[param])
            continue
        master = store.master[param]
        nbytes = master.numel() * master.element_size()
        masters += align_up(nbytes)
        grads += nbytes
        state += sum(align_up(state_nbytes(((k, d),), master.numel())) for k, d in keys.get(param, ()))
        shadow = store.shadow[param]
        if shadow is not master:
            weights += stored_nbytes(shadow)
    return UnitBytes(unit.name, state, masters, weights, grads)


def check_tier_optimizers(optimizers: list[Optimizer], owner: str) -> None:
    """The tier steps one unit at a time through its buffers: one optimizer, with a per-parameter rule."""
    if len(optimizers) != 1:
        raise ValueError(f"{owner}(nvme_path=...) steps the host parameters of one optimizer through its buffers, but "
                         f"configure_optimizers returned {len(optimizers)}; return one optimizer, or drop nvme_path")
    optimizer = optimizers[0]
    if type(optimizer) not in PER_PARAMETER:
        raise ValueError(
            f"{owner}(nvme_path=...) steps one unit at a time, which is one step only for a per-parameter optimizer, not "
            f"{type(optimizer).__name__}; use one of {', '.join(c.__name__ for c in PER_PARAMETER)}, or drop nvme_path")


def make_tier(units: list[Unit], store: HostStore, optimizer: Optimizer | None, budget: int | None, nvme_path: str | None,
              pin: bool, fixed: int = 0, grads_in_flight: int | None = None, held: int = 0) -> tuple[TierPlan, NVMeTier | None]:
    """The tier plan for ``units`` (the executor's :meth:`~.executor.L2LExecutor.tier_units`) under ``budget``, and the
    tier itself when the plan spills (else None)."""
    trainable = [p for u in units for _, p in u.params if p.requires_grad and p not in store.frozen]
    keys = per_element_state(optimizer, trainable, {p: store.master[p].dtype for p in trainable}) if optimizer else {}
    tier_plan = plan_tier([unit_bytes(u, store, keys) for u in units], budget, nvme=nvme_path is not None, fixed=fixed,
                          grads_in_flight=grads_in_flight, held=held)
    if not tier_plan.spills:
        return tier_plan, None
    assert optimizer is not None and nvme_path is not None
    return tier_plan, NVMeTier(store, units, tier_plan, optimizer, keys, nvme_path, pin=pin)
