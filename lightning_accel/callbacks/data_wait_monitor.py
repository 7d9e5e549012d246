"""DataWaitMonitor: how long the training loop waits for each batch, and the verdict.

A step that waits for data leaves the accelerator idle; the share of wall time spent
waiting says whether a run is data-bound (worth tuning the loader) or compute-bound
(loader tuning cannot help). The numbers go to whatever logger the Trainer has and to
the progress bar; at the end one line gives the verdict.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from lightning_accel.prefetch.wait_meter import WaitMeter, WaitStats


class DataWaitMonitor(Callback):
    """Measures every step; logs ``data_wait_ms``, ``data_wait_fraction`` and ``batches_per_s``.

    Measuring costs two clock reads per step; ``LightningModule.log`` costs about a
    millisecond a call, so the numbers are logged as means over each window of
    ``log_every_n_steps`` steps (the trainer's own setting unless given), when the
    loggers write anyway.

    Args:
        data_bound_fraction: share of time spent waiting above which the verdict is data-bound.
        prog_bar: also show the numbers in the progress bar.
        log_every_n_steps: log (and show) the means every this many steps; ``None``: the trainer's.
    """

    def __init__(self, data_bound_fraction: float = 0.1, prog_bar: bool = True, log_every_n_steps: int | None = None) -> None:
        if not 0 < data_bound_fraction < 1:
            raise ValueError(
                f"data_bound_fraction={data_bound_fraction!r} must lie strictly between 0 and 1; pass e.g. 0.1 "
                "(data-bound when over 10% of the time is spent waiting)"
            )
        if log_every_n_steps is not None and (
            isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps <= 0
        ):
            raise ValueError(
                f"log_every_n_steps={log_every_n_steps!r} must be a positive integer; pass None to follow "
                "Trainer(log_every_n_steps=...)"
            )
        self.data_bound_fraction = data_bound_fraction
        self.prog_bar = prog_bar
        self.log_every_n_steps = log_every_n_steps
        self.meter = WaitMeter()
        self._logged = 0  # steps already covered by a logged window

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.meter.start()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.meter.batch_arrived()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.meter.step_ended()
        n = len(self.meter)
        every = self.log_every_n_steps or trainer.log_every_n_steps
        if not every:  # Trainer(log_every_n_steps=0): logging is off; the verdict still comes
            return
        last = trainer.should_stop or batch_idx + 1 >= trainer.num_training_batches  # the epoch's last window
        if n == self._logged or (n % every and not last):
            return
        window = self.meter.stats(last=n - self._logged)
        self._logged = n
        pl_module.log("data_wait_ms", 1000.0 * window.wait_s, prog_bar=self.prog_bar, on_step=True, on_epoch=False)
        pl_module.log("data_wait_fraction", window.wait_fraction, prog_bar=self.prog_bar, on_step=True, on_epoch=False)
        pl_module.log("batches_per_s", window.throughput, on_step=True, on_epoch=False)

    def stats(self) -> WaitStats:
        """Means over every step measured so far (the first step, with the loader's start-up, included)."""
        return self.meter.stats()

    def verdict(self, callbacks: list[Callback] | None = None) -> str:
        """The closing line; ``callbacks`` (the trainer's) decide the advice: a run whose
        loader PrefetchTuner already tunes is not told to try it."""
        s = self.stats()
        if not s.steps:
            return "DataWaitMonitor: no training steps measured"
        numbers = (
            f"mean wait {1000 * s.wait_s:.1f} ms vs step {1000 * s.step_s:.1f} ms over {s.steps} steps, "
            f"{s.throughput:.2f} batches/s"
        )
        if s.wait_fraction > self.data_bound_fraction:
            gain = (s.wait_s + s.step_s) / s.step_s if s.step_s else float("inf")
            return (
                f"DataWaitMonitor: data-bound, {100 * s.wait_fraction:.0f}% of the time waiting for batches ({numbers}); "
                f"a loader that keeps up would be up to {gain:.1f}x faster: {self._advice(callbacks or [])}"
            )
        return f"DataWaitMonitor: compute-bound, {100 * s.wait_fraction:.0f}% of the time waiting for batches ({numbers})"

    @staticmethod
    def _advice(callbacks: list[Callback]) -> str:
        names = {type(c).__name__ for c in callbacks}
        if "PrefetchTuner" in names:  # by name: the tuner's module imports the prefetch mechanism
            return "PrefetchTuner ran and this is with its settings (its line says what it chose); more cores or faster storage would help"
        return "try PrefetchTuner (callbacks=prefetch)"

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rank_zero_info(self.verdict(trainer.callbacks))
