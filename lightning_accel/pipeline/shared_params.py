"""What lies outside the blocks on every rank of a pipeline: who steps each of its parameters, and who keeps it current.

Embeddings, a final norm, a head, the LightningModule's own tensors are held by every rank, but only the ranks whose
part of the forward uses a parameter get its gradient and step it: an untied embedding on the first stage's rank, the
final norm and head on the last's. A parameter two ranks use (a tied embedding and head) has its gradients summed
between those ranks, as Megatron all-reduces the embedding its first and last stage share (:meth:`SharedParams.sum_gradients`).

Who uses a parameter is observed, not guessed: after a step's backward a rank holds a gradient of exactly the
parameters its stages' part of the forward used (a later rank recomputes the embedding, but the stage boundary replaces
its output, so no gradient reaches it; the first rank stops before the head). Each parameter's users are fixed at the
first step that gives it a gradient (one small all-gather a step), its first user's value is the one that counts
(:attr:`SharedParams.owner`, what checkpoints take), and a later step in which another rank uses it is refused: that
rank's copy and optimizer state would be stale.

A rank that does not step a parameter holds a stale copy. Where the user's step reads one after the model's call on
such a rank (the head of a transformers ``...ForCausalLM``, outside the module whose call is pipelined), the copy is
made current first (:meth:`SharedParams.freshen`): each rank runs the whole step, and its loss and logs must be the
last rank's. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from lightning_accel.pipeline.gradients import gradient_presence, sum_over_users

__all__ = ["SharedParams"]


class SharedParams:
    """``params`` (outside every block, in one order all ranks share) of ``net`` on pipeline rank ``rank`` of ``group``;
    ``to_global(r)``: pipeline rank ``r``'s global rank."""

    def __init__(
        self, net: nn.Module, params: Sequence[nn.Parameter], rank: int, group: dist.ProcessGroup | None,
        to_global: Callable[[int], int],
    ) -> None:
        self.net, self.params, self.rank, self.group, self.to_global = net, list(params), rank, group, to_global
        # per parameter: the pipeline ranks whose part of the forward used it (gave it a gradient), set at the first step
        # that gives it one; () until then
        self.users: list[tuple[int, ...]] = [() for _ in self.params]
        self.owner: dict[int, int] = {}  # id -> the rank whose value counts (its first user), once known
        self.summed_bytes = 0  # gradient bytes this rank put into sums at the last step

    def sum_gradients(self) -> None:
        """Sum the gradients of each parameter between the ranks that used it, and only those (see the module
        docstring); a collective over the pipeline's ranks."""
        if not self.params:
            return
        present = gradient_presence(self.params, self.group)
        now: list[tuple[int, ...]] = []
        for i, p in enumerate(self.params):
            used = tuple(r for r in range(len(present)) if present[r][i])
            if used and not self.users[i]:
                self.users[i] = used
                self.owner[id(p)] = used[0]
            elif not set(used) <= set(self.users[i]):
                name = next((n for n, q in self.net.named_parameters(remove_duplicate=False) if q is p), "a parameter")
                raise RuntimeError(
                    f"{name} got a gradient on pipeline rank(s) {sorted(set(used) - set(self.users[i]))}, which did not "
                    f"use it at its first step (used by {list(self.users[i])}); the pipeline steps a parameter outside the "
                    "blocks only on the ranks that used it first; use it in the same stages at every step, or "
                    "freeze it (requires_grad=False)"
                )
            now.append(self.users[i] if used else ())  # nobody used it this step: it keeps no gradient
        self.summed_bytes = sum_over_users(self.params, now, self.rank, self.group)

    @torch.no_grad()
    def freshen(self, wanted: set[int], ranks: int) -> None:
        """Give every rank of the pipeline (``ranks`` of them) the current value of each parameter whose id is in
        ``wanted`` and that some rank does not step: its owner's; a collective (every rank passes the same ``wanted``)."""
        for i, p in enumerate(self.params):
            users = self.users[i]
            if id(p) not in wanted or not p.requires_grad or not users or len(users) == ranks:
                continue  # the same on every rank: never stepped, not yet (the starting values agree), or by everyone
            dist.broadcast(p.data, src=self.to_global(users[0]), group=self.group)
