"""What a pipeline step reports (loss, logged values, metrics): taken where the user's step runs, given to every rank.

Where a multi-process pipeline runs the user's step per micro-batch (schedules other than GPipe,
:mod:`~lightning_accel.pipeline.rank_step`), only the last stage's rank runs it to its end, so
only there does its ``self.log`` see the loss and the outputs; rank 0 owns the loggers and
the progress bar, and every rank's callbacks (``ModelCheckpoint(monitor=...)``) must see
the same values. (Under GPipe every rank runs the step once: :mod:`~lightning_accel.pipeline.whole_step`.) No Lightning
here.

- Training: each micro-batch's ``log`` calls are recorded (:class:`MicroBatchLogs`) and
  reduced over the micro-batches like the loss (:func:`reduce_logs`); the step's result
  (loss, logs) crosses the ranks in :func:`broadcast_step_result`, which
  :class:`lightning_accel.strategies.gpipe_distributed.DistributedGPipeStrategy` calls at
  the end of ``training_step``. ``broadcast_object_list`` would pickle the result and
  broadcast twice per step; instead the ranks cache the result's *signature* (names, log
  options, each number's type, dtype and shape), and while it holds a step costs one small
  float64 tensor broadcast. Values are rebuilt bit for bit (float64 holds every float16,
  bfloat16 and float32 value, and integers up to 2**53).
- Evaluation: the last rank's step runs once, on the whole batch, and logs for real;
  :class:`EvalLogs` records those calls as well, broadcasts them with what the step
  returned, and the other ranks log the same. Their own runs of the step (up to their
  stages' end) are silenced.
- Metrics: a number travels as a CPU tensor (:func:`loggable`); a torchmetrics ``Metric``
  as its accumulated state and its path in the module (:func:`metric_state`), so the
  receiving rank holds the same metric and computes the same value without syncing; the
  metrics sync over the replicas only (:func:`metrics_over_replicas`).

Works on any object with a ``log(name, value, ...)`` method (a LightningModule).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torchmetrics import Metric

from lightning_accel.patching import Patch, patch, swapped
from lightning_accel.pipeline.microbatch import map_tensors

__all__ = [
    "EvalLogs",
    "MicroBatchLogs",
    "StepResult",
    "broadcast_step_result",
    "load_metric_state",
    "loggable",
    "metric_state",
    "metrics_over_replicas",
    "number_spec",
    "reduce_logs",
    "silenced",
    "step_signature",
    "unpack_number",
]


# -- a logged value or a Metric, carried to another rank


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


def metrics_over_replicas(dp_group: Any) -> Patch:
    """Every torchmetrics ``Metric`` that syncs without a group of its own (``process_group=None``: the default group,
    every process) syncs over ``dp_group``, the replicas, until the patch is removed: a pipeline's ranks hold the same
    state (each ran the step, or was sent it), so a sync over every rank would count it once per stage (a ``SumMetric``
    ``pp`` times too large). Metrics anywhere: the module's, a callback's, the user's own."""
    import torchmetrics.metric

    gather = torchmetrics.metric.gather_all_tensors

    def over_replicas(result: Tensor, group: Any = None) -> list[Tensor]:
        return gather(result, group=dp_group if group is None else group)

    return patch(torchmetrics.metric, "gather_all_tensors", over_replicas)


# -- the training step's result: logs reduced over micro-batches, then sent from the last rank

# reduce_fx spellings Lightning takes (a name or the torch function) -> how micro-batch values make the batch's
_REDUCE_FX = {"sum": sum, "max": max, "min": min, torch.sum: sum, torch.max: max, torch.min: min}


def reduce_logs(
    records: Sequence[list[tuple[str, Any, dict]]], sizes: Sequence[int], reduction: str,
    losses: Sequence[set[str]] | None = None, constant_sizes: set[str] | None = None,
) -> list[tuple[str, Any, dict]]:
    """One ``(name, value, kwargs)`` per logged name from the micro-batches' ``self.log`` records, the value the whole
    batch would have logged. The step's loss itself (``losses[i]``: the names micro-batch ``i`` logged its loss tensor
    under) is reduced like the loss whatever its ``reduce_fx`` (which then reduces the steps, as Lightning's does: an
    epoch's max of the loss is the largest batch loss). Another number logged with ``reduce_fx="sum"``, ``"max"`` or
    ``"min"`` is the sum, max or min over the micro-batches (a count stays a count, as Lightning's sum over DDP ranks
    keeps it); one logged with the default ``"mean"`` (or a function of the user's) is reduced like the loss (weighted
    by micro-batch ``sizes`` for ``"mean"``, summed for ``"sum"``); anything else is the last micro-batch's. A
    ``batch_size`` given with the micro-batches' sizes becomes the batch's; a constant one stays that constant (a name
    is a constant's from the first step its values are not the sizes on: ``constant_sizes``, kept by the caller across
    steps, so a ragged last batch whose micro-batch size happens to equal it is not taken for sizes)."""
    merged: dict[str, tuple[list[Any], list[int], dict, list[Any], bool]] = {}
    for i, (record, size) in enumerate(zip(records, sizes)):
        for name, value, kwargs in record:
            values, weights, _, given, _ = merged.setdefault(name, ([], [], kwargs, [], True))
            values.append(value)
            weights.append(size)
            given.append(kwargs.get("batch_size"))
            if losses is None or name not in losses[i]:
                merged[name] = (values, weights, kwargs, given, False)
    constant_sizes = set() if constant_sizes is None else constant_sizes
    out = []
    for name, (values, weights, kwargs, given, is_loss) in merged.items():
        if not all(isinstance(v, (int, float, Tensor)) and not isinstance(v, bool) for v in values):
            out.append((name, values[-1], kwargs))  # not a number: the last micro-batch's
            continue
        total = sum(weights)
        fx = kwargs.get("reduce_fx", "mean")
        combine = None if is_loss else _REDUCE_FX.get(fx.lower() if isinstance(fx, str) else fx)
        if combine is not None:
            value = combine(values) if combine is sum else combine(values, key=float)
        else:
            value = sum(v * (w / total) for v, w in zip(values, weights)) if reduction == "mean" else sum(values)
        if "batch_size" in kwargs:
            if any(g != w for g, w in zip(given, weights)):
                constant_sizes.add(name)
            constant = name in constant_sizes and len(set(given)) == 1
            kwargs = {**kwargs, "batch_size": given[0] if constant else total}  # weighs the epoch mean by the batch
        out.append((name, value, kwargs))
    return out


