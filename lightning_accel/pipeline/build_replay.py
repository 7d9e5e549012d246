"""The user's own build of a network, run again on real storage: starting weights equal to their seeded construction.

Why: a network built on the ``meta`` device (so that no rank ever holds all of it) has no values; materializing it part by
part (:func:`lightning_accel.pipeline.deferred_init.materialize`) gives values from per-module seeds, which do not equal
what the user's code draws when it builds the network for real (``torch.manual_seed(0); Net()`` draws every tensor from
one random stream, in construction order; plain Lightning and DDP build it that way). Where the whole network fits in
memory, :class:`BuildReplay` runs the user's build hook once more, on a copy of the module as it was before the hook
(its attributes and children then, so an idempotent hook, ``if self.net is None: ...``, builds again), from the random
generators' state the first run started from, under the caller's device and dtype contexts: the copy's tensors are
exactly what a plain build would have made. Each rank takes the values of its own part and drops the copy; a network
too big to hold whole keeps the per-module scheme. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["BuildReplay"]

_TABLES = ("_modules", "_parameters", "_buffers")


class BuildReplay:
    """``module``'s attributes and the random generators' state now, just before its ``hook`` builds the network."""

    def __init__(self, module: nn.Module, hook: str) -> None:
        self.module, self.hook = module, hook
        self.attributes = {k: dict(v) if k in _TABLES else v for k, v in module.__dict__.items()}
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None

    def values(self, context: Callable[[], AbstractContextManager[Any]]) -> dict[str, Tensor]:
        """Every parameter and buffer (non-persistent ones too) by name, as ``hook`` builds them on a copy of the module
        from the saved random state, inside ``context()`` (the device and dtype the build ran under, without ``meta``).
        The random generators are left as they were."""
        replica = type(self.module).__new__(type(self.module))
        replica.__dict__.update({k: dict(v) if k in _TABLES else v for k, v in self.attributes.items()})
        devices = list(range(len(self.cuda_rng))) if self.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu_rng)
            if self.cuda_rng is not None:
                torch.cuda.set_rng_state_all(self.cuda_rng)
            with context():
                getattr(replica, self.hook)()
        return {**dict(replica.named_parameters(remove_duplicate=False)), **dict(replica.named_buffers(remove_duplicate=False))}
