"""The balance of a multi-process pipeline (blocks per stage), decided once and the same on every rank.

A list is taken as given; ``"by_size"`` splits by parameter and buffer bytes; ``"by_time"``
by forward + backward seconds of each block (:func:`lightning_accel.pipeline.partition.balance_by_cost`
over :func:`lightning_accel.pipeline.partition.profile_block_times`). Why global rank 0
alone measures and broadcasts (:func:`agreed_block_times`): timings differ between ranks
(and between runs), and every rank of every replica must split the same; a failure there is
raised on every rank, not left to a neighbour's timeout. A network built on the ``meta``
device (each rank materializes only its part) has no whole model to time: ``"by_time"`` is
refused there. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch.distributed as dist
from torch import nn

from lightning_accel.pipeline.partition import balance_by_cost, block_bytes, profile_block_times

__all__ = ["agreed_block_times", "choose_balance", "example_block_times", "example_forward"]


def example_forward(module: nn.Module, example: Any) -> Callable[[], object]:
    """``module(example)`` as Lightning runs ``example_input_array`` (ModelSummary, ``to_onnx``): a tuple or dict unpacked."""
    if isinstance(example, (list, tuple)):
        return lambda: module(*example)
    if isinstance(example, Mapping):
        return lambda: module(**example)
    return lambda: module(example)


def example_block_times(
    module: nn.Module, net: nn.Module, blocks: Sequence[nn.Module], device: Any, convert: Callable[[Any], Any],
    context: Callable[[], AbstractContextManager[Any]],
) -> tuple[Callable[[], None], Callable[[], list[float]]]:
    """The check and the measurement ``choose_balance`` takes for ``"by_time"`` on ``module.example_input_array``
    (``convert``-ed, run under ``context()``, as training runs): each block of ``net`` timed on ``device``."""

    def check() -> None:
        if getattr(module, "example_input_array", None) is None:
            raise ValueError(
                f"balance='by_time' times each block before the first batch, on {type(module).__name__}."
                "example_input_array, which is None; set self.example_input_array to one batch's input to "
                "forward in __init__, or pass balance as a list (blocks per stage) or 'by_size'"
            )

    def measure() -> list[float]:
        with context():  # autocast as in training: training's times
            forward = example_forward(module, convert(module.example_input_array))
            return profile_block_times(net, blocks, forward, device=device)

    return check, measure


def agreed_block_times(measure: Callable[[], list[float]]) -> list[float]:
    """Global rank 0 runs ``measure`` (seconds per block); every rank gets its list. Every rank calls it."""
    payload: list[Any] = [None, None]  # times, or the error rank 0 hit
    failure: Exception | None = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            payload[0] = measure()
        except Exception as err:  # noqa: BLE001  # raised below, once every rank knows
            failure, payload[1] = err, f"{type(err).__name__}: {err}"
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(payload, src=0)
    if failure is not None:
        raise failure
    if payload[1] is not None:
        raise RuntimeError(f"balance='by_time': timing the blocks failed on rank 0 ({payload[1]}); its log has the traceback")
    return payload[0]


def choose_balance(
    policy: Sequence[int] | str,
    blocks: Sequence[nn.Module],
    stages: int,
    ranks: int,
    model_name: str,
    measure: Callable[[], list[float]],
    on_meta: bool = False,
    check: Callable[[], None] | None = None,
) -> tuple[list[int], list[float] | None]:
    """Blocks per stage under ``policy`` for ``stages`` stages on ``ranks`` ranks per pipeline, and the block times
    ``"by_time"`` measured (``measure``, through :func:`agreed_block_times`; None otherwise). ``on_meta``: the
    network is built on the ``meta`` device, so ``"by_time"`` is refused. ``check``: run on every rank before
    measuring (a refusal every rank raises before any waits for another)."""
    if not isinstance(policy, str):
        return list(policy), None
    if stages > len(blocks):
        raise ValueError(
            f"{ranks} ranks per pipeline run {stages} stages but {model_name} has "
            f"{len(blocks)} blocks; use at most {len(blocks)} stages (trainer devices)"
        )
    if policy == "by_time" and stages > 1 and on_meta:
        raise ValueError(
            f"balance='by_time' times every block of {model_name} on rank 0, but a network built in "
            "configure_model is only materialized in part on each rank; use balance='by_size' or a list (blocks "
            "per stage), or DistributedGPipeStrategy(deferred_init=False) to build it whole on every rank"
        )
    if policy == "by_size" or stages == 1:  # by_time with one stage: nothing to measure
        return balance_by_cost(block_bytes(blocks), stages), None
    if check is not None:
        check()
    times = agreed_block_times(measure)
    return balance_by_cost(times, stages), times