# a step's result: (loss, [(name, value, log kwargs)], whether training_step returned a dict)
StepResult = tuple[Any, list[tuple[str, Any, dict]], bool]
_EXACT_FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16)  # each one a float64 holds exactly
_INTS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_MAX_EXACT_INT = 2**53  # integers up to this size survive a trip through float64


def number_spec(value: Any) -> tuple | None:
    """How ``value`` rides in a float64 tensor and is rebuilt bit for bit (its type, dtype, shape); None if it cannot."""
    if type(value) is float:
        return ("float",)
    if type(value) is int:  # not bool: a bool is not a number here, as in reduce_logs
        return ("int",) if abs(value) <= _MAX_EXACT_INT else None
    if type(value) is Tensor and value.numel() == 1 and value.device.type == "cpu" and not value.requires_grad:
        if value.dtype in _EXACT_FLOATS or (value.dtype in _INTS and abs(int(value)) <= _MAX_EXACT_INT):
            return ("tensor", value.dtype, tuple(value.shape))
    return None


def step_signature(result: StepResult) -> tuple | None:
    """What a step's result shares with the next one's (names, log options, each number's spec): when it is unchanged,
    the numbers alone cross the ranks. None when a value is not a number: then the whole result goes as objects."""
    loss, records, as_dict = result
    specs = [number_spec(loss), *(number_spec(value) for _, value, _ in records)]
    if any(spec is None for spec in specs):
        return None
    return (as_dict, specs[0], tuple((name, spec, kw) for (name, _, kw), spec in zip(records, specs[1:])))


def same_signature(a: tuple | None, b: tuple | None) -> bool:
    if a is None or b is None:
        return False
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001  # log kwargs that do not compare (a tensor option): treat as changed
        return False


def unpack_number(x: float, spec: tuple) -> Any:
    """The value :func:`number_spec` described, from its float64 ``x``: the same type, dtype, shape and bits."""
    if spec[0] == "float":
        return x
    if spec[0] == "int":
        return int(x)
    _, dtype, shape = spec
    return torch.tensor(x if dtype.is_floating_point else int(x), dtype=dtype).reshape(shape)


def broadcast_step_result(
    result: StepResult | None, cached: tuple | None, src: int, group: Any, device: torch.device, extra: Any = None
) -> tuple[StepResult, tuple | None, Any]:
    """The ``src`` rank's step result on every rank of ``group``, the signature every rank caches for the next step, and
    ``extra`` (given on ``src``; what the step appended to the module's lists, :mod:`lightning_accel.pipeline.kept_outputs`).

    Steady state, one small tensor broadcast: float64 ``[changed, loss, numbers...]`` sized from
    ``cached``, the signature every rank holds (on 2 gloo CPU ranks about 0.2 ms a step, against
    0.8 ms for pickling the result and its two broadcasts). When the signature changed
    (first step, a new name or option, a value that is not a number) or there is an ``extra``, ``changed`` is set and
    the result follows through ``broadcast_object_list`` with its signature and the extra. ``result`` is given on
    ``src`` only.
    """
    count = 0 if cached is None else len(cached[2])
    signature = None
    if result is not None:
        signature = step_signature(result)
        if same_signature(signature, cached) and not extra:
            loss, records, _ = result
            numbers = torch.tensor([0.0, float(loss), *(float(v) for _, v, _ in records)], dtype=torch.float64, device=device)
        else:
            numbers = torch.zeros(2 + count, dtype=torch.float64, device=device)
            numbers[0] = 1.0
    else:
        numbers = torch.empty(2 + count, dtype=torch.float64, device=device)
    dist.broadcast(numbers, src=src, group=group)
    values = numbers.tolist()
    if values[0] == 0.0:
        if result is not None:
            return result, cached, None
        assert cached is not None
        as_dict, loss_spec, entries = cached
        records = [(name, unpack_number(x, spec), kw) for (name, spec, kw), x in zip(entries, values[2:])]
        return (unpack_number(values[1], loss_spec), records, as_dict), cached, None
    payload: list[Any] = [result, signature, extra]
    dist.broadcast_object_list(payload, src=src, group=group)
    return payload[0], payload[1], payload[2]


