"""Running a model layer to layer: fetch a block, compute it, release it.

Each block's ``forward`` is wrapped. In the forward pass the wrapper acquires the
block's weights on the device (prefetching the next ``prefetch_blocks`` blocks), runs the
block under ``torch.utils.checkpoint`` and releases the weights at once: only the block
boundary activations survive, so device memory does not grow with depth. In the
backward pass the checkpoint recomputes the block, which acquires the weights again
(prefetching the blocks *before* it); a post-accumulate-grad hook on each parameter sends
its gradient to the host as soon as autograd has produced it, and when a block's last
gradient has left, the block is released.

The last block is the exception: its backward follows its forward at once, so it is not
checkpointed (its activations are one block's worth, whatever the depth) and its
weights stay on the device across the turn, while the blocks before it are prefetched
for the backward: one block's recomputation and one block's weight copy less per step.
(With ``offload_activations`` it is checkpointed like the others, so that every block's
saved input goes to the host.)

A recomputation must not repeat what the block's forward wrote besides its output
(:mod:`lightning_accel.models.side_effects`): a block to be checkpointed that is called
with a transformers KV cache is refused before it runs (the recomputation would append
its keys and values again), and the buffers a block's forward writes (BatchNorm running
statistics, a litgpt ``KVCache`` written at ``input_pos``, counters) are put back after
its recomputation, so they change once per step, as in plain training.

The caller brackets the backward pass with :meth:`begin_backward` /
:meth:`end_backward` (the Lightning strategy does it in ``pre_backward`` /
``post_backward``) so the wrapper knows which direction to prefetch in.

Two options change what lives where. ``offload_activations`` runs each checkpointed block
under :class:`~lightning_accel.offload.activations.ActivationOffload`'s hooks, so the
block inputs it saves wait for the backward in host memory. ``delayed_update`` keeps a
compute snapshot of every host parameter and lets
:class:`~lightning_accel.offload.delayed.DelayedUpdate` apply step t's update to the
masters while step t+1 computes (:meth:`defer_update`, :meth:`start_delayed_update`,
:meth:`finish_delayed_update`).

For a profiler, the streamer labels each unit's fetch, copies, release and gradients
(``l2l/fetch``, ``l2l/copy``, ``l2l/release``, ``l2l/grad_to_host``), and
:mod:`.host_step` the host optimizer step (``l2l/host_step``); here the same label goes on
what belongs to the host step outside it: the shadows refreshed after a block's update
during the backward or after the step, and the wait for a delayed update to land.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function
from torch.utils.checkpoint import checkpoint

from lightning_accel.models.side_effects import BufferRestore, buffer_versions, cache_argument, describe_cache_refusal
from lightning_accel.offload.activations import ActivationOffload
from lightning_accel.offload.delayed import DelayedUpdate
from lightning_accel.offload.host_store import HostStore
from lightning_accel.offload.plan import OffloadPlan
from lightning_accel.offload.replan import RESIDENT, Changes, Watch, apply_changes, find_changes
from lightning_accel.offload.stats import OffloadStats
from lightning_accel.offload.streamer import Streamer
from lightning_accel.offload.tier import NVMeTier
from lightning_accel.offload.host_steps import HostSteps
from lightning_accel.patching import Patch, patch, remove_all

class L2LExecutor(HostSteps):
    """Installs layer-to-layer execution on a model and keeps its host state."""

    def __init__(
        self,
        model: nn.Module,
        plan: OffloadPlan,
        device: torch.device,
        compute_dtype: torch.dtype = torch.float32,
        checkpoint_blocks: bool = True,
        alias: bool = True,
        delayed_update: bool = False,
        offload_activations: bool = False,
        init_worker: Callable[[], None] | None = None,
        owner: str = "L2LExecutor",
    ) -> None:
        if offload_activations and not checkpoint_blocks:
            raise ValueError(
                "offload_activations=True needs checkpoint_blocks=True: without checkpointing every activation inside "
                "every block would be saved and sent to the host; set checkpoint_blocks=True or offload_activations=False"
            )
        self.model = model
        self.plan = plan
        self.device = device
        self.checkpoint_blocks = checkpoint_blocks
        self.owner = owner  # who refuses, in errors raised during a forward (the strategy's name)
        self._restore = BufferRestore()  # buffers a block writes, put back after its recomputation
        self.stats = OffloadStats()
        units = plan.blocks + ([plan.resident] if plan.offload_resident else [])
        self.store = HostStore(units, compute_dtype, pin=device.type == "cuda", snapshot=delayed_update)
        self.streamer = Streamer(self.store, device, self.stats, alias=alias)
        # units whose optimizer state and masters live on disk (set once the optimizer exists: attach_tier); what
        # makes it again when the parameters change (unfrozen, frozen, replaced: begin_step)
        self.tier: NVMeTier | None = None
        self.retier: Callable[[], None] | None = None
        self.stats.offloaded_params = self.store.numel()
        self.update_host_bytes()
        # runs first in every host-step / delayed-update thread (the thread budget, HostThreads)
        self.init_worker = init_worker
        self.delayed = DelayedUpdate(self.store, self.stats, init_worker) if delayed_update else None
        self.activations = ActivationOffload(device, self.stats, self.streamer.copy_stream) if offload_activations else None
        self._backward = False
        # the block whose forward turns into the backward at once (see the module docstring)
        self._turn = len(plan.blocks) - 1 if checkpoint_blocks and not offload_activations else None
        self._originals: dict[int, Callable[..., Any]] = {}
        self._patches: list[Patch] = []  # the blocks' wrapped forwards, removed by detach()
        self._hooks: dict[nn.Parameter, Any] = {}  # the gradient hook of each offloaded parameter requiring grad
        self._unit_of: dict[nn.Parameter, int] = {}
        self._watch = Watch()  # whether the user's code may have changed a parameter since the last step
        self._pending_grads: dict[int, int] = {}
        self._step_h2d = self._step_d2h = self._step_act = 0
        self._init_host_steps()  # the host steps during the backward (:mod:`.host_steps`)
        # parameters whose shadows already hold this step's update (written by it)
        self._fresh: set[nn.Parameter] = set()
        # called with a block's index once its last gradient of a backward pass has gone to the
        # host (data parallel: launch that block's reduction, :mod:`.grad_sync`); None: nothing
        self.grads_landed: Callable[[int], None] | None = None

    def baseline(self) -> None:
        """The caller moved the parameters' tensors, and the store's tables with them (a model materialized from meta,
        settled into memory after the tier's set-up): what the next steps compare with, not a change of the user's."""
        self._watch.settle(self.model, self.store)

    def attach_tier(self, tier: NVMeTier) -> None:
        """From now on the spilled units of ``tier`` step through its buffers (:meth:`step_spilled`, and the
        block steps during the backward); the host bytes no longer count what went to disk."""
        self.tier = tier
        self.streamer.disk = tier.weights if tier.weights.spans else None  # the masters the compute runs on, read ahead
        self.streamer.disk_keys = {RESIDENT: len(self.plan.blocks)} if self.plan.offload_resident else {}  # tier_units' order
        self._watch.settle(self.model, self.store)  # the parameters now hold the tier's views: the baseline
        self.stats.peak_host_bytes = 0  # what the store held before its bytes went to disk is no peak of the tier's
        self.update_host_bytes()

    # -- installation -----------------------------------------------------------------
    def attach(self) -> None:
        """Place the resident unit, wrap the blocks, and hook the gradients."""
        if not self.plan.offload_resident:
            for _, param in self.plan.resident.params:
                param.data = param.data.to(self.device)
            for owner, name, _ in self.plan.resident.buffers:
                owner._buffers[name] = owner._buffers[name].to(self.device)
        for index, unit in enumerate(self.plan.blocks):
            assert unit.module is not None
            self._originals[index] = unit.module.forward
            # an instance attribute: a forward the user's instance already had comes back at detach()
            self._patches.append(patch(unit.module, "forward", _BlockForward(self._block_forward, index, unit.module.forward)))
            for _, param in unit.params:
                self._unit_of[param] = index
        if self.plan.offload_resident:
            for _, p in self.plan.resident.params:
                self._unit_of[p] = RESIDENT
        for param in self._unit_of:
            if param.requires_grad:
                self._send_grads(param)
        self._watch.open(self.model)

    def _send_grads(self, param: nn.Parameter) -> None:
        """From now on ``param``'s gradients go to the host as autograd produces them."""
        if param not in self._hooks:
            self._hooks[param] = param.register_post_accumulate_grad_hook(self._on_grad)

    def _stop_grads(self, param: nn.Parameter) -> None:
        """``param`` sends no more gradients (frozen again, or gone from its unit): its hook and staging buffer go."""
        handle = self._hooks.pop(param, None)
        if handle is not None:
            handle.remove()
        self.streamer.drop_staging(param)

    def detach(self) -> None:
        """Undo :meth:`attach`: the model computes normally again (weights stay on the host)."""
        remove_all(self._patches)
        self._originals.clear()
        for handle in self._hooks.values():
            handle.remove()
        self._hooks.clear()
        self._watch.close()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        if self.delayed is not None:
            self.delayed.close()

    # -- forward ------------------------------------------------------------------------
    def update_host_bytes(self, optimizer_bytes: int | None = None) -> None:
        """Restate ``stats.host_bytes`` (the store and the gradient staging buffers), and the
        host optimizer state's bytes when the caller measured them."""
        self.stats.host_bytes = self.store.host_bytes() + self.streamer.staging_bytes()
        if self.tier is not None:
            self.stats.host_bytes += self.tier.buffer_bytes - self.tier.store_bytes_on_disk()
            if self.tier.plan.grads_in_flight is not None:  # the backward holds back: only the plan's gradients at once
                self.stats.host_bytes += self.tier.plan.grad_bytes - (self.store.host_bytes() - self.store.weight_bytes())
            self.stats.nvme_bytes = self.tier.plan.disk_bytes
        if optimizer_bytes is not None:
            self.stats.host_optimizer_bytes = optimizer_bytes
        if self.tier is not None:
            self.stats.nvme_read_bytes = self.tier.counters.read_bytes
            self.stats.nvme_write_bytes = self.tier.counters.write_bytes
            self.stats.nvme_seconds = self.tier.counters.wait_seconds
        self.stats.peak_host_bytes = max(self.stats.peak_host_bytes, self.stats.host_bytes)

    def find_changes(self) -> Changes:
        """What the user's code changed in the planned parameters since the last step (:mod:`.replan`); raises the
        refusals. Units a step left on the device (its backward never ran: ``training_step`` returned None) are
        released first: every parameter is compared on its host tensor."""
        if self.streamer.on_device:
            self.end_eval()
        if self._watch.quiet():
            return Changes()
        changes = find_changes(self.model, self.plan, self.store, self._watch.trainable, self.owner)
        if not changes:
            self._watch.settle(self.model, self.store)
        return changes

    def begin_step(self, changes: Changes | None = None) -> Changes:
        """Before a forward pass: follow what changed since the last step (``changes``, else found now: a frozen
        parameter that requires grad now is thawed, one frozen again goes back to its stored form, replaced data
        is adopted, units whose parameters changed are planned again; a pending delayed update lands first), then
        bring the resident unit in if it streams. Returns the changes (falsy: none)."""
        changes = self.find_changes() if changes is None else changes
        if changes:
            self.finish_delayed_update()  # the update computed before the change lands in the masters it was for
            retier = self.tier is not None and self.retier is not None
            if self.tier is not None:  # its files were laid out for the parameters as they were: read from, then let go
                self.tier.close()
                self.tier = None
                self.streamer.disk = None
            apply_changes(changes, self.model, self.plan, self.store, self.device, self._unit_of, self._send_grads, self._stop_grads)
            if retier:
                assert self.retier is not None
                self.retier()  # a new plan and new files from the parameters and state as they are now (attach_tier)
            self._watch.settle(self.model, self.store)
            self.stats.offloaded_params = self.store.numel()
            self.update_host_bytes()
        if self.plan.offload_resident:
            self.streamer.acquire(RESIDENT, self.plan.resident)
        return changes

    def _block_forward(self, index: int, *args: Any, **kwargs: Any) -> Any:
        if self.checkpoint_blocks and torch.is_grad_enabled() and index != self._turn:
            self._refuse_cache(index, args, kwargs)
            if self.activations is not None:
                # the only tensors saved outside the checkpoint are the block's inputs
                with self.activations.hooks():
                    return checkpoint(self._run_block, index, *args, use_reentrant=False, **kwargs)
            return checkpoint(self._run_block, index, *args, use_reentrant=False, **kwargs)
        return self._run_block(index, *args, **kwargs)

    def _run_block(self, index: int, *args: Any, **kwargs: Any) -> Any:
        unit = self.plan.blocks[index]
        if self._backward:
            # Blocks after this one have finished computing their backward; autograd may
            # still be about to accumulate some of their gradients (it schedules that
            # after this recomputation), which needs no weights: free them now, keeping
            # their gradient count so the host step still starts when the last arrives.
            for other in [i for i in self.streamer.on_device if i > index]:
                self.streamer.release(other, self.plan.blocks[other])
        self.streamer.acquire(index, unit)
        grad_follows = self._backward or (torch.is_grad_enabled() and (not self.checkpoint_blocks or index == self._turn))
        # Prefetch in the direction the next block computes: the backward's after the turn.
        step = -1 if self._backward or (grad_follows and index == self._turn) else 1
        for ahead in range(1, self.plan.prefetch_blocks + 1):
            nxt = index + step * ahead
            if 0 <= nxt < len(self.plan.blocks):
                self.streamer.prefetch(nxt, self.plan.blocks[nxt])
        if grad_follows:
            # Released by _on_grad once the last of its gradients has gone to the host.
            # Counted *before* the call: a recomputation stops early (torch.utils.checkpoint
            # raises out of the forward once it has what backward needs), so nothing after
            # the call is guaranteed to run in the backward pass.
            self._pending_grads[index] = sum(1 for _, p in unit.params if p.requires_grad)
        module = unit.module
        assert module is not None
        if self._backward:  # a recomputation: whatever it writes to the block's buffers is undone
            with self._restore.recompute(module):
                out = self._originals[index](*args, **kwargs)
        elif not grad_follows and torch.is_grad_enabled():  # a checkpointed forward: see what a recomputation would repeat
            before = buffer_versions(module)
            out = self._originals[index](*args, **kwargs)
            self._restore.observe(module, before)
        else:
            out = self._originals[index](*args, **kwargs)
        if not grad_follows:
            # checkpointed forward (or no grad): only the block's inputs are kept, so the
            # weights can go now and come back for the recomputation in backward.
            self._release_block(index)
        return out

    def _refuse_cache(self, index: int, args: tuple, kwargs: dict) -> None:
        argument = cache_argument(args, kwargs)
        if argument is not None:
            value = kwargs[argument] if argument in kwargs else args[int(argument[5:-1])]
            unit = self.plan.blocks[index]
            raise RuntimeError(describe_cache_refusal(self.owner, unit.name, unit.module, argument, value, "recomputing it in backward"))

    def _release_block(self, index: int) -> None:
        self.streamer.release(index, self.plan.blocks[index])
        self._pending_grads.pop(index, None)

    # -- backward -----------------------------------------------------------------------
    def begin_backward(self) -> None:
        self._backward = True
        if self.tier is not None and self._block_step is not None:  # blocks step as the backward reaches them
            self.tier.expect(reversed(self._trainable_units()))

    def _on_grad(self, param: nn.Parameter) -> None:
        grad = param.grad
        if grad is None:
            return
        param.grad = None  # the device buffer goes; the host keeps the sum
        self.streamer.grad_to_host(param, grad)
        index = self._unit_of[param]
        if index == RESIDENT and self._block_step is not None and self.tier is not None \
                and self.tier.is_spilled(len(self.plan.blocks)):
            # a streamed resident unit's parameter steps as its gradient lands (the head's at the start of the backward,
            # the embedding's at its end): never both gradients held at once (:meth:`.HostSteps.step_resident_param`)
            assert self._pool is not None
            with self._ready_lock:
                self._unstepped += 1  # (a gradient in flight as a block's is: the backward holds back beyond the plan's)
            self._futures.append(self._pool.submit(self.step_resident_param, param, self._block_step))
            self._hold_back()
            return
        if index == RESIDENT or index not in self._pending_grads:
            return
        self._pending_grads[index] -= 1
        if self._pending_grads[index] == 0:
            self._release_block(index)
            if self.grads_landed is not None:
                self.grads_landed(index)
            if self._block_step is not None:
                assert self._pool is not None
                with self._ready_lock:
                    self._ready.append(index)
                    self._unstepped += 1
                self._futures.append(self._pool.submit(self._step_ready, self._block_step))
                self._hold_back()

    def end_backward(self) -> None:
        """After backward: release what is still on the device and land the gradients."""
        self._backward = False
        for index in list(self.streamer.on_device):
            if index != RESIDENT:
                self._release_block(index)
        self.wait_for_block_steps()
        self._block_step = None
        self._pending_grads.clear()
        self.streamer.finish_grads()
        if self.activations is not None:
            self.activations.finish()
        if self.plan.offload_resident:
            self.streamer.release(RESIDENT, self.plan.resident)

    def end_eval(self) -> None:
        """After a no-grad forward (validation): release everything."""
        for index in list(self.streamer.on_device):
            if index == RESIDENT:
                self.streamer.release(RESIDENT, self.plan.resident)
            else:
                self._release_block(index)

    # -- optimizer ---------------------------------------------------------------------
    def install_grads(self) -> None:
        """Before clipping and the optimizer step: host gradients become ``param.grad``."""
        self.store.install_grads()

    def shadows_to_write(self) -> dict[nn.Parameter, torch.Tensor]:
        """The low-precision shadows this step's update may write as it updates their masters
        (:mod:`.shadow_fold`): every one not yet fresh; ``{}`` where the shadows are the masters
        themselves. The copy stream has finished reading them when this returns."""
        stale = {p: s for p, s in self.store.shadow.items() if s is not self.store.master[p] and p not in self._fresh}
        if stale:
            self.streamer.wait_copies()
        return stale

    def keep_low_grads(self, keep: bool) -> None:
        """From the next gradients on, keep the bf16 ones the host widens (:meth:`.HostStore.add_grad`):
        for an update whose C kernel reads them (:meth:`low_grads_to_read`)."""
        self.store.keep_low(keep)

    def low_grads_to_read(self) -> dict[nn.Parameter, torch.Tensor]:
        """Parameter -> the bf16 gradient its ``.grad`` is still the exact widening of, for the update."""
        return self.store.exact_low_grads()

    def shadows_written(self, params: list[nn.Parameter]) -> None:
        """The update wrote these parameters' shadows (:meth:`after_step` leaves them alone)."""
        self._fresh.update(params)

    def refresh_shadows(self, params: list[nn.Parameter], wait: bool = True) -> None:
        """Bring ``params``' shadows up to their just-updated masters (``wait``: first let
        the copy stream finish reading the old ones)."""
        if wait:
            self.streamer.wait_copies()
        self.store.refresh_shadows(params)
        self._fresh.update(params)

    def after_step(self, masters_changed: bool = True) -> None:
        """After the optimizer step: refresh the shadows not yet refreshed (unless the step
        deferred every host update, leaving the masters as they were), drop host gradients,
        count the step."""
        if self.tier is not None:
            self.tier.finish_step()  # every write landed: the views read this step's values
        if masters_changed:
            stale = [p for p in self.store.master if p not in self._fresh]
            if stale:
                with record_function("l2l/host_step"):
                    self.streamer.wait_copies()
                    self.store.refresh_shadows(stale)
        self._fresh.clear()
        self.store.clear_grads()
        self.stats.steps += 1
        self.stats.h2d_bytes_per_step = self.stats.h2d_bytes - self._step_h2d
        self.stats.d2h_bytes_per_step = self.stats.d2h_bytes - self._step_d2h
        self.stats.activation_d2h_bytes_per_step = self.stats.activation_d2h_bytes - self._step_act
        self._step_h2d, self._step_d2h = self.stats.h2d_bytes, self.stats.d2h_bytes
        self._step_act = self.stats.activation_d2h_bytes

    # -- one-step delayed update ---------------------------------------------------------
    def defer_update(self, optimizer: torch.optim.Optimizer, fuse: bool = False) -> None:
        """After this step's gradients are final (clipped): take every host gradient off
        its parameter as the pending update, so ``optimizer.step()`` now steps only the
        parameters kept on the device. The previous update must have finished."""
        assert self.delayed is not None, "defer_update needs L2LExecutor(delayed_update=True)"
        grads, self.store.grads = self.store.grads, {}
        for param in grads:
            param.grad = None
        self.delayed.defer(optimizer, grads, fuse=fuse)

    def start_delayed_update(self) -> None:
        """At the start of a step: apply the pending update in the background."""
        if self.delayed is not None:
            self.delayed.start()

    def finish_delayed_update(self) -> bool:
        """Once the step's compute is done (or before anything reads the weights): land the
        pending update in the masters and the compute snapshots. Returns whether one landed."""
        if self.delayed is None or not self.delayed.pending:
            return False
        with record_function("l2l/host_step"):  # what of the background update the step waits for
            self.streamer.wait_copies()  # no copy may still read a snapshot about to change
            return self.delayed.finish()


class _BlockForward:
    """A streamed block's ``forward`` (an instance attribute, as :func:`~lightning_accel.patching.patch` sets it).

    ``copy.deepcopy`` of the block, or of anything holding it (a model an EMA or SWA callback copies during fit), makes
    an ordinary module: the copy's ``forward`` is the block's own (its class's, bound to the copy), not the executor's,
    whose locks and threads cannot be copied; the copy's weights are the block's current ones (its host masters)."""

    def __init__(self, run: Callable[..., Any], index: int, original: Callable[..., Any]) -> None:
        self.run, self.index, self.original = run, index, original

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.run(self.index, *args, **kwargs)

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        return copy.deepcopy(self.original, memo)
