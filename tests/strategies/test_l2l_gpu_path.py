"""L2LOffloadStrategy on the GPU code path, run on the CPU device through the device layer's stand-in
(offload/device_memory.py): weights and gradients cross the pinned rings (offload/staging.py) as on CUDA, the run
equals the same run in memory bit for bit, and what the host pins is what the tier's plan counts: a few slots and the
tier's I/O buffers, never a copy of the masters, shadows or frozen weights (nothing is pinned at set-up)."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.models import GPT, LanguageModelTask
from lightning_accel.offload.device_memory import StandIn, standing_in
from lightning_accel.offload.disk_io import ALIGN
from lightning_accel.offload.tier_plan import COPY_SLOTS, DEFAULT_CHUNK, GRAD_SLOTS
from lightning_accel.plugins.precision import OffloadPrecision
from lightning_accel.strategies.l2l_offload import L2LOffloadStrategy


class Task(LanguageModelTask):
    def __init__(self, freeze: bool = False) -> None:
        super().__init__(GPT("tiny", n_layer=3, block_size=16, vocab_size=256))
        if freeze:  # a fine-tune's shape: each block's attention frozen, its MLP trained
            for block in self.net.blocks:
                block.attn.requires_grad_(False)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=3e-3, weight_decay=0.1)


def _fit(strategy: L2LOffloadStrategy, precision: str | None, task: Callable[[], Task]) -> tuple[Task, pl.Trainer]:
    torch.manual_seed(0)
    module = task()
    tokens = torch.randint(0, 256, (32, 17), generator=torch.Generator().manual_seed(0))
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, max_steps=3,
                         plugins=[OffloadPrecision(precision)] if precision else None)
    trainer.fit(module, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8))
    return module, trainer


def _assert_same(a: tuple[Task, pl.Trainer], b: tuple[Task, pl.Trainer]) -> None:
    for name, value in a[0].state_dict().items():
        assert torch.equal(b[0].state_dict()[name], value), name
    sa, sb = a[1].optimizers[0].state_dict()["state"], b[1].optimizers[0].state_dict()["state"]
    for index, entries in sa.items():
        for key, value in entries.items():
            assert torch.equal(sb[index][key], value), (index, key)


@pytest.mark.parametrize(("precision", "freeze"), [(None, False), ("bf16-mixed", True)], ids=["fp32", "bf16-frozen-base"])
def test_the_gpu_path_with_the_tier_trains_as_in_memory_and_pins_only_what_the_plan_counts(
        tmp_path: Path, precision: str | None, freeze: bool) -> None:
    task = functools.partial(Task, freeze)
    in_memory = _fit(L2LOffloadStrategy(), precision, task)
    with standing_in(StandIn()) as memory:
        tiered = _fit(L2LOffloadStrategy(nvme_path=str(tmp_path), nvme_chunk="1MiB"), precision, task)
    _assert_same(in_memory, tiered)
    plan, stats = tiered[1].strategy._tier_plan, tiered[1].strategy.offload_stats
    # the rings: 6 slots of the largest parameter crossing the bus (the 256 x 128 embedding is kept on the "device")
    largest = max(p.numel() * (2 if precision and p.ndim >= 2 and p.requires_grad else 4)
                  for b in tiered[0].net.blocks for p in b.parameters())
    assert plan.staged == largest and plan.staging_bytes == (GRAD_SLOTS + COPY_SLOTS) * largest
    assert stats.d2h_bytes > 0 and stats.h2d_bytes > 0  # (both directions crossed them)
    # every byte asked to be pinned is a ring's slot or one of the tier's buffers (each asked 4 KiB over, to align it on a
    # CPU): nothing the size of a unit's masters, shadows or frozen weights, and no more than the plan counts
    assert memory.pinned_bytes <= plan.staging_bytes + plan.buffer_bytes + ALIGN * len(memory.requests)
    assert max(memory.requests) <= max(plan.staging_slot, plan.step_buffer, plan.weight_buffer) + ALIGN
    # what the offload kept is what the plan counted, the rings included
    kept = stats.peak_host_bytes + stats.host_optimizer_bytes + plan.resident_kept
    assert plan.staging_bytes > 0 and kept <= plan.host_bytes + 1024
    assert not list(tmp_path.iterdir())


def test_the_gpu_path_without_the_tier_pins_six_slots_not_a_buffer_per_parameter() -> None:
    in_memory = _fit(L2LOffloadStrategy(), "bf16-mixed", Task)
    with standing_in(StandIn()) as memory:
        staged = _fit(L2LOffloadStrategy(), "bf16-mixed", Task)
    _assert_same(in_memory, staged)
    blocks = staged[0].net.blocks
    largest = max(p.numel() * (2 if p.ndim >= 2 else 4) for b in blocks for p in b.parameters())
    assert largest < DEFAULT_CHUNK and memory.requests == [largest] * (GRAD_SLOTS + COPY_SLOTS)
    # (before: one buffer per parameter, every block's; the slots do not grow with depth)
    every = sum(p.numel() * (2 if p.ndim >= 2 else 4) for b in blocks for p in b.parameters())
    assert memory.pinned_bytes == (GRAD_SLOTS + COPY_SLOTS) * largest < every


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_what_is_pinned_is_the_plan_s_rings_and_buffers_and_the_run_equals_the_one_in_memory(tmp_path: Path) -> None:
    from lightning_accel.offload.device_memory import DeviceMemory

    def fit(strategy: L2LOffloadStrategy) -> tuple[Task, pl.Trainer]:
        torch.manual_seed(0)
        module = Task(freeze=True)
        tokens = torch.randint(0, 256, (32, 17), generator=torch.Generator().manual_seed(0))
        trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=strategy, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, max_steps=3,
                             plugins=[OffloadPrecision("bf16-mixed")])
        trainer.fit(module, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8))
        return module, trainer

    with standing_in(DeviceMemory(torch.device("cuda"))) as memory:
        in_memory = fit(L2LOffloadStrategy())
        assert memory.requests and set(memory.requests) == {max(memory.requests)}  # 6 slots, nothing else
        memory.pinned_bytes, memory.requests = 0, []
        tiered = fit(L2LOffloadStrategy(nvme_path=str(tmp_path), nvme_chunk="1MiB"))
    _assert_same(in_memory, tiered)
    plan = tiered[1].strategy._tier_plan
    assert memory.pinned_bytes <= plan.staging_bytes + plan.buffer_bytes + ALIGN * len(memory.requests)
    assert not any(p.is_pinned() for p in tiered[0].parameters())  # no master, shadow or frozen weight pinned
