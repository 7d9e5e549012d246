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
from lightning_accel.offload.tier_weights import in_a_file
from lightning_accel.stored import stored_nbytes


def unit_bytes(unit: Unit, store: HostStore, keys: dict[nn.Parameter, StateKeys], reads: int = 0) -> UnitBytes:
    """``unit``'s host bytes by kind; state and masters as laid out on disk (each tensor aligned). ``reads``: how often a
    step's compute runs on this unit's weights; it reads the fp32 masters only where they are what it runs on (no
    low-precision shadow)."""
    state = masters = weights = grads = on_masters = on_disk = 0
    for _, param in unit.params:
        if param in store.frozen or not param.requires_grad:
            weights += stored_nbytes(store.shadow[param])
            on_disk += align_up(stored_nbytes(store.shadow[param])) if in_a_file(store.shadow[param]) else 0
            continue
        master = store.master[param]
        nbytes = master.numel() * master.element_size()
        masters += align_up(nbytes)
        grads += nbytes
        state += sum(align_up(state_nbytes(((k, d),), master.numel())) for k, d in keys.get(param, ()))
        shadow = store.shadow[param]
        if shadow is not master:
            weights += stored_nbytes(shadow)
            on_disk += align_up(stored_nbytes(shadow))
        else:
            on_masters += align_up(nbytes)
    return UnitBytes(unit.name, state, masters, weights, grads, reads if reads and (on_masters or on_disk) else 0, on_masters,
                     on_disk)



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


# With the host step during the backward: the blocks whose gradients may be held at once (one arriving, one stepping,
# two waiting); the executor holds the backward back beyond that (L2LExecutor.max_unstepped)
BLOCKS_IN_FLIGHT = 4


def compute_reads(blocks: int, offload_resident: bool, checkpoint_blocks: bool = True, offload_activations: bool = False) -> list[int]:
    """How often a step's compute runs on each tier unit's weights (:meth:`~.executor.L2LExecutor.tier_units`' order):
    a checkpointed block twice (its forward, its recomputation in the backward), the last block once where its
    forward turns into its backward (checkpointing without ``offload_activations``: :mod:`.executor`), every block
    once without checkpointing, a streamed resident unit once (held from the forward to the end of the backward)."""
    turn = blocks - 1 if checkpoint_blocks and not offload_activations else None
    reads = [2 if checkpoint_blocks and i != turn else 1 for i in range(blocks)]
    return reads + ([1] if offload_resident else [])


# Buffers for the compute's reads of masters on disk beyond the prefetch depth: the block computing, and the block
# whose forward turned into its backward, held while the blocks before it are recomputed (:mod:`.executor`); a
# streamed resident unit (held for the whole step) adds one
WEIGHT_BUFFERS_BEYOND_PREFETCH = 2


def tier_inputs(units: list[Unit], store: HostStore, optimizer: Optimizer | None, cuda: bool,
                reads: list[int] | None = None, stepped: set[nn.Parameter] | None = None,
                ) -> tuple[list[UnitBytes], int, dict[nn.Parameter, StateKeys]]:
    """What the plan is made from, for the strategy and ``estimate`` alike: each unit's bytes, the host bytes outside
    the units that no plan moves (on CUDA the pinned staging each trainable parameter's gradient lands in, in its
    device dtype: a shadow's, or fp32), and the per-element state keys. ``reads``: :func:`compute_reads`.
    ``stepped``: the parameters this process steps, the only ones it keeps optimizer state for (data parallel with the
    host step partitioned: its own units'); None: every one."""
    trainable = [p for u in units for _, p in u.params if p.requires_grad and p not in store.frozen]
    owned = [p for p in trainable if stepped is None or p in stepped]
    keys = per_element_state(optimizer, owned, {p: store.master[p].dtype for p in owned}) if optimizer else {}
    fixed = sum(stored_nbytes(store.shadow[p]) for p in trainable) if cuda else 0
    reads = reads if reads is not None else [0] * len(units)
    return [unit_bytes(u, store, keys, r) for u, r in zip(units, reads, strict=True)], fixed, keys


def make_tier(units: list[Unit], store: HostStore, optimizer: Optimizer | None, budget: int | None, nvme_path: str | None,
              pin: bool, steps_in_backward: bool = False, held: int = 0, reads: list[int] | None = None,
              prefetch_blocks: int = 1, stepped: set[nn.Parameter] | None = None) -> tuple[TierPlan, NVMeTier | None]:
    """The tier plan for ``units`` (the executor's :meth:`~.executor.L2LExecutor.tier_units`) under ``budget``, and the
    tier itself when the plan spills (else None). ``steps_in_backward``: every step runs block by block during the
    backward (gradients held at once: :data:`BLOCKS_IN_FLIGHT` blocks'); ``held``: the last units keep theirs;
    ``reads``: :func:`compute_reads` (None: the compute never reads masters); ``prefetch_blocks``: the executor's
    prefetch depth (blocks whose weights are read ahead of their compute); ``stepped``: as for :func:`tier_inputs` (the
    other units' files hold their masters and weights only)."""
    sizes, fixed, keys = tier_inputs(units, store, optimizer, cuda=pin, reads=reads, stepped=stepped)
    tier_plan = plan_tier(sizes, budget, nvme=nvme_path is not None, fixed=fixed,
                          grads_in_flight=BLOCKS_IN_FLIGHT if steps_in_backward else None, held=held,
                          weight_buffers=prefetch_blocks + WEIGHT_BUFFERS_BEYOND_PREFETCH + held)
    if not tier_plan.spills:
        return tier_plan, None
    assert optimizer is not None and nvme_path is not None
    return tier_plan, NVMeTier(store, units, tier_plan, optimizer, keys, nvme_path, pin=pin)
