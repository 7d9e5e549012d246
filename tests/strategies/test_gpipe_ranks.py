"""What a rank is under ``gpipe_distributed``: a process is a stage, a replica is ``pipeline_parallel_size`` processes.
What Lightning, its callbacks and torchmetrics read as "how many replicas see data" is the data-parallel count; what
names a process (per-process files, rank zero's duties) stays the process's.

Members enumerated from Lightning and torchmetrics: every callback and logger Lightning ships, read for the trainer's
counts it uses (``world_size``, ``num_devices``, ``num_nodes``, ``global_rank``), each classed as counting replicas or
naming a process, and each replica-counting one run in the conformance feature ``replica_counts`` (2 processes against
DDP on one: tests/strategies/conformance, where a ``SumMetric``, a ``CatMetric`` and a ``dist_sync_on_step`` metric, the
sampler's shard, ``estimated_stepping_batches`` and a learning rate scaled by ``world_size`` are compared too); the
strategy's counts for layouts of 1 and 2 replicas; torchmetrics' sync group. ``gpipe`` runs in one process: a replica,
as plain Lightning on one device. Before: ``trainer.world_size`` was 2 for one pipeline of 2 stages (a throughput's global
rate, a ``SumMetric`` synced over the ranks and a learning rate scaled by it twice what DDP gives)."""

from __future__ import annotations

import inspect
import re

import lightning.pytorch as pl
import lightning.pytorch.callbacks as callbacks
import lightning.pytorch.loggers as loggers
import pytest
import torch
import torch.distributed as dist
import torchmetrics
from lightning.fabric.plugins.environments import LightningEnvironment

from lightning_accel import DistributedGPipeStrategy, GPipeStrategy
from lightning_accel.pipeline.step_report import metrics_over_replicas
from tests.support.conformance import FEATURES

COUNTS = ("world_size", "num_devices", "num_nodes", "global_rank")
# what each of Lightning's callbacks reads a count for; a new reader shows up in the first test
READS = {
    "ThroughputMonitor": ("replicas", "replica_counts"),  # Throughput(world_size=...): the global rates
    "EarlyStopping": ("replicas", "early_stopping"),  # world_size > 1: its messages name the rank
    "BasePredictionWriter": ("process", None),  # predictions_{global_rank}.pt: one file per process
}


def _readers() -> dict[str, set[str]]:
    """Lightning's callbacks and loggers (their modules' ``__all__``) that read one of :data:`COUNTS` of the trainer."""
    found: dict[str, set[str]] = {}
    for module in (callbacks, loggers):
        for name in module.__all__:
            source = inspect.getsource(inspect.getmodule(getattr(module, name)))
            reads = set(re.findall(rf"trainer\.({'|'.join(COUNTS)})\b", source))
            if reads:
                found[name] = reads
    return found


def test_every_count_lightnings_callbacks_and_loggers_read_is_classed_and_the_replica_counts_are_run() -> None:
    readers = _readers()
    assert set(readers) == set(READS), readers
    for name, (kind, feature) in READS.items():
        if kind == "replicas":
            assert feature in FEATURES, name


def _strategy(processes: int, process: int, pp: int) -> DistributedGPipeStrategy:
    """The strategy as process ``process`` of ``processes`` sees itself once launched (the mesh built)."""
    strategy = DistributedGPipeStrategy(chunks=2, balance=[1] * pp, parallel_devices=[torch.device("cpu")] * processes)
    environment = LightningEnvironment()
    environment.set_world_size(processes)
    environment.set_global_rank(process)
    strategy.cluster_environment = environment
    strategy._mesh = object()  # launched: what parallel_devices reads
    return strategy


@pytest.mark.parametrize(("processes", "pp"), [(2, 2), (4, 2), (4, 4)])
def test_the_counts_are_the_replicas_and_the_rank_is_the_process(processes, pp) -> None:
    dp = processes // pp
    for process in range(processes):
        strategy = _strategy(processes, process, pp)
        assert strategy.world_size == dp and strategy.num_processes == processes
        assert len(strategy.parallel_devices) == dp  # trainer.num_devices: this node's replicas
        assert strategy.global_rank == process and strategy.is_global_zero == (process == 0)  # the process's
        assert strategy.distributed_sampler_kwargs == {"num_replicas": dp, "rank": process % dp}  # pp outermost
        assert strategy.data_parallel_rank == process % dp


def test_gpipe_is_one_replica_as_plain_lightning_on_one_device() -> None:
    trainer = pl.Trainer(accelerator="cpu", strategy=GPipeStrategy(chunks=2, devices=2), logger=False)
    assert (trainer.world_size, trainer.num_devices, trainer.global_rank) == (1, 1, 0)


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_metric_without_a_group_of_its_own_syncs_over_the_replicas(one_process_group) -> None:
    """Every torchmetrics Metric, wherever it lives, that names no group syncs over the replicas' group while the
    strategy runs (here a group of one, for the one replica), and over the default group again after."""
    replicas = dist.new_group([0])
    seen: list[object] = []
    real = torchmetrics.metric.gather_all_tensors
    torchmetrics.metric.gather_all_tensors = lambda result, group=None: (seen.append(group), real(result, group=group))[1]
    try:
        patch = metrics_over_replicas(replicas)
        metric = torchmetrics.SumMetric()
        metric.update(torch.tensor(2.0))
        assert float(metric.compute()) == 2.0 and seen == [replicas]
        patch.remove()
        metric.update(torch.tensor(1.0))
        assert float(metric.compute()) == 3.0 and seen == [replicas, None]
    finally:
        torchmetrics.metric.gather_all_tensors = real
