"""A pipeline step in which a stage raised: the schedule runs on to its end on stand-ins, then every rank raises.

Why not leave the schedule at the error: torch's schedules wait in point-to-point receives that cannot be polled or
given up on (gloo's ``wait(timeout)`` closes the connection), so a rank that leaves its schedule leaves its neighbours
waiting for activations or gradients that never come, until the process group's timeout (30 minutes by default), and a
group with unmatched sends is no use afterwards (Lightning's ``on_exception`` and teardown, gathering the module). So the
raising stage keeps its place: from the error on, every forward of this rank returns zeros shaped as the stage's
outputs (:func:`stand_in`) and every backward returns no gradients (torch sends zeros), without running the user's code
again; the error is published in the process group's store at once (:meth:`StepFailure.record`), so the other ranks
stop running the user's code as soon as they look (:meth:`StepFailure.stopped`, before each forward and backward), and
after the schedule one flag is reduced over the pipeline (:meth:`StepFailure.settle`): every rank learns that the step
failed, even one whose last action needed nothing from the raising rank. The raising rank raises its error as itself
(its type, its message first, then the rank and stage); the others raise a copy of it (the same type and message,
unpickled from the store), or, where it cannot be copied, one line naming the rank and what it raised. No Lightning here.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["StepFailure", "default_store", "stand_in"]

_OWN = object()  # settle's group: the one given at construction


def default_store() -> Any:
    """The default process group's key-value store, if any."""
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001  # no default group, or a torch without it: the neighbours are named instead
        return None


def stand_in(metas: Sequence[Any] | None, device: torch.device) -> Tensor | tuple[Tensor, ...]:
    """Zeros shaped as a stage's outputs (torch's output metadata: ``shape``, ``dtype``, ``requires_grad``), what a failed
    stage sends on; before the metadata is known (the shape inference of the first step), one zero, the same on every
    rank that failed there, so the shapes torch infers agree."""
    if not metas:
        return torch.zeros(1, device=device, requires_grad=True)
    out = tuple(torch.zeros(m.shape, dtype=m.dtype, device=device).requires_grad_(bool(m.requires_grad)) for m in metas)
    return out[0] if len(out) == 1 else out


class StepFailure:
    """The first error a stage of this rank raised in the current step, and whether a peer raised one.

    ``key``: the store key of this pipeline's ranks (each step's is under it); ``rank``: this rank's global rank;
    ``group``: the ranks :meth:`settle` tells (the pipeline's, or every replica's; ``None``: every rank); ``device``:
    where the flag tensor of :meth:`settle` lives.
    """

    def __init__(self, key: str, rank: int, group: Any, device: torch.device) -> None:
        self.prefix, self.rank, self.group, self.device = key, rank, group, device
        self.steps = 0  # every rank of the pipeline counts the same steps: a key per step, none read stale
        self.error: BaseException | None = None
        self.stage = -1
        self.in_backward = False  # where the step's error (this rank's or a peer's) was raised
        self.settled = False  # the step failed and every rank of the pipeline knows it (settle): they all raise
        self._peer = False

    @property
    def key(self) -> str:
        return f"{self.prefix}/{self.steps}"

    def start(self) -> None:
        """A new step: nothing raised yet."""
        self.steps += 1
        self.error, self.stage, self.in_backward, self.settled, self._peer = None, -1, False, False, False

    def record(self, err: BaseException, stage: int, backward: bool) -> None:
        """Keep ``err``, raised by ``stage``'s forward or backward, if it is this step's first here: its message gets the
        rank and stage, and the pipeline's other ranks can read it in the store."""
        if self.error is not None:
            return
        where = f"raised by pipeline stage {stage} on rank {self.rank}"
        if err.args and isinstance(err.args[0], str):
            err.args = (f"{err.args[0]} ({where})", *err.args[1:])
        else:
            err.add_note(where)
        self.error, self.stage, self.in_backward = err, stage, backward
        store = default_store()
        if store is None:
            return
        first_line = (str(err).splitlines() or [""])[0]
        try:
            copy: bytes | None = pickle.dumps(err)
            pickle.loads(copy)  # a type the peers could not rebuild (a required keyword argument) is told as a line
        except Exception:  # noqa: BLE001
            copy = None
        line = f"rank {self.rank} (stage {stage}) raised {type(err).__name__}: {first_line}"
        store.set(self.key, pickle.dumps({"line": line, "error": copy, "backward": backward}))

    def stopped(self) -> bool:
        """Whether this step has failed, here or (as far as the store says yet) on another rank of the pipeline."""
        if self.error is not None or self._peer:
            return True
        store = default_store()
        try:
            self._peer = store is not None and store.check([self.key])
        except Exception:  # noqa: BLE001  # the store went with a failed rank: the exchange itself will fail
            return False
        return self._peer

    def settle(self, group: Any = _OWN) -> BaseException | None:
        """After the schedule, on every rank of the pipeline: the error this step ends with (this rank's own, else a copy
        of a peer's), or None; a collective over ``group`` (default: the one given at construction)."""
        group = self.group if group is _OWN else group
        flag = torch.tensor([1 if self.error is not None else 0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        if not int(flag.item()):
            return None
        err = self.error if self.error is not None else self._peer_copy()
        flag.zero_()
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)  # every rank has read it: the next step starts clean
        if self.error is not None:
            store = default_store()
            if store is not None:
                store.delete_key(self.key)
        self.settled = True
        return err

    def _peer_copy(self) -> BaseException:
        said = peer_said(self.key)
        if said is None:  # the flag came from a rank of another pipeline (a data-parallel replica)
            return RuntimeError(f"pipeline step stopped on rank {self.rank}: a rank of another pipeline replica raised; its "
                                "log has the traceback")
        self.in_backward = bool(said.get("backward"))
        if said.get("error") is not None:
            return pickle.loads(said["error"])
        return RuntimeError(f"pipeline step stopped on rank {self.rank}: {said['line']}; its log has the traceback")


def peer_said(key: str, wait: float = 0.0) -> dict[str, Any] | None:
    """What a rank of the pipeline published under ``key`` (:meth:`StepFailure.record`), waiting up to ``wait`` seconds."""
    store = default_store()
    if store is None:
        return None
    deadline = time.monotonic() + wait
    while True:
        try:
            if store.check([key]):
                return pickle.loads(store.get(key))
        except Exception:  # noqa: BLE001  # the store went with the failed rank: nothing to read
            return None
        if time.monotonic() > deadline:
            return None
        time.sleep(0.05)
