"""PrefetchTuner on streams (one endless epoch) and on CPU-bound items within the CPU budget."""

from __future__ import annotations

import statistics
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

import lightning_accel.callbacks.prefetch_tuner as tuner_module
import lightning_accel.prefetch.search as search_module
from lightning_accel.callbacks import DataWaitMonitor, PrefetchTuner
from lightning_accel.cpu_budget import CpuBudget
from lightning_accel.prefetch import LoaderSettings
from lightning_accel.prefetch.stream import PositionStream


class SlowPositions(PositionStream):
    """An endless stream; position ``p`` is ``(p, x)`` after ``latency_s`` of I/O."""

    def __init__(self, latency_s: float) -> None:
        super().__init__()
        self.latency_s = latency_s

    def read(self, position: int):
        time.sleep(self.latency_s)
        return torch.tensor(position), torch.full((4,), float(position))


class SlowStream(IterableDataset):
    """The same stream without a position: worker k of W yields k, k + W, ... forever."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s

    def __iter__(self):
        info = get_worker_info()
        k, w = (0, 1) if info is None else (info.id, info.num_workers)
        p = k
        while True:
            time.sleep(self.latency_s)
            yield torch.tensor(p), torch.full((4,), float(p))
            p += w


def steady_wait(monitor: DataWaitMonitor, last: int = 10) -> float:
    return statistics.median(monitor.meter.waits[: len(monitor.meter.steps)][-last:])


def test_endless_stream_is_tuned_within_its_one_epoch(recorder, make_trainer):
    # The held-out run, shrunk 4x: 50 ms of I/O per item, a 12 ms step, DataLoader defaults.
    tuner, monitor = PrefetchTuner(max_workers=8, max_search_steps=40), DataWaitMonitor()
    model = recorder(step_s=0.012)
    make_trainer([tuner, monitor], max_steps=90).fit(model, DataLoader(SlowPositions(0.05), batch_size=1))
    assert tuner.chosen is not None and tuner.chosen.num_workers >= 2, tuner.report()  # 4 on a quiet machine
    assert tuner.loader.settings == tuner.chosen and tuner.loader.restarts == 0
    assert "serving from the next batches" in tuner.reason
    # Every position once, in an unbroken prefix (the last round of workers may be partly served).
    served = model.indices
    assert len(served) == 90 == len(set(served))
    w = tuner.chosen.num_workers
    assert sorted(served)[: 90 - w] == list(range(90 - w))
    # Steady state inside the same epoch: under half the untuned wait measured in this run (50 ms of I/O and
    # whatever the machine adds; against a fixed 20 ms, a load of 11 on 2 cores made the tuned wait 28 ms).
    assert steady_wait(monitor) < 0.5 * tuner.search.trials[0].wait_s, tuner.report()


def test_stream_without_position_keeps_its_settings_this_epoch_and_says_so(recorder, make_trainer, caplog):
    tuner = PrefetchTuner(max_workers=4, max_search_steps=20)
    model = recorder(step_s=0.005)
    with caplog.at_level("INFO"):
        make_trainer([tuner], max_steps=20).fit(model, DataLoader(SlowStream(0.05), batch_size=1))
    assert tuner.chosen is not None and tuner.loader.settings == LoaderSettings(0)  # not now: next epoch
    line = "used from the next epoch (SlowStream cannot report its position (no state_dict/load_state_dict)); " \
        "pass stream_switch='restart' to switch now, restarting the stream"
    assert line in tuner.reason and any(line in r.getMessage() for r in caplog.records)
    assert model.indices == list(range(20))  # nothing lost or repeated


def test_stream_without_position_restarts_now_when_asked(recorder, make_trainer):
    # 100 ms items: the probed candidates (25 ms a batch with 4 workers) beat the start's two measured steps beyond
    # their noise on a loaded machine too (at 50 ms, a load of 11 on 2 cores once kept the start); 20 steps, not 30.
    tuner = PrefetchTuner(max_workers=4, max_search_steps=20, stream_switch="restart")
    model = recorder(step_s=0.005)
    make_trainer([tuner], max_steps=20).fit(model, DataLoader(SlowStream(0.1), batch_size=1))
    assert tuner.chosen is not None and tuner.loader.settings == tuner.chosen and tuner.loader.restarts == 1, tuner.report()
    assert "serving now, the stream restarted from its beginning" in tuner.reason
    first = model.indices.index(0, 1)  # the restart: position 0 comes again
    assert model.indices[:first] == list(range(first)) and sorted(set(model.indices[first:])) == sorted(model.indices[first:])


def test_bad_stream_switch_is_refused():
    with pytest.raises(ValueError, match=r"stream_switch='later' is not one of \('next_epoch', 'restart'\)"):
        PrefetchTuner(stream_switch="later")


class Busy(Dataset):
    """Item ``i`` costs ~``cpu_s`` of pure-Python CPU work (like decoding), no I/O."""

    def __init__(self, n: int, cpu_s: float) -> None:
        self.n, self.cpu_s = n, cpu_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        end = time.process_time() + self.cpu_s
        x = 0
        while time.process_time() < end:
            x += 1
        return torch.tensor(i), torch.full((4,), float(i))


def test_cpu_bound_items_stay_within_the_cpu_budget(recorder, make_trainer, monkeypatch):
    one_core = CpuBudget(1, "SLURM_CPUS_PER_TASK", 1, "given", {"affinity": 2.0, "SLURM_CPUS_PER_TASK": 1.0})
    monkeypatch.setattr(tuner_module, "cpu_budget", lambda ranks: one_core)
    monkeypatch.setattr(search_module, "cpu_budget", lambda ranks: one_core)
    tuner = PrefetchTuner(max_search_steps=40)
    model = recorder(step_s=0.001)
    make_trainer([tuner], max_steps=40).fit(model, DataLoader(Busy(40, 0.02), batch_size=1))
    assert tuner.search is not None and "CPU-bound items" in tuner.cpu_note, tuner.report()
    assert "1 CPU core per rank (from SLURM_CPUS_PER_TASK" in tuner.cpu_note
    # The start (no workers) measured its CPU share in this process: every candidate is within the budget.
    assert all(t.settings.num_workers <= 1 for t in tuner.search.trials[1:])
    assert tuner.chosen is None or tuner.chosen.num_workers <= 1
    assert sorted(model.indices) == list(range(40))


def test_worker_cpu_share_tells_cpu_from_io(sleepy):
    from lightning_accel.prefetch import TunableLoader

    # Queueing (other tenants of a shared machine) counts neither way: a sleeping worker stays near 0.
    for data, low, high in ((Busy(12, 0.05), 0.6, 1.0), (sleepy(12, latency_s=0.05), 0.0, 0.2)):
        loader = TunableLoader(DataLoader(data, batch_size=1, num_workers=1))
        it = iter(loader)
        batches = [next(it) for _ in range(10)]  # mid-epoch: the worker is alive
        busy = loader.cpu_busy()
        loader.close()
        assert len(batches) == 10 and busy is not None and low <= busy <= high, (type(data).__name__, busy)


def test_a_start_over_the_cpu_budget_is_brought_back_within_it(recorder, make_trainer, monkeypatch):
    one_core = CpuBudget(1, "cgroup v2 quota", 1, "given", {"affinity": 2.0, "cgroup v2 quota": 1.0})
    monkeypatch.setattr(tuner_module, "cpu_budget", lambda ranks: one_core)
    monkeypatch.setattr(search_module, "cpu_budget", lambda ranks: one_core)
    # The policy under test, not the measurement (test_worker_cpu_share_tells_cpu_from_io): over two
    # short steps just after start-up, workers that had filled their buffers look idle part of the time.
    from lightning_accel.prefetch import TunableLoader

    monkeypatch.setattr(TunableLoader, "cpu_busy", lambda self: 0.95)
    tuner = PrefetchTuner(warmup_steps=1, trial_steps=2, max_search_steps=12)
    model = recorder(step_s=0.001)
    user = DataLoader(Busy(40, 0.03), batch_size=1, num_workers=4, persistent_workers=True)
    make_trainer([tuner], max_steps=40).fit(model, user)
    # Four CPU-bound workers measured at the start: the budget falls to 1, and the loader follows it
    # even though the search had little time left.
    assert "CPU-bound items" in tuner.cpu_note and "4 workers" in tuner.cpu_note, tuner.report()
    assert tuner.loader.settings.num_workers <= 1 and tuner.loader.switches >= 1, tuner.report()
    assert sorted(model.indices) == list(range(40))


READS: list[int] = []  # positions CountedPositions read in this process, by any copy of it


class CountedPositions(PositionStream):
    """An endless stream of instant items that records every position it (or a copy of it) reads."""

    def read(self, position: int):
        READS.append(position)
        return torch.tensor(position), torch.full((4,), float(position))


def test_a_stream_is_read_once_from_lightnings_read_ahead_on(recorder, make_trainer):
    # Lightning's fetcher reads one batch of a loader without a length before on_train_start; the
    # tuner wrapped the loader before that read, so it is the tuned loader's first batch, read once.
    stream, _ = CountedPositions(), READS.clear()
    # Instant items against 50 ms steps: compute-bound, so no worker ever starts. Judged at half the time
    # waiting, not 10%: the loader's overhead on a loaded machine is not I/O (a loaded CI machine made a 10 ms
    # step's 2 ms of it 13%; a load of 11 on 2 cores, 10 ms against an 88 ms step).
    tuner = PrefetchTuner(data_bound_fraction=0.5)
    model = recorder(step_s=0.05)
    make_trainer([tuner], max_steps=12).fit(model, DataLoader(stream, batch_size=2))
    assert "compute-bound" in tuner.reason, tuner.report()
    assert model.indices == list(range(24))  # every position once, in order
    assert len(READS) == len(set(READS)) and READS[:24] == list(range(24)), READS[:8]


class SlowCountedPositions(CountedPositions):
    def read(self, position: int):
        time.sleep(0.3)
        return super().read(position)


def test_workers_start_while_lightning_reads_ahead_of_a_slow_stream(recorder, make_trainer, monkeypatch):
    # The batch Lightning reads ahead is the first one loaded here: slower than a worker's start, it
    # starts the workers, which make the next ones (before, that batch and the next loaded here: 0.6 s).
    # (A worker's start is the last one measured in this process, by an earlier test: 50 ms pinned here, as
    # before any, so that a loaded machine's slow forks cannot make 300 ms look quick.)
    monkeypatch.setattr("lightning_accel.prefetch.online.worker_start_s", lambda: 0.05)
    stream, _ = SlowCountedPositions(), READS.clear()
    tuner = PrefetchTuner(max_workers=2)
    model = recorder(step_s=0.01)
    make_trainer([tuner], max_steps=10).fit(model, DataLoader(stream, batch_size=1))
    report = tuner.report()
    assert tuner.loader.speculated is not None and tuner.loader.speculated.num_workers == 2, report
    assert READS == [0], (READS, tuner.meter.waits[:3], report)  # only the read-ahead batch loaded here
    assert tuner.meter.waits[0] > 0.3, report  # the first step's wait counts the read-ahead batch
    assert tuner.measured.steps == 1 and tuner.search.trials[0].settings == LoaderSettings(0), report
    assert model.indices == list(range(10))


class SlowTokenWindows(PositionStream):
    """An endless stream of 16-token windows (position ``p``: ids ``(7 p + j) % 256``) after 200 ms of I/O each
    (at 80 ms, a CI machine loaded by a second job measured the tiny Llama's first step at 860 ms, and the one
    candidate's samples, 367 +- 128 ms, could not be told from the start's 449 ms)."""

    def read(self, position: int):
        time.sleep(0.2)
        return torch.tensor(position), (7 * position + torch.arange(16)) % 256


def test_a_transformers_model_on_a_slow_token_stream_is_tuned_within_the_epoch(make_trainer):
    # A model this project did not write (transformers' Llama, its defaults apart from the size, random
    # weights) reading a position stream at the DataLoader's defaults: the tuner gives it workers
    # within the one epoch and every window is trained on once.
    transformers = pytest.importorskip("transformers", reason="needs the hf extra")
    import lightning.pytorch as pl

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=16, use_cache=False,
    )

    class Causal(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = transformers.LlamaForCausalLM(config)
            self.positions: list[int] = []
            self.losses: list[float] = []

        def training_step(self, batch, batch_idx):
            position, ids = batch
            self.positions += position.tolist()
            loss = self.net(input_ids=ids, labels=ids).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    tuner, model = PrefetchTuner(max_workers=4, max_search_steps=20), Causal()
    make_trainer([tuner], max_steps=40).fit(model, DataLoader(SlowTokenWindows(), batch_size=2))
    report = tuner.report()
    assert tuner.chosen is not None and tuner.chosen.num_workers >= 2, report
    assert tuner.loader.settings == tuner.chosen and "serving from the next batches" in tuner.reason, report
    # Every window once, an unbroken prefix across the hand-overs (the last round of workers may be partly
    # served: each worker reads every w-th position, two to a batch).
    served, w = model.positions, tuner.chosen.num_workers
    assert len(served) == 80 == len(set(served)) and sorted(served)[: 80 - 2 * w] == list(range(80 - 2 * w))
    assert all(torch.isfinite(torch.tensor(model.losses)))
