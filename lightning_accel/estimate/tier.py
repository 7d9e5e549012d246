"""The NVMe tier's plan for a model before it runs: what ``estimate`` and ``bench offload --nvme`` read.

The strategy decides its tier at set-up (:meth:`L2LOffloadHooks._setup_tier`) from the host store it
built (fp32 masters, low-precision shadows, frozen weights as stored) and the optimizer's
per-element state. Rather than a second copy of that arithmetic, the same store is built here over
the model as it is (the estimate's fake tensors: nothing allocated; the bench's fp32 CPU model: the
masters are its own tensors, nothing copied) and sized by the same functions
(:func:`~lightning_accel.offload.tier_setup.unit_bytes`,
:func:`~lightning_accel.offload.tier_plan.plan_tier`): the figures, the plan line and a budget's
refusal are the strategy's own. Nothing here imports Lightning.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_accel.config.errors import UserError
from lightning_accel.models.block_policy import BlockPolicy
from lightning_accel.offload.host_store import HostStore
from lightning_accel.offload.plan import make_plan
from lightning_accel.offload.state_keys import per_element_state
from lightning_accel.offload.tier_plan import TierPlan, UnitBytes, plan_tier
from lightning_accel.offload.tier_setup import check_tier_optimizers, unit_bytes
from lightning_accel.stored import stored_nbytes


class TierRefused(UserError, ValueError):
    """The strategy would refuse this budget at set-up: its own one-line message (a ValueError too, as the
    strategy raises it, so callers that report an estimate's ValueError as a line report this one)."""


def tier_plan(net: nn.Module, optimizers: Sequence[Optimizer], *, blocks: BlockPolicy = "auto", offload_resident: bool = False,
              compute_dtype: torch.dtype = torch.float32, host_budget: int | None = None, nvme_path: str | None = None,
              cuda: bool = False, stored: Mapping[str, int] | None = None, owner: str = "L2LOffloadStrategy") -> TierPlan:
    """The plan ``owner`` would make for ``net`` stepped by ``optimizers`` (the tier steps the first) under ``host_budget`` (bytes; None: no limit),
    spilling only with ``nvme_path``; ``cuda``: the device is a GPU (pinned gradient staging counts against the
    budget); ``stored``: stored bytes of frozen weights that differ from their tensors (a QLoRA base left unquantized
    on meta: :func:`~lightning_accel.estimate.params.nf4_weights`), by name in ``net``.

    Builds a :class:`~lightning_accel.offload.host_store.HostStore` over ``net``'s blocks, which points each
    trainable parameter's ``data`` at its fp32 master (the tensor itself where it already is one). Raises
    :class:`TierRefused` with the strategy's message where it would refuse the budget or the optimizer."""
    if nvme_path is not None:
        try:
            check_tier_optimizers(list(optimizers), owner)
        except ValueError as err:
            raise TierRefused(str(err)) from None
    optimizer = optimizers[0]
    plan = make_plan(net, blocks, offload_resident=offload_resident)
    store = HostStore(plan.blocks + ([plan.resident] if offload_resident else []), compute_dtype, pin=False)  # pinned: same bytes
    trainable = [p for u in plan.blocks for _, p in u.params if p.requires_grad and p not in store.frozen]
    keys = per_element_state(optimizer, trainable, {p: store.master[p].dtype for p in trainable})
    units = [_as_stored(unit_bytes(u, store, keys), u.params, store, stored or {}) for u in plan.blocks]
    # what the strategy counts outside the units (_setup_tier): a streamed resident unit's masters, pinned staging
    fixed = sum(stored_nbytes(store.master[p]) for _, p in plan.resident.params) if offload_resident else 0
    fixed += sum(p.numel() * 2 for u in plan.blocks for _, p in u.params if p.requires_grad) if cuda else 0
    try:
        return plan_tier(units, host_budget, nvme=nvme_path is not None, fixed=fixed)
    except ValueError as err:
        raise TierRefused(f"{owner}: {err}") from None


def _as_stored(unit: UnitBytes, params: list[tuple[str, nn.Parameter]], store: HostStore, stored: Mapping[str, int]) -> UnitBytes:
    """``unit`` with its frozen weights at the bytes they are stored in (``stored``), where that differs from the
    tensor the store holds."""
    change = sum(stored[name] - stored_nbytes(store.master[p]) for name, p in params if name in stored and p in store.frozen)
    return UnitBytes(unit.name, unit.state, unit.masters, unit.weights + change, unit.grads) if change else unit


def strategy_tier(strategy: Any, module: Any, net: nn.Module, compute_dtype: torch.dtype, cuda: bool,
                  stored: Mapping[str, int]) -> TierPlan | None:
    """The plan an ``L2LOffloadStrategy`` with ``host_budget`` or ``nvme_path`` makes for ``module`` at set-up, ``net``'s
    parameters standing for the fp32 masters (fake tensors: nothing allocated); None without either option, or
    without an optimizer (nothing steps: the strategy makes no tier either)."""
    from lightning_accel.estimate.params import _optimizers

    nvme_path, budget = getattr(strategy, "nvme_path", None), getattr(strategy, "host_budget", None)
    if nvme_path is None and budget is None:
        return None
    optimizers = _optimizers(module.configure_optimizers())
    if not optimizers:
        return None
    return tier_plan(net, optimizers, blocks=strategy.blocks, offload_resident=strategy.offload_resident,
                     compute_dtype=compute_dtype, host_budget=budget, nvme_path=nvme_path, cuda=cuda, stored=stored,
                     owner=type(strategy).__name__)
