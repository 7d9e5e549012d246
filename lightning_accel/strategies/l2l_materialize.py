"""A model built on meta under the L2L strategy, materialized unit by unit into the offload's places.

The strategy's side of :mod:`lightning_accel.offload.materialize`: before the units are planned on real tensors
(``model_to_device``), a model with meta tensors is planned once on meta, to learn which unit each tensor belongs
to, and materialized: with ``nvme_path`` each block (and the resident unit with ``offload_resident``) through a
staging file, so host memory never holds the model whole; after the tier took its units (``setup``), what it keeps
in memory is settled there. Without ``nvme_path`` every unit is allocated in memory, one after another.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from lightning_accel.offload import L2LExecutor, make_plan
from lightning_accel.offload.materialize import Materialized, materialize, meta_names, settle
from lightning_accel.offload.plan import OffloadPlan
from lightning_accel.patching import swapped


def materialize_meta(model: nn.Module, blocks: object, prefetch_blocks: int, offload_resident: bool, nvme_path: str | None,
                     owner: str, supported: bool = True) -> Materialized | None:
    """``model``'s meta tensors given real ones (None: it had none). ``supported``: the strategy materializes meta
    models (both L2L strategies do; another that mixes in the hooks without saying so is refused in one line)."""
    names = meta_names(model)
    if not names:
        return None
    if not supported:
        raise ValueError(f"{owner} does not materialize a model built on the meta device (parameter {names[0]}); build it "
                         "on the CPU in configure_model, or train it with strategy='l2l_offload'")
    try:
        plan: OffloadPlan = make_plan(model, blocks, prefetch_blocks, offload_resident)  # type: ignore[arg-type]
    except ValueError as err:
        raise ValueError(f"{owner}: {err}") from None
    units = [*plan.blocks, plan.resident]
    unit_of = {id(p): i for i, u in enumerate(units) for _, p in u.params}
    unit_of.update({id(m._buffers[n]): i for i, u in enumerate(units) for m, n, _ in u.buffers})
    on_disk = list(range(len(plan.blocks))) + ([len(plan.blocks)] if offload_resident else [])
    return materialize(model, unit_of, on_disk, nvme_path, owner)


def settle_in_memory(done: Materialized | None, executor: L2LExecutor | None, fitting: bool) -> None:
    """After the tier's set-up for a fit: the staged parameters it did not take to its files move into memory. (Without
    a fit nothing is written: validation or prediction computes on the staged weights through their maps.)"""
    if done is None or done.staging is None or executor is None:
        return
    if fitting:
        store = executor.store
        moved = settle(list(executor.model.parameters()), store.master, store.shadow, done.staging, pin=False)  # (nothing the store holds is pinned)
        if moved:
            done.in_memory_bytes += moved
            executor.baseline()
    done.staging.close()  # (its address ranges say nothing once its maps may be reused)
    done.staging = None


@contextmanager
def kept_on_meta(module: nn.Module | None) -> Iterator[None]:
    """Around the base strategy's teardown, which moves the module to the CPU: a module still on meta (refused before
    it was materialized) stays there, so the refusal is what the user sees, not "Cannot copy out of meta tensor"."""
    if module is None or not meta_names(module):
        yield
        return
    with swapped(module, "cpu", lambda: module):
        yield
