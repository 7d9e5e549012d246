"""The host optimizer step overlapping the backward pass: a block steps on the host as soon as its gradients have all
landed, while the backward of the blocks before it goes on (part of :class:`~.executor.L2LExecutor`).

One worker thread keeps the steps in block order; blocks whose gradients landed while the previous step ran are
batched into one optimizer call. Units whose optimizer state lives on the NVMe tier step one at a time through its
buffers (:meth:`~.tier.NVMeTier.step_unit`), during the backward or, where every gradient is needed first (clipping,
accumulation), after the closure (:meth:`HostSteps.step_spilled`); a streamed resident unit in the tier steps parameter
by parameter as their gradients land (:meth:`HostSteps.step_resident_param`). With the tier, the backward waits while more than
``max_unstepped`` blocks' gradients wait for their step: the gradients held at once are what its plan counted.
Nothing here imports Lightning.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn
from torch.profiler import record_function

from lightning_accel.offload.host_store import HostStore
from lightning_accel.offload.plan import OffloadPlan, Unit
from lightning_accel.offload.stats import OffloadStats
from lightning_accel.offload.streamer import Streamer
from lightning_accel.offload.tier import NVMeTier, UnitStep
from lightning_accel.offload.tier_setup import compute_reads

# a block's host step: updates the parameters, writes what it can of their shadows
# (parameter -> low-precision shadow) in the same pass, reads the bf16 gradients it is given
# (parameter -> the bf16 tensor ``.grad`` is the exact widening of) instead of the fp32 ones,
# returns the parameters it wrote shadows for
BlockStep = Callable[[list[nn.Parameter], dict[nn.Parameter, torch.Tensor], dict[nn.Parameter, torch.Tensor]],
                     list[torch.Tensor]]


class HostSteps:
    """The executor's host steps during (and, for spilled units, right after) the backward."""

    plan: OffloadPlan
    store: HostStore
    streamer: Streamer
    stats: OffloadStats
    tier: NVMeTier | None
    checkpoint_blocks: bool
    activations: object | None
    init_worker: Callable[[], None] | None
    _fresh: set[nn.Parameter]  # (and refresh_shadows, the executor's)

    def _init_host_steps(self) -> None:
        # Host optimizer steps that overlap the backward pass: set per backward by
        # ``step_blocks_during_backward``; one worker thread keeps them in block order.
        self._block_step: BlockStep | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._futures: list[Future[None]] = []
        # blocks whose gradients have all landed, waiting for the host-step thread, which
        # takes all of them in one optimizer call (see _step_ready)
        self._ready: list[int] = []
        self._ready_lock = threading.Lock()
        # blocks whose gradients landed and whose step has not finished; the backward waits above max_unstepped
        self._unstepped = 0
        self._stepped = threading.Condition()
        self.max_unstepped: int | None = None

    def _trainable_units(self) -> list[int]:
        return [i for i, u in enumerate(self.plan.blocks) if any(p.requires_grad for _, p in u.params)]

    def _hold_back(self) -> None:
        """With the NVMe tier, the backward waits while ``max_unstepped`` blocks' gradients wait for their step: the
        gradients held at once are what the tier's plan counted, however long the disk takes."""
        limit = self.max_unstepped
        if limit is None:
            return
        with self._stepped:
            while self._unstepped > limit and not any(f.done() and f.exception() for f in self._futures):
                self._stepped.wait(timeout=1.0)

    def step_blocks_during_backward(self, step: BlockStep | None) -> None:
        """For the next backward pass: run ``step(params, shadows)`` on the host for each block as
        soon as its gradients have all arrived, while the backward of earlier blocks goes
        on. ``None`` turns it off (accumulation micro-batches, gradient clipping, loss
        scaling: all need every gradient before any parameter moves)."""
        self._block_step = step
        if step is not None and self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="l2l-host-step", initializer=self.init_worker)
        if step is not None and self.tier is not None:
            # the backward steps the last blocks first: their spans are read during the forward, when the tier's
            # buffers and (bar the weights' reads, which go first) the disk are idle
            self.tier.expect(reversed(self._trainable_units()))

    def _step_ready(self, step: BlockStep) -> None:
        """Step every block whose gradients have landed since the last call, in one call.

        One call per block costs the optimizer's fixed overhead (hooks, grouping, kernel
        launches) per block; blocks that landed while the previous step ran are batched,
        so the thread catches up instead of falling further behind. A call that finds
        nothing ready (an earlier call took its block) returns at once.
        """
        with self._ready_lock:
            indices, self._ready = self._ready, []
        if not indices:
            return
        try:
            self._step_blocks(indices, step)
        finally:
            with self._stepped:
                self._unstepped -= len(indices)
                self._stepped.notify_all()

    def _step_blocks(self, indices: list[int], step: BlockStep) -> None:
        params = [p for i in indices for _, p in self.plan.blocks[i].params if p.requires_grad]
        self.streamer.finish_grads(params)
        stepped = [p for p in params if p in self.store.grads]
        for param in stepped:
            param.grad = self.store.grads.pop(param)
        tier = self.tier
        spilled = [i for i in indices if tier is not None and tier.is_spilled(i)]
        for index in spilled:  # through the tier's buffers, one unit at a time (its shadows refreshed there)
            assert tier is not None
            mine = {id(p) for _, p in self.plan.blocks[index].params}
            self._step_unit(index, [p for p in stepped if id(p) in mine], step)
        on_disk = {id(p) for i in spilled for _, p in self.plan.blocks[i].params}
        stepped = [p for p in stepped if id(p) not in on_disk]
        shadows = {p: self.store.shadow[p] for p in stepped if self.store.shadow[p] is not self.store.master[p]}
        written = set(step(stepped, shadows, self.store.exact_low_grads(stepped))) if stepped else set()
        for param in stepped:
            param.grad = None
        self.store.drop_low_grads(stepped)
        with record_function("l2l/host_step"):
            self.refresh_shadows([p for p in stepped if p not in written], wait=False)
        self._fresh.update(stepped)
        self.stats.blocks_stepped_in_backward += len(indices)
        self.stats.host_step_calls += 1

    def _step_unit(self, index: int, params: list[nn.Parameter], step: UnitStep, computing: bool = False,
                   grads: dict[nn.Parameter, torch.Tensor] | None = None) -> None:
        """Step ``params`` of spilled unit ``index`` through the tier, their gradients then let go (``computing``: the
        unit is still held for the compute, which no longer reads these parameters; ``grads``: their gradients, where
        not ``param.grad``)."""
        assert self.tier is not None
        shadows = {p: self.store.shadow[p] for p in params if self.store.shadow[p] is not self.store.master[p]}
        low = self.store.exact_low_grads(params) if grads is None else {}
        self.tier.step_unit(index, params, shadows, low, step, computing=computing, grads=grads)
        for param in params:
            if grads is None or param not in grads:
                param.grad = None
        self.store.drop_low_grads(params)
        self._fresh.update(params)

    def step_resident_param(self, param: nn.Parameter, step: UnitStep) -> None:
        """On the host-step thread, during the backward: step ``param`` of the streamed resident unit (in the tier) as
        soon as its gradient has landed, its gradient let go. Its value is not read again by this backward (autograd
        accumulates a leaf's gradient once all its uses are done), so the compute's copy stays as it was."""
        try:
            self.streamer.finish_grads([param])
            grad = self.store.grads.pop(param, None)
            if grad is None:
                return
            with record_function("l2l/host_step"):  # (its .grad takes the device copy's dtype: the gradient goes apart)
                self._step_unit(len(self.plan.blocks), [param], step, computing=True, grads={param: grad})
        finally:
            with self._stepped:
                self._unstepped -= 1
                self._stepped.notify_all()

    def step_spilled(self, step: UnitStep) -> None:
        """After the closure (gradients final, clipped), before the optimizer steps the rest: step every spilled
        unit with gradients through the tier, reading each unit's span while the one before it steps."""
        tier = self.tier
        if tier is None:
            return
        units = self.tier_units()
        order = [i for i in range(len(units)) if tier.is_spilled(i) and any(p.grad is not None for _, p in units[i].params)]
        tier.expect(order)
        with record_function("l2l/host_step"):
            for index in order:
                params = [p for _, p in units[index].params if p.requires_grad and p.grad is not None]
                self._step_unit(index, params, step)

    def tier_units(self) -> list[Unit]:
        """The units the NVMe tier indexes: the blocks, then the resident unit where it streams (it lives on the host)."""
        return self.plan.blocks + ([self.plan.resident] if self.plan.offload_resident else [])

    def compute_reads(self) -> list[int]:
        """How often a step's compute runs on each of :meth:`tier_units`' weights (:func:`.tier_setup.compute_reads`)."""
        return compute_reads(len(self.plan.blocks), self.plan.offload_resident, self.checkpoint_blocks, self.activations is not None)

    def wait_for_block_steps(self) -> None:
        """Join the host steps started during backward (re-raising their errors)."""
        futures, self._futures = self._futures, []
        for future in futures:
            future.result()
