"""A fit that raises leaves nothing of our callbacks behind: Lightning calls ``on_exception``, not ``teardown``."""

from __future__ import annotations

import multiprocessing
import signal
import threading

import pytest
from torch.utils.data import DataLoader

from lightning_accel.callbacks import PrefetchTuner
from lightning_accel.callbacks.graceful_interrupt import GracefulInterrupt
from lightning_accel.prefetch import LoaderSettings, cache


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("prefetch-")]


def test_a_fit_raising_at_step_2_restores_sigint_the_strategy_and_stops_the_workers(sleepy, recorder, make_trainer, tmp_path):
    data = sleepy(16)
    path = tmp_path / "tuned.json"
    cache.store(path, cache.cache_key(data, 1), LoaderSettings(2, 2))  # two workers serve from the first batch
    tuner, interrupt = PrefetchTuner(max_workers=2, cache_path=str(path)), GracefulInterrupt(tmp_path)
    before = set(multiprocessing.active_children())
    # another test's reaper may still be winding down in this process: only this fit's threads are checked
    threads_before = set(_prefetch_threads())
    seen: dict = {}

    class FailsAtStep2(recorder):
        def training_step(self, batch, batch_idx):
            if batch_idx == 2:  # what the failure has to clean up is all live now
                seen["handler"] = signal.getsignal(signal.SIGINT)
                seen["patched"] = "process_dataloader" in vars(self.trainer.strategy)
                seen["workers"] = set(multiprocessing.active_children()) - before
                seen["threads"] = [t for t in _prefetch_threads() if t not in threads_before]
                raise RuntimeError("boom at step 2")
            return super().training_step(batch, batch_idx)

    original = signal.getsignal(signal.SIGINT)
    trainer = make_trainer([tuner, interrupt])
    with pytest.raises(RuntimeError, match="boom at step 2"):
        trainer.fit(FailsAtStep2(), DataLoader(data, batch_size=1))
    # the state a leak would leave was there during the fit ...
    assert seen["handler"] == interrupt._handle and seen["patched"], seen
    assert len(seen["workers"]) == 2 and any(t.name == "prefetch-reaper" for t in seen["threads"]), seen
    # ... and none of it is left after the failure
    assert signal.getsignal(signal.SIGINT) is original
    assert "process_dataloader" not in vars(trainer.strategy)
    assert not any(p.is_alive() for p in seen["workers"])
    assert tuner.loader is not None and tuner.loader._inner is None and tuner.loader.reaper._thread is None
    assert not [t for t in _prefetch_threads() if t not in threads_before]
    # a teardown after on_exception changes nothing
    tuner.teardown(trainer, trainer.lightning_module, "fit")
    interrupt.teardown(trainer, trainer.lightning_module, "fit")
    assert signal.getsignal(signal.SIGINT) is original and "process_dataloader" not in vars(trainer.strategy)
