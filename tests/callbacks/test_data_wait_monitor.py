"""DataWaitMonitor's numbers against an independent timer inside the dataset."""

from __future__ import annotations

import logging

import pytest
from torch.utils.data import DataLoader

from lightning_accel.callbacks import DataWaitMonitor


def test_wait_matches_the_time_spent_fetching(caplog, sleepy, recorder, make_trainer):
    data = sleepy(12, latency_s=0.03)
    monitor = DataWaitMonitor()
    with caplog.at_level(logging.INFO):
        make_trainer([monitor]).fit(recorder(), DataLoader(data, batch_size=1))
    stats = monitor.stats()
    assert stats.steps == 12
    # num_workers=0: the loop waits exactly while the dataset works, plus a little collation.
    fetched = sum(data.spent) / len(data.spent)
    assert fetched * 0.8 < stats.wait_s < fetched * 1.5 + 0.01
    assert stats.wait_fraction > 0.5
    verdict = [r.getMessage() for r in caplog.records if "DataWaitMonitor" in r.getMessage()]
    assert len(verdict) == 1 and "data-bound" in verdict[0]
    assert verdict[0].endswith("try PrefetchTuner (callbacks=prefetch)")


def test_the_verdict_knows_the_tuner_already_ran(sleepy, recorder, make_trainer):
    from lightning_accel.callbacks import PrefetchTuner

    monitor = DataWaitMonitor()
    make_trainer([monitor]).fit(recorder(), DataLoader(sleepy(4, latency_s=0.03), batch_size=1))
    assert "data-bound" in monitor.verdict([monitor, PrefetchTuner()])
    assert "try PrefetchTuner" not in monitor.verdict([monitor, PrefetchTuner()])
    assert "PrefetchTuner ran and this is with its settings" in monitor.verdict([monitor, PrefetchTuner()])


def test_compute_bound_verdict_and_logged_metrics(sleepy, recorder, make_trainer):
    monitor = DataWaitMonitor(log_every_n_steps=3)
    t = make_trainer([monitor])
    logged = []

    class Spy(DataWaitMonitor):  # records what the monitor logged, step by step
        def on_train_batch_end(self, trainer, *args):
            logged.append(trainer.callback_metrics.get("data_wait_ms"))

    t.callbacks.append(Spy())
    # 8 steps of 0.1 s: a loader that does not sleep waits ~5 ms a batch on a loaded 2-core machine (0.11 of a
    # 0.05 s step, seen in a full run beside other work), still far under the 0.1 a compute-bound verdict needs
    t.fit(recorder(step_s=0.1), DataLoader(sleepy(16), batch_size=2))
    stats = monitor.stats()
    assert stats.step_s >= 0.1 and stats.wait_fraction < 0.1
    assert "compute-bound" in monitor.verdict()
    assert {"data_wait_ms", "data_wait_fraction", "batches_per_s"} <= set(t.callback_metrics)
    waits = monitor.meter.waits
    # Logged at steps 3 and 6 (means of their windows) and at the last step (the window 7-8).
    assert logged[2].item() == pytest.approx(1000 * sum(waits[0:3]) / 3, rel=1e-4)
    assert logged[3].item() == logged[2].item()  # nothing logged in between
    assert logged[5].item() == pytest.approx(1000 * sum(waits[3:6]) / 3, rel=1e-4)
    assert t.callback_metrics["data_wait_ms"].item() == pytest.approx(1000 * sum(waits[6:8]) / 2, rel=1e-4)


def test_logs_follow_the_trainers_interval_by_default(sleepy, recorder, make_trainer):
    monitor = DataWaitMonitor()
    t = make_trainer([monitor], log_every_n_steps=2)
    t.fit(recorder(), DataLoader(sleepy(5), batch_size=1))  # logged at steps 2, 4 and 5 (the end)
    assert t.callback_metrics["data_wait_ms"].item() == pytest.approx(1000 * monitor.meter.waits[4], rel=1e-4)


def test_bad_threshold_is_rejected():
    with pytest.raises(ValueError, match=r"data_bound_fraction=1.5 must lie strictly between 0 and 1"):
        DataWaitMonitor(data_bound_fraction=1.5)
    with pytest.raises(ValueError, match=r"log_every_n_steps=0 must be a positive integer; pass None"):
        DataWaitMonitor(log_every_n_steps=0)
