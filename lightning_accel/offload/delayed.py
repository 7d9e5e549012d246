"""One-step delayed parameter update (ZeRO-Offload's DPU) for the host parameters.

Step t's gradients are *deferred*: they leave the parameters for a pending buffer, and the
host optimizer applies them to the fp32 masters in a worker thread while step t+1's
forward and backward run. Step t+1 therefore computes on weights that do not yet include
update t (one step stale). Two things make that safe to run concurrently:

- the next backward accumulates fresh gradients in the host store while the worker reads
  the pending ones: the two are different tensors (the store's gradient dict is handed
  over whole, not copied);
- the device computes on the store's *shadows* (``HostStore(snapshot=True)``), never on
  the masters the worker rewrites; :meth:`DelayedUpdate.finish` refreshes the shadows of
  the updated parameters once the step is done and the compute has stopped reading them.

The worker does not touch the user's optimizer object, which the main thread still uses
(``zero_grad``, the step of the parameters kept on the device): it steps a shallow copy
whose parameters are the masters themselves and whose state dicts are the optimizer's
own (keyed by the master instead of the parameter), with the hyper-parameters (learning
rate, ...) as they were at step t. New state entries are handed back in :meth:`finish`.
"""

from __future__ import annotations

import copy
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_accel.offload.host_step import update_groups
from lightning_accel.offload.host_store import HostStore
from lightning_accel.offload.stats import OffloadStats


class DelayedUpdate:
    """Holds at most one pending host update and applies it, in the background or now."""

    def __init__(self, store: HostStore, stats: OffloadStats, init_worker: Callable[[], None] | None = None) -> None:
        if not store.snapshot:
            raise ValueError("DelayedUpdate needs HostStore(snapshot=True): the device must compute on copies the optimizer does not write")
        self.store = store
        self.stats = stats
        self._optimizer: Optimizer | None = None
        self._view: Optimizer | None = None
        self._grads: dict[nn.Parameter, Tensor] = {}
        self._future: Future[None] | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._fuse = False
        self._init_worker = init_worker  # the worker thread's first call (its thread budget)

    @property
    def pending(self) -> bool:
        return self._optimizer is not None

    def defer(self, optimizer: Optimizer, grads: dict[nn.Parameter, Tensor], fuse: bool = False) -> None:
        """Take ``grads`` (host parameter -> its gradient for this step, already clipped or
        scaled as the step wants) as the pending update, with ``optimizer``'s current
        hyper-parameters. Call after :meth:`finish`: one update is pending at a time.
        ``fuse``: step the masters on torch's fused CPU kernel (see :mod:`.host_step`)."""
        if self.pending:
            raise RuntimeError("a delayed update is already pending; finish() it before deferring the next")
        if not grads:
            return
        # The view: same class, defaults and flags; the masters as parameters; state shared
        # with the optimizer; hyper-parameters frozen now (a scheduler may change them
        # before the update runs). No step hooks: they belong to the optimizer's own step.
        view = copy.copy(optimizer)
        vars(view).pop("step", None)  # an LR scheduler's instance-level wrapper of optimizer.step
        view._optimizer_step_pre_hooks = OrderedDict()
        view._optimizer_step_post_hooks = OrderedDict()
        view.param_groups = []
        for group in optimizer.param_groups:
            frozen = {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in group.items() if k != "params"}
            frozen["params"] = [self.store.master[p] for p in group["params"] if p in grads]
            view.param_groups.append(frozen)
        view.state = defaultdict(dict, {self.store.master[p]: optimizer.state[p] for p in grads if p in optimizer.state})
        self._optimizer, self._view, self._grads = optimizer, view, grads
        self._fuse = fuse
        self.stats.delayed_steps += 1

    def start(self) -> None:
        """Apply the pending update in the background (no-op if none, or already running)."""
        if self.pending and self._future is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="l2l-delayed-update", initializer=self._init_worker)
            self._future = self._pool.submit(self._apply)

    def finish(self) -> bool:
        """Wait for the pending update (running it here if it never started), hand new
        optimizer state back, and refresh the updated parameters' shadows. Call only when
        nothing computes on the shadows. Returns whether an update landed."""
        if not self.pending:
            return False
        future, self._future = self._future, None
        try:
            if future is None:
                self._apply()
            else:
                future.result()
        finally:
            optimizer, view, grads = self._optimizer, self._view, self._grads
            self._optimizer, self._view, self._grads = None, None, {}
        assert optimizer is not None and view is not None
        for param in grads:
            state = view.state.get(self.store.master[param])
            if state is not None:
                optimizer.state[param] = state
        self.store.refresh_shadows(list(grads))
        return True

    def _apply(self) -> None:
        assert self._view is not None
        masters = [self.store.master[p] for p in self._grads]
        for master, grad in zip(masters, self._grads.values()):
            master.grad = grad
        try:
            self._view.param_groups = update_groups(self._view, None, self._fuse)  # (they are the view's own)
            type(self._view).step(self._view)
        finally:
            for master in masters:
                master.grad = None

    def close(self) -> None:
        """Stop the worker thread (a running update is waited for, a pending one dropped)."""
        if self._future is not None:
            wait([self._future])  # its error, if any, belongs to the step that failed first
            self._future = None
        self._optimizer, self._view, self._grads = None, None, {}
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
