"""GPipe mechanism: micro-batches, partition into stages, schedules, executors and timelines.

No Lightning here: :class:`lightning_accel.strategies.GPipeStrategy` decides the policy
once and hands these functions plain data.
"""

from lightning_accel.pipeline.batchnorm import DeferredBatchNorm
from lightning_accel.pipeline.boundaries import StageBoundaries
from lightning_accel.pipeline.distributed import RankPipeline, StageModule, stage_indices
from lightning_accel.pipeline.local import CHECKPOINT_MODES, LocalPipeline, checkpoint_stop
from lightning_accel.pipeline.microbatch import batch_size, gather, scatter
from lightning_accel.pipeline.options import PipelineOptions
from lightning_accel.pipeline.partition import balance_by_cost, block_bytes, check_balance, profile_block_times
from lightning_accel.pipeline.reduction import reduce_outputs
from lightning_accel.pipeline.schedule import (
    SCHEDULE_TABLE,
    bubble_fraction,
    check_schedule,
    clock_cycles,
    gpipe_order,
    ideal_speedup,
    one_f_one_b_order,
    simulate,
)
from lightning_accel.pipeline.timeline import Event, measured_bubble, stage_orders, to_chrome_trace, to_svg

__all__ = [
    "CHECKPOINT_MODES",
    "DeferredBatchNorm",
    "Event",
    "LocalPipeline",
    "PipelineOptions",
    "RankPipeline",
    "SCHEDULE_TABLE",
    "StageBoundaries",
    "StageModule",
    "balance_by_cost",
    "batch_size",
    "block_bytes",
    "bubble_fraction",
    "check_balance",
    "check_schedule",
    "checkpoint_stop",
    "clock_cycles",
    "gather",
    "gpipe_order",
    "ideal_speedup",
    "measured_bubble",
    "one_f_one_b_order",
    "profile_block_times",
    "reduce_outputs",
    "scatter",
    "simulate",
    "stage_indices",
    "stage_orders",
    "to_chrome_trace",
    "to_svg",
]
