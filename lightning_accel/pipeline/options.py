"""The options both GPipe strategies share, validated once: chunks, balance, checkpoint, loss_reduction.

``GPipeStrategy`` (stages on one process's devices) and ``DistributedGPipeStrategy`` (a stage
per process) take the same four settings with the same meaning; one frozen object checks them
when the strategy is built (before any process starts or any work is done) and hands the
mechanism plain, valid data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Union

from lightning_accel.pipeline.local import CHECKPOINT_MODES, checkpoint_stop
from lightning_accel.pipeline.reduction import REDUCTIONS

__all__ = ["BALANCE_MODES", "PipelineOptions", "ReadsPipelineOptions"]

BALANCE_MODES = ("by_size", "by_time")


@dataclass(frozen=True)
class PipelineOptions:
    """``chunks``: micro-batches per batch (M). ``balance``: blocks per stage (a list), ``"by_size"`` (parameter and
    buffer bytes) or ``"by_time"`` (measured forward + backward seconds). ``checkpoint``: which micro-batches
    re-materialize their activations in backward (``"always"``, ``"except_last"``, ``"never"``). ``loss_reduction``:
    how the loss reduces over samples (``"mean"``: gradients scaled by 1/M; ``"sum"``)."""

    chunks: int = 1
    balance: Union[tuple[int, ...], str] = "by_size"
    checkpoint: str = "except_last"
    loss_reduction: str = "mean"

    def __post_init__(self) -> None:
        chunks, balance = self.chunks, self.balance
        if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
            raise ValueError(f"chunks must be a positive int (micro-batches per batch), got {chunks!r}; e.g. chunks=4")
        if self.checkpoint not in CHECKPOINT_MODES:
            raise ValueError(
                f"checkpoint must be one of {', '.join(CHECKPOINT_MODES)}, got {self.checkpoint!r}; 'always' keeps only "
                "each stage's input per micro-batch and recomputes the rest in backward (the least memory), 'never' is "
                "the fastest"
            )
        if self.loss_reduction not in REDUCTIONS:
            raise ValueError(
                f"loss_reduction must be 'mean' or 'sum' (how your loss reduces over samples), got {self.loss_reduction!r}"
            )
        if isinstance(balance, str):
            if balance not in BALANCE_MODES:
                raise ValueError(
                    f"balance must be a list of blocks per stage, 'by_size' or 'by_time', got {balance!r}; 'by_time' "
                    "times each block on a sample, 'by_size' counts its bytes"
                )
        elif not isinstance(balance, Sequence) or not balance or any(
            not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in balance
        ):
            raise ValueError(f"balance must be a non-empty list of positive ints (blocks per stage), got {balance!r}")
        else:
            object.__setattr__(self, "balance", tuple(balance))

    @property
    def checkpoint_stop(self) -> int:
        """Micro-batches with an index below this are re-materialized."""
        return checkpoint_stop(self.checkpoint, self.chunks)

    @property
    def scale_grads(self) -> bool:
        """Whether each micro-batch's gradients are divided by ``chunks`` (a mean loss)."""
        return self.loss_reduction == "mean"

    def check_batch_size(
        self, batch_size: int, schedule: str = "gpipe", stages: int = 1, owner: str = "DistributedGPipeStrategy",
        what: str = "batch_size",
    ) -> int:
        """The equal micro-batches a training batch of ``batch_size`` runs in (:func:`lightning_accel.pipeline.schedule.equal_microbatches`);
        refuses a size that no count ``schedule`` runs on ``stages`` stages divides. ``what``: the batch named in the
        error (``"batch_size"``, ``"last batch"``: whose fix is ``drop_last=True``). The strategy runs it on its
        training loaders before the first step; a launcher's preflight can run the same check on the configured
        batch size before any process starts."""
        from lightning_accel.pipeline.schedule import equal_microbatches  # schedule imports torch's pipelining

        count = equal_microbatches(batch_size, self.chunks, schedule, stages)
        if count is None:
            sizes = range(batch_size + 1, batch_size + 2 * stages + 2)
            least = next((b for b in sizes if equal_microbatches(b, self.chunks, schedule, stages)), stages)
            fix = "drop_last=True on the DataLoader" if what == "last batch" else f"a batch_size of at least {least}"
            raise ValueError(
                f"{owner}(chunks={self.chunks}, schedule={schedule!r}): the training DataLoader's {what} of {batch_size} "
                f"cannot be split into equal micro-batches that {schedule!r} runs on {stages} stages (it needs at least "
                f"{stages}); use {fix}, or schedule='gpipe'"
            )
        return count


class ReadsPipelineOptions:
    """For a strategy that holds its settings in ``self.options``: reads them as attributes, so that the options
    stay the single source and the strategy keeps no copy (to change one, replace the options)."""

    options: PipelineOptions

    @property
    def chunks(self) -> int:
        """Micro-batches per batch (``PipelineOptions.chunks``)."""
        return self.options.chunks

    @property
    def balance(self) -> list[int] | str:
        """Blocks per stage as a list, or the mode that places them (``PipelineOptions.balance``)."""
        balance = self.options.balance
        return balance if isinstance(balance, str) else list(balance)

    @property
    def checkpoint(self) -> str:
        """Which micro-batches re-materialize in backward (``PipelineOptions.checkpoint``)."""
        return self.options.checkpoint

    @property
    def loss_reduction(self) -> str:
        """How ``training_step``'s loss reduces over samples (``PipelineOptions.loss_reduction``)."""
        return self.options.loss_reduction
