"""Stepping element ranges of parameters as parameters of their own: the optimizer's rule on one chunk of a unit.

The NVMe tier steps a unit chunk by chunk (:mod:`.tier_chunks`), and a chunk may hold part of a parameter.
The optimizers the tier takes (:data:`~.host_optimizer.PER_PARAMETER`) update each element from that element's
gradient and state and the parameter's scalars (``step``, NAdam's ``mu_product``), so a range steps on its own:
for the call, each range becomes a *slice*, a parameter of its own whose data is the range of the master (in
the step buffer, or in memory), whose gradient is the range of the gradient buffer, and whose per-element state
is the range of each state tensor; its scalars are copies of the parameter's. The optimizer's own ``step()`` runs
on the slices (its hyper-parameters, hooks, fused kernel and the shadow fold as for a whole unit: the caller's
:data:`~.tier.UnitStep`), with the param groups and the state table pointing at them for the call only.

A parameter's scalars change once per step: each slice starts from the parameter's as they were before the step
(:meth:`SlicedStep.run` leaves the parameter's own state alone), and :meth:`SlicedStep.finish`, once every range
of the unit stepped, gives the parameter the scalars its slices ended with (all equal) and its per-element state
as the caller keeps it (the file's views). State a first step creates in a slice's call is copied into the range
it belongs to. Nothing here imports Lightning.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

# a unit's update: (its parameters with gradients, their shadows, their bf16 gradients) -> parameters whose shadows it wrote
UnitStep = Callable[[list[nn.Parameter], dict[nn.Parameter, Tensor], dict[nn.Parameter, Tensor]], list[Tensor]]


@dataclass
class Slice:
    """Elements ``start:stop`` of ``param``: where its master's range is (``master``, 1-D), each per-element state key's
    range (``state``), its shadow's range (None: the master is what the device computes on), and its gradient where
    it is not ``param.grad`` (a parameter the compute still holds: its ``.grad`` takes only the compute's dtype)."""

    param: nn.Parameter
    start: int
    stop: int
    master: Tensor
    state: dict[str, Tensor]
    shadow: Tensor | None = None
    grad: Tensor | None = None  # the parameter's whole gradient (None: ``param.grad``)


class SlicedStep:
    """One unit's step, a chunk of slices at a time (:meth:`run`), then :meth:`finish`."""

    def __init__(self, optimizer: Optimizer, step: UnitStep) -> None:
        self.optimizer = optimizer
        self.step = step
        # a parameter -> its first slice's state after its call, and which of its keys are per-element
        self._after: dict[nn.Parameter, tuple[dict[str, Any], set[str]]] = {}

    def run(self, slices: list[Slice], low_grads: dict[nn.Parameter, Tensor]) -> None:
        """Step ``slices`` in one call of the caller's step; their shadows are written (by the fold, else here)."""
        optimizer = self.optimizer
        group_of = {id(p): n for n, g in enumerate(optimizer.param_groups) for p in g["params"]}
        pieces: list[nn.Parameter] = []
        shadows: dict[nn.Parameter, Tensor] = {}
        lows: dict[nn.Parameter, Tensor] = {}
        groups: dict[int, list[nn.Parameter]] = {}
        of: dict[nn.Parameter, Slice] = {}
        try:
            for part in slices:
                if id(part.param) not in group_of:  # (a parameter the optimizer was not given: it does not step it)
                    if part.shadow is not None:
                        part.shadow.copy_(part.master)
                    continue
                grad = part.grad if part.grad is not None else part.param.grad
                assert grad is not None, "a slice of a parameter without a gradient"
                piece = nn.Parameter(part.master, requires_grad=True)
                piece.grad = grad.view(-1)[part.start:part.stop]
                held = optimizer.state.get(part.param)
                if held:  # the parameter's state as it was before this step: ranges of the per-element, copies of the rest
                    optimizer.state[piece] = {k: part.state[k] if k in part.state else _copy(v) for k, v in held.items()}
                if part.shadow is not None:
                    shadows[piece] = part.shadow
                low = low_grads.get(part.param)
                if low is not None:
                    lows[piece] = low.view(-1)[part.start:part.stop]
                groups.setdefault(group_of[id(part.param)], []).append(piece)
                pieces.append(piece)
                of[piece] = part
            if not pieces:
                return
            saved = optimizer.param_groups
            optimizer.param_groups = [{**saved[n], "params": params} for n, params in sorted(groups.items())]
            try:
                written = {id(p) for p in self.step(pieces, shadows, lows)}
            finally:
                optimizer.param_groups = saved
            for piece, part in of.items():
                made = optimizer.state[piece] if piece in optimizer.state else None
                for key, view in part.state.items():  # state a first step made in memory moves into its range
                    value = made.get(key) if made is not None else None
                    if isinstance(value, Tensor) and value.data_ptr() != view.data_ptr():
                        view.copy_(value.view(-1))
                if part.shadow is not None and id(piece) not in written:
                    part.shadow.copy_(part.master)
                if made is not None:  # (an optimizer that keeps no state for it, SGD without momentum, made none)
                    self._after.setdefault(part.param, (made, set(part.state)))
        finally:
            for piece in pieces:
                optimizer.state.pop(piece, None)

    def finish(self, per_element: Callable[[nn.Parameter, str], Tensor]) -> None:
        """Every range stepped: each parameter's state becomes its slices' scalars and, for its per-element keys,
        ``per_element(param, key)`` (where the caller keeps that tensor whole), in the order the optimizer made them."""
        for param, (made, keys) in self._after.items():
            self.optimizer.state[param] = {k: per_element(param, k) if k in keys else v for k, v in made.items()}
        self._after.clear()


def _copy(value: Any) -> Any:
    return value.clone() if isinstance(value, Tensor) else value
