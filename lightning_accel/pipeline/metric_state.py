"""A torchmetrics ``Metric`` and a logged value, carried to another rank.

The pipeline's last rank runs the user's step and logs; the other ranks log what it
logged, so rank 0 (the loggers, the progress bar) and every rank's callbacks see the same.
A number travels as a CPU tensor; a ``Metric`` as its accumulated state, so the receiving
rank holds the same metric and computes the same value without syncing. No Lightning here.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_accel.pipeline.microbatch import map_tensors

__all__ = ["load_metric_state", "loggable", "metric_state", "metrics_over_replicas", "restore_metric_sync"]


def metric_state(metric: Metric) -> dict[str, Any]:
    """A metric's accumulated state, on the CPU: what another rank needs to compute the same value."""
    state = {n: map_tensors(getattr(metric, n), lambda t: t.detach().cpu()) for n in metric._defaults}
    return {"state": state, "updates": metric._update_count}


def load_metric_state(metric: Metric, saved: dict[str, Any], device: torch.device) -> None:
    """Give ``metric`` the state :func:`metric_state` took from another rank's."""
    for name, value in saved["state"].items():
        setattr(metric, name, map_tensors(value, lambda t: t.to(device)))
    metric._update_count, metric._computed = saved["updates"], None


def loggable(value: Any) -> Any:
    """What one ``self.log`` value is worth on another rank: a CPU tensor (a metric: its value on this micro-batch)."""
    if isinstance(value, Metric):
        cache = value._forward_cache
        value = cache if cache is not None else value.compute()
    return value.detach().cpu() if isinstance(value, Tensor) else value


def metrics_over_replicas(module: nn.Module, dp_group: Any, dp_size: int, saved: dict[int, tuple[bool, Any]]) -> None:
    """A pipeline's ranks hold the same metric state (sent on every step): each ``Metric`` of ``module`` syncs over the
    replicas only (``dp_group``), or not at all with one replica. ``saved`` keeps what the user had set, per metric
    id (the first time a metric is seen), for :func:`restore_metric_sync`."""
    for m in module.modules():
        if isinstance(m, Metric):
            saved.setdefault(id(m), (m.sync_on_compute, m.process_group))
            if dp_size == 1:
                m.sync_on_compute = False
            else:
                m.process_group = dp_group


def restore_metric_sync(module: nn.Module, saved: dict[int, tuple[bool, Any]]) -> None:
    """Give each metric back the sync settings :func:`metrics_over_replicas` found."""
    for m in module.modules():
        if isinstance(m, Metric) and id(m) in saved:
            m.sync_on_compute, m.process_group = saved[id(m)]
