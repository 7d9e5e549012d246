"""L2LOffloadStrategy(nvme_path=..., host_budget=...): a run with the NVMe tier equals the same run in memory bit for
bit, resumes exactly from its checkpoints, leaves nothing behind, and refuses what it cannot do before any work."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.estimate.tier import tier_plan
from lightning_accel.models import GPT, LanguageModelTask
from lightning_accel.offload import tier as tier_module
from lightning_accel.offload import tier_plan as tier_plan_module
from lightning_accel.offload.tier_dir import PREFIX
from lightning_accel.plugins.precision import OffloadPrecision
from lightning_accel.strategies.l2l_offload import L2LOffloadStrategy
from tests.support.unfreeze_models import PER_RANK_BATCH, Transfer, data, fit_case, weights

ADAMW = functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.1)
SGD = functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9)


class Task(LanguageModelTask):
    def __init__(self, optimizer: Callable[..., torch.optim.Optimizer] = ADAMW, freeze: bool = False, n_layer: int = 3,
                 vocab_size: int = 256) -> None:
        super().__init__(GPT("tiny", n_layer=n_layer, block_size=16, vocab_size=vocab_size))
        self.optimizer = optimizer
        if freeze:  # a fine-tune's shape: each block's attention frozen, its MLP trained
            for block in self.net.blocks:
                block.attn.requires_grad_(False)

    def configure_optimizers(self) -> Any:
        return self.optimizer([p for p in self.parameters() if p.requires_grad])


def _data() -> DataLoader:
    tokens = torch.randint(0, 256, (48, 17), generator=torch.Generator().manual_seed(0))
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)


def _fit(strategy: L2LOffloadStrategy, precision: str | None = None, task: Callable[[], Task] = Task, max_steps: int = 3,
         ckpt_path: Path | None = None, **kwargs: Any) -> tuple[Task, pl.Trainer]:
    torch.manual_seed(0)
    module = task()
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, max_steps=max_steps,
                         plugins=[OffloadPrecision(precision)] if precision else None, **kwargs)
    trainer.fit(module, _data(), ckpt_path=ckpt_path)
    return module, trainer


def _assert_same(a: tuple[Task, pl.Trainer], b: tuple[Task, pl.Trainer]) -> None:
    (ma, ta), (mb, tb) = a, b
    for name, value in ma.state_dict().items():
        assert torch.equal(mb.state_dict()[name], value), name
    sa, sb = ta.optimizers[0].state_dict()["state"], tb.optimizers[0].state_dict()["state"]
    assert sa.keys() == sb.keys()
    for index, entries in sa.items():
        for key, value in entries.items():
            assert torch.equal(sb[index][key], value), (index, key)


@pytest.mark.parametrize(("precision", "overlap", "clip", "accumulate", "optimizer"), [
    (None, False, None, 1, ADAMW), ("bf16-mixed", True, None, 1, SGD), (None, True, 0.5, 2, SGD), ("bf16-mixed", False, 0.5, 2, ADAMW),
], ids=["fp32-after-adamw", "bf16-overlapped-sgd", "fp32-clip-accumulate-sgd", "bf16-clip-accumulate-adamw"])
def test_a_run_with_the_tier_equals_the_run_in_memory_bit_for_bit(tmp_path: Path, precision: str | None, overlap: bool,
                                                                  clip: float | None, accumulate: int, optimizer: Any,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    task = functools.partial(Task, optimizer)
    kwargs = {"gradient_clip_val": clip, "accumulate_grad_batches": accumulate}
    in_memory = _fit(L2LOffloadStrategy(overlap_step=overlap), precision, task, **kwargs)
    with caplog.at_level("INFO"):  # each block (2.5-2.8 MB of state, masters, shadows) stepped in chunks of 1 MiB
        tiered = _fit(L2LOffloadStrategy(overlap_step=overlap, nvme_path=str(tmp_path), nvme_chunk="1MiB"), precision, task, **kwargs)
    _assert_same(in_memory, tiered)
    stats = tiered[1].strategy.offload_stats
    assert tiered[1].strategy._tier_plan.step_buffer == 2**20 and "in chunks of 1.05 MB" in caplog.text
    # each step reads every spilled unit once; the masters the blocks compute on (all in fp32, the vectors kept in fp32
    # under bf16-mixed) each forward-backward reads too: the checkpointed blocks' twice (forward, recomputation), the
    # last block's once (its forward turns into its backward)
    plan = tiered[1].strategy._tier_plan
    blocks = len(tiered[0].net.blocks)
    unit = plan.units[0]
    assert unit.compute_masters == unit.masters if precision is None else 0 < unit.compute_masters < unit.masters / 10  # the vectors
    compute = (2 * (blocks - 1) + 1) * plan.compute_span(0)  # (under bf16 the shadows too: no budget, weights on disk)
    assert plan.spilled_weights(0) == (precision is not None)  # (fp32: no shadows, the masters are the weights)
    assert stats.nvme_bytes > 0 and stats.nvme_read_bytes == 3 * stats.nvme_bytes + 3 * accumulate * compute
    # and writes it, after the first write at set-up of what existed then (the masters and shadows: no optimizer state yet)
    assert stats.nvme_write_bytes == 4 * stats.nvme_bytes - sum(u.state for u in plan.units)
    # what the offload kept is what the plan counted (its sizes as laid out: each tensor rounded up to 4 KiB), beside the
    # resident unit kept on the CPU device (its parameters, gradients and AdamW state: host memory too, in the plan)
    kept = stats.peak_host_bytes + stats.host_optimizer_bytes + plan.resident_kept
    assert plan.resident_kept > 0 and 0.99 * plan.host_bytes <= kept <= plan.host_bytes + 1024
    assert "NVMe tier: host " in caplog.text and " by the compute) and " in caplog.text
    assert not list(tmp_path.iterdir())  # the scratch directory went with the fit


def test_a_frozen_base_and_the_shadows_go_to_disk_too_and_resume_alike(tmp_path: Path) -> None:
    # a fine-tune's shape under bf16-mixed, no budget: every block's state, masters, bf16 shadows and frozen attention
    # in files; the forward reads the frozen weights, the shadows and the fp32 vectors ahead of it, the step writes the
    # shadows with the masters
    task = functools.partial(Task, ADAMW, True)
    in_memory = _fit(L2LOffloadStrategy(), "bf16-mixed", task)
    tiered = _fit(L2LOffloadStrategy(nvme_path=str(tmp_path / "nvme")), "bf16-mixed", task)
    _assert_same(in_memory, tiered)
    plan = tiered[1].strategy._tier_plan
    assert all(plan.weights_on_disk) and "weights of 3/3" in plan.describe()
    blocks = tiered[0].net.blocks
    trained = sum(p.numel() for b in blocks for p in b.parameters() if p.requires_grad)
    frozen = sum(p.numel() * p.element_size() for b in blocks for p in b.parameters() if not p.requires_grad)
    assert tiered[1].strategy.offload_stats.nvme_bytes >= trained * (12 + 2) + frozen  # master, moments, shadow; frozen
    ckpts = {}
    for name, (_, trainer) in (("memory", in_memory), ("tier", tiered)):
        ckpts[name] = tmp_path / f"{name}.ckpt"
        trainer.save_checkpoint(ckpts[name])  # the tier's: written from its maps
    saved = {k: torch.load(v, weights_only=False) for k, v in ckpts.items()}
    for key in ("state_dict", "optimizer_states"):
        torch.testing.assert_close(saved["tier"][key], saved["memory"][key], rtol=0, atol=0)
    from_memory = _fit(L2LOffloadStrategy(), "bf16-mixed", task, max_steps=5, ckpt_path=ckpts["memory"])
    from_tier = _fit(L2LOffloadStrategy(nvme_path=str(tmp_path / "nvme")), "bf16-mixed", task, max_steps=5, ckpt_path=ckpts["tier"])
    _assert_same(from_memory, from_tier)


def test_a_budget_spills_only_what_does_not_fit(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # 6 blocks of 0.82 MB of masters, 1.64 MB of AdamW state (as laid out: each tensor aligned), 0.79 MB of gradients (4
    # blocks' at once: with the tier they step during the backward), the resident unit kept on the CPU device 0.56 MB:
    # 18.48 MB in memory; each block's state on disk saves 1.64 MB once the first has paid for 3 step buffers of one
    # chunk (17.5 MB / 64 under 1 MiB: the least chunk, 1.05 MB): 2 blocks' leave 18.35 MB, 3 blocks' 16.71 MB
    task = functools.partial(Task, ADAMW, False, 6)
    with caplog.at_level("INFO"):
        module, trainer = _fit(L2LOffloadStrategy(nvme_path=str(tmp_path), host_budget="17.5MB"), task=task, max_steps=1)
    assert "optimizer state of 3/6 units, fp32 masters of 0/6" in caplog.text and "in chunks of 1.05 MB" in caplog.text
    stats, plan = trainer.strategy.offload_stats, trainer.strategy._tier_plan
    assert plan.host_bytes == 16_709_632
    assert stats.peak_host_bytes + stats.host_optimizer_bytes + plan.resident_kept <= 17.5e6 and stats.nvme_bytes > 0


def test_a_budget_met_by_streaming_the_resident_unit_streams_it_and_trains_as_the_run_in_memory(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # fp32 on the CPU device: the resident unit kept (a 4096-token embedding tied to the head: 8.5 MB of parameters,
    # gradients and AdamW state) is host memory; a budget between the least the plan keeps with it kept and with it
    # streamed: the plan streams it (the strategy's executor is made again), its parameters stepping as their gradients
    # land, and the run is the one in memory (the resident unit kept)
    task = functools.partial(Task, ADAMW, False, 3, 4096)
    net = task().net
    plans = [tier_plan(net, [ADAMW(net.parameters())], nvme_path=str(tmp_path), offload_resident=streamed, nvme_chunk=2**20)
             for streamed in (False, True)]
    assert plans[1].host_bytes < plans[0].host_bytes
    budget = (plans[0].host_bytes + plans[1].host_bytes) // 2
    in_memory = _fit(L2LOffloadStrategy(), task=task)
    with caplog.at_level("INFO"):
        tiered = _fit(L2LOffloadStrategy(nvme_path=str(tmp_path), host_budget=budget), task=task)
    _assert_same(in_memory, tiered)
    plan, stats = tiered[1].strategy._tier_plan, tiered[1].strategy.offload_stats
    assert plan.held == 1 and tiered[1].strategy._executor is None  # (torn down)
    assert "the plan chose: the blocks step during the backward (4 blocks' gradients at once), the resident unit streamed " \
           "through the tier" in caplog.text and "resident unit of 526,592 parameters (streamed)" in caplog.text
    # one gradient of the resident unit at a time (its 2.1 MB embedding's), and each of its bytes read once a step
    assert plan.grad_bytes < 4 * plan.units[0].grads + plan.units[-1].grads and stats.nvme_read_bytes == 3 * plan.step_read_bytes
    with pytest.raises(ValueError, match=r"^L2LOffloadStrategy: strategy.host_budget=.* cannot be met as configured: "
                                         r"offload_resident=False keeps the resident unit .*: leave offload_resident unset, or "
                                         r"raise host_budget to at least"):
        _fit(L2LOffloadStrategy(nvme_path=str(tmp_path), host_budget=budget, offload_resident=False), task=task)
    # six blocks' gradients held after the backward where the budget needs four at once: named, with the fix
    six = functools.partial(Task, ADAMW, False, 6)
    with pytest.raises(ValueError, match=r"^L2LOffloadStrategy: strategy.host_budget=.* cannot be met as configured: "
                                         r"gradient_clip_val=0.5 needs every gradient before any block steps .*: drop "
                                         r"gradient_clip_val, or raise host_budget"):
        _fit(L2LOffloadStrategy(nvme_path=str(tmp_path), host_budget="10MB"), task=six, gradient_clip_val=0.5)
    assert not list(tmp_path.iterdir())


def test_blocks_stepped_in_the_backward_hold_the_gradients_the_plan_counted(tmp_path: Path) -> None:
    # 6 blocks stepping as their gradients land: the backward holds back beyond 4 blocks' gradients, and what the
    # offload keeps (OffloadStats.host_bytes, its peak) is the plan's figure, not a gradient buffer for every block
    task = functools.partial(Task, ADAMW, False, 6)
    _, trainer = _fit(L2LOffloadStrategy(overlap_step=True, nvme_path=str(tmp_path)), task=task, max_steps=2)
    plan, stats = trainer.strategy._tier_plan, trainer.strategy.offload_stats
    assert plan.grads_in_flight == 4 and plan.grad_bytes < sum(u.grads for u in plan.units)
    kept = stats.peak_host_bytes + stats.host_optimizer_bytes + plan.resident_kept
    assert plan.host_bytes - 1024 <= kept <= plan.host_bytes + 1024


def test_checkpoints_of_a_tiered_run_are_the_in_memory_runs_and_resume_alike(tmp_path: Path) -> None:
    ckpts = {}
    for name, strategy in (("memory", L2LOffloadStrategy()), ("tier", L2LOffloadStrategy(nvme_path=str(tmp_path / "nvme")))):
        _, trainer = _fit(strategy, max_steps=3)
        ckpts[name] = tmp_path / f"{name}.ckpt"
        trainer.save_checkpoint(ckpts[name])  # written from the tier's maps
    saved = {k: torch.load(v, weights_only=False) for k, v in ckpts.items()}
    for key in ("state_dict", "optimizer_states"):
        torch.testing.assert_close(saved["tier"][key], saved["memory"][key], rtol=0, atol=0)
    assert set(saved["tier"]["optimizer_states"][0]["state"][3]) == {"step", "exp_avg", "exp_avg_sq"}  # a plain AdamW's
    from_memory = _fit(L2LOffloadStrategy(), max_steps=5, ckpt_path=ckpts["memory"])
    from_tier = _fit(L2LOffloadStrategy(nvme_path=str(tmp_path / "nvme")), max_steps=5, ckpt_path=ckpts["tier"])
    _assert_same(from_memory, from_tier)
    assert not any((tmp_path / "nvme").iterdir())
    plain = [_fit("auto", max_steps=5, ckpt_path=ckpts[name]) for name in ("memory", "tier")]  # and it loads without the tier
    _assert_same(*plain)


def test_the_module_after_fit_holds_its_weights_once_the_files_are_gone(tmp_path: Path) -> None:
    module, trainer = _fit(L2LOffloadStrategy(nvme_path=str(tmp_path)), max_steps=2)
    assert not any(p.name.startswith(PREFIX) for p in tmp_path.iterdir())
    reference, _ = _fit(L2LOffloadStrategy(), max_steps=2)
    x = torch.randint(0, 256, (2, 16))
    assert torch.equal(module(x), reference(x))
    state = trainer.optimizers[0].state_dict()["state"]
    assert all(torch.isfinite(v).all() for s in state.values() for v in s.values())


def test_a_full_disk_is_refused_before_the_first_step_in_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tier_module, "free_bytes", lambda path: 1000)
    steps: list[int] = []

    class Count(pl.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            steps.append(1)

    with pytest.raises(OSError, match=r"^strategy.nvme_path: no room in '.*' for the NVMe tier: it needs [0-9,]+ bytes .* and "
                                      r"1.00 kB is free there"):
        _fit(L2LOffloadStrategy(nvme_path=str(tmp_path)), callbacks=[Count()])
    assert not steps and not list(tmp_path.iterdir())


def test_a_budget_without_a_path_is_refused_with_the_figures(tmp_path: Path) -> None:
    # 1 MB is less than what stays with the disk too (its I/O buffers): the advice names the budget the disk needs, as the
    # CLI's preflight says it (the same plan: tests/estimate/test_tier.py)
    with pytest.raises(ValueError, match=r"^L2LOffloadStrategy: strategy.host_budget=1.00 MB is less than the .* the offload keeps "
                                         r"on the host \(optimizer state .*\); raise host_budget to at least .*, or set "
                                         r"strategy.nvme_path=DIR and host_budget to at least [\d.]+ MB \(what stays on the host "
                                         r"with the disk: its I/O buffers too\)$"):
        _fit(L2LOffloadStrategy(host_budget="1MB"))


def test_what_the_tier_cannot_do_is_refused_before_any_work(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^strategy.nvme_path with delayed_update=True is not supported"):
        L2LOffloadStrategy(nvme_path=str(tmp_path), delayed_update=True)
    with pytest.raises(TypeError, match=r"^strategy.nvme_path=3 is not a path"):
        L2LOffloadStrategy(nvme_path=3)  # type: ignore[arg-type]

    class Two(Task):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch: Any, batch_idx: int) -> None:
            raise AssertionError("refused before the first step")

        def configure_optimizers(self) -> Any:
            return [ADAMW(self.net.blocks.parameters()), ADAMW(self.net.post.parameters())]

    with pytest.raises(ValueError, match=r"steps the host parameters of one optimizer through its buffers, but "
                                         r"configure_optimizers returned 2"):
        _fit(L2LOffloadStrategy(nvme_path=str(tmp_path)), task=Two)

    class Mine(torch.optim.AdamW):
        pass

    with pytest.raises(ValueError, match=r"a per-parameter optimizer, not Mine; use one of SGD, Adam, AdamW"):
        _fit(L2LOffloadStrategy(nvme_path=str(tmp_path)), task=functools.partial(Task, functools.partial(Mine, lr=1e-3)))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(PREFIX)]
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("overlap", [False, True], ids=["after", "overlapped"])
def test_a_streamed_resident_unit_goes_to_disk_too(tmp_path: Path, overlap: bool, caplog: pytest.LogCaptureFixture,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # every unit, the resident one (embedding, head: 0.49 MB of bf16 shadows, fp32 masters and AdamW state) too, stepped in
    # chunks of 256 KiB (a test's chunk: below the least a user may give, so that this small model's units are cut)
    monkeypatch.setattr(tier_plan_module, "MIN_CHUNK", 64 << 10)
    in_memory = _fit(L2LOffloadStrategy(offload_resident=True, overlap_step=overlap), "bf16-mixed")
    with caplog.at_level("INFO"):
        tiered = _fit(L2LOffloadStrategy(offload_resident=True, overlap_step=overlap, nvme_path=str(tmp_path), nvme_chunk="256KiB"),
                      "bf16-mixed")
    _assert_same(in_memory, tiered)
    assert "optimizer state of 4/4 units, fp32 masters of 4/4" in caplog.text
    # the resident unit's weights too are read through the tier, once a step (held from the forward to the step), into a
    # buffer of its own; every unit's step through three buffers of 256 KiB, the resident unit's through one more
    plan, stats = tiered[1].strategy._tier_plan, tiered[1].strategy.offload_stats
    assert plan.units[-1].compute_reads == 1 and plan.compute_span(3) > 0 and plan.step_span(3) > 256 << 10
    assert plan.step_buffer == 256 << 10 and plan.buffer_bytes == 4 * (256 << 10) + 3 * plan.weight_buffer + plan.compute_span(3)
    assert stats.nvme_read_bytes == 3 * plan.step_read_bytes
    if overlap:  # blocks step as their gradients land: at most 4 units' gradients counted (the resident's always)
        assert tiered[1].strategy._tier_plan.grads_in_flight == 4


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_tier_streams_through_pinned_buffers_and_equals_the_run_in_memory(tmp_path: Path) -> None:
    def fit(strategy: L2LOffloadStrategy) -> tuple[Task, pl.Trainer]:
        torch.manual_seed(0)
        module = Task()
        trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=strategy, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, max_steps=4,
                             plugins=[OffloadPrecision("bf16-mixed")])
        trainer.fit(module, _data())
        return module, trainer

    in_memory = fit(L2LOffloadStrategy())
    tiered = fit(L2LOffloadStrategy(nvme_path=str(tmp_path)))
    _assert_same(in_memory, tiered)
    assert tiered[1].strategy.offload_stats.nvme_read_bytes > 0


@pytest.mark.parametrize("case", ["finetune", "refreeze", "pruning"])
def test_parameters_that_change_during_fit_are_laid_out_again(tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture) -> None:
    # unfrozen at epoch 1 (a new param group), frozen again at epoch 2, pruned (weights replaced, masks added): the tier
    # plans and writes its files again from the parameters and state as they are, and trains as plain Lightning
    want, got = Transfer(foreach=False), Transfer(foreach=False)
    fit_case(case, want, DataLoader(data(), batch_size=PER_RANK_BATCH))
    with caplog.at_level("INFO"):
        fit_case(case, got, DataLoader(data(), batch_size=PER_RANK_BATCH), lambda: L2LOffloadStrategy(nvme_path=str(tmp_path)))
    expected = weights(want)
    for name, value in weights(got).items():
        assert torch.equal(value.to(expected[name].dtype), expected[name]), name
    assert "the trained parameters changed; NVMe tier: host" in caplog.text
    assert not list(tmp_path.iterdir())


def test_a_resident_unit_the_device_cannot_hold_is_streamed_by_the_plan_and_trains_as_the_run_in_memory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # the device's memory as the strategy reads it on CUDA (its total), here a CPU device told it has 4 MB: the resident
    # unit (a 4096-token embedding tied to the head, 8.5 MB with its gradients and AdamW state) would not fit, so the plan
    # streams it, says why on its line, and the run is the one in memory with the unit kept
    from lightning_accel.strategies.l2l_offload_tier import L2LTierSetup

    task = functools.partial(Task, ADAMW, False, 3, 4096)
    in_memory = _fit(L2LOffloadStrategy(), task=task)
    monkeypatch.setattr(L2LTierSetup, "_device_memory", lambda self: 4_000_000)
    with caplog.at_level("INFO"):
        tiered = _fit(L2LOffloadStrategy(nvme_path=str(tmp_path)), task=task)
    _assert_same(in_memory, tiered)
    assert tiered[1].strategy._tier_plan.held == 1 and "resident unit of 526,592 parameters (streamed)" in caplog.text
    assert "for the device: the plan streamed the resident unit (8." in caplog.text and "over the device's 4.00 MB)" in caplog.text
    with pytest.raises(ValueError, match=r"^L2LOffloadStrategy: offload_resident=False keeps the resident unit on the device"):
        _fit(L2LOffloadStrategy(nvme_path=str(tmp_path), offload_resident=False), task=task)