# -- the log calls: recorded per micro-batch (training), logged and replayed (evaluation)


def silenced(module: Any) -> AbstractContextManager[None]:
    """``module.log`` does nothing inside the block (a rank's partial run of the step logs nothing)."""
    return swapped(module, "log", lambda *_, **__: None)


class MicroBatchLogs:
    """The ``log`` calls of a training step, one list per micro-batch, each value made :func:`loggable`, and which of
    them logged the micro-batch's loss itself (:meth:`mark_loss`)."""

    def __init__(self, chunks: int) -> None:
        self.records: list[list[tuple[str, Any, dict]]] = [[] for _ in range(chunks)]
        self.losses: list[set[str]] = [set() for _ in range(chunks)]
        self._raw: list[list[tuple[str, Any]]] = [[] for _ in range(chunks)]  # this micro-batch's logged tensors, until its loss is known

    def recording(self, module: Any, i: int) -> AbstractContextManager[None]:
        """``module.log`` records into micro-batch ``i``'s list inside the block."""
        self.records[i], self.losses[i], self._raw[i] = [], set(), []  # should torch run a micro-batch's loss twice, keep the last
        records, raw = self.records[i], self._raw[i]

        def log(name: str, value: Any, *_: Any, **kw: Any) -> None:
            records.append((name, loggable(value), kw))
            if isinstance(value, Tensor):
                raw.append((name, value))

        return swapped(module, "log", log)

    def mark_loss(self, i: int, loss: Any) -> None:
        """Micro-batch ``i``'s step returned ``loss``: the names it logged that very tensor under (or a detached view of
        it) are the loss's (:func:`reduce_logs`)."""
        raw, self._raw[i] = self._raw[i], []
        if isinstance(loss, Tensor) and not loss.is_meta:
            self.losses[i] = {n for n, v in raw if v is loss or (
                not v.is_meta and v.device == loss.device and v.data_ptr() == loss.data_ptr() and v.shape == loss.shape)}

    def reduced(self, sizes: Sequence[int], reduction: str, constant_sizes: set[str] | None = None) -> list[tuple[str, Any, dict]]:
        """Each name's values over the micro-batches, reduced as :func:`reduce_logs` says."""
        return reduce_logs(self.records, sizes, reduction, self.losses, constant_sizes)


class EvalLogs:
    """The ``log`` calls of ``hook`` (an evaluation step) on ``module``: logged for real and recorded, to send on."""

    def __init__(self, module: nn.Module, hook: str) -> None:
        self.module, self.hook = module, hook
        self.records: list[tuple[str, Any, tuple, dict]] = []
        self._paths = {id(m): n for n, m in module.named_modules()}
        self._log = module.log  # type: ignore[operator]  # the real one, bound before any swap

    def recording(self) -> AbstractContextManager[None]:
        return swapped(self.module, "log", self._record)

    def _record(self, name: str, value: Any, *a: Any, **kw: Any) -> None:
        self._log(name, value, *a, **kw)
        if isinstance(value, Metric):
            if id(value) not in self._paths:
                raise ValueError(
                    f"{self.hook} logged {name!r}, a Metric that is not a submodule of the LightningModule; the "
                    "pipeline's other ranks cannot log the same one; assign it as an attribute in __init__"
                )
            self.records.append((name, ("metric", self._paths[id(value)], metric_state(value)), a, kw))
        else:
            self.records.append((name, loggable(value), a, kw))

    def exchange(self, output: Any, src: int, group: Any, kept: Any = None) -> tuple[list[tuple[str, Any, tuple, dict]], Any, Any]:
        """Every rank of the pipeline calls it: ``src`` (the last stage's global rank) sends its records, ``output``
        (what the step returned, on the CPU, or None) and ``kept`` (what the step appended to the module's lists:
        :mod:`lightning_accel.pipeline.kept_outputs`); returns what ``src`` sent."""
        payload: list[Any] = [self.records, output, kept]
        dist.broadcast_object_list(payload, src=src, group=group)
        return payload[0], payload[1], payload[2]

    @staticmethod
    def replay(module: nn.Module, records: Sequence[tuple[str, Any, tuple, dict]], device: torch.device) -> None:
        """Log on ``module`` what another rank's :class:`EvalLogs` recorded (a metric: its state loaded, then itself)."""
        for name, value, a, kw in records:
            if isinstance(value, tuple) and value[:1] == ("metric",):
                metric = module.get_submodule(value[1])
                load_metric_state(metric, value[2], device)  # type: ignore[arg-type]
                value = metric
            elif isinstance(value, Tensor):
                value = value.to(device)
            module.log(name, value, *a, **kw)  # type: ignore[operator]
