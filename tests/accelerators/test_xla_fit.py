"""Training on the CPU PJRT device against the same training on plain CPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.xla

STEPS = 40  # 2.5 epochs of 16 steps: first steps, first validation, an epoch end, and steady state


def test_fp32_loss_trajectory_matches_cpu(xla) -> None:
    cpu, _ = xla.fit("cpu", STEPS)
    dev, trainer = xla.fit("xla_pjrt", STEPS)
    assert trainer.strategy.root_device.type == "xla"
    assert set(dev.step_devices) == {"xla"}
    # XLA fuses and reorders fp32 arithmetic, so the runs differ by rounding that Adam
    # carries forward: stated tolerance 1e-4 relative / 1e-5 absolute over 40 steps.
    torch.testing.assert_close(xla.losses(dev), xla.losses(cpu), rtol=1e-4, atol=1e-5)
    assert xla.losses(dev)[-8:].mean() < 0.5 * xla.losses(dev)[:4].mean()  # it learned


def test_compile_count_flat_after_warmup(xla) -> None:
    # batch_size 8: shapes no other test uses, so these graphs are new to the process's cache
    _, trainer = xla.fit("xla_pjrt", 96, batch_size=8)  # 3 epochs of 32 steps, validation every 10
    counts = trainer.strategy.compilations.counts
    assert len(counts) == 96
    assert counts[0] >= 1  # the first step compiled its graph
    # Warm-up (first step, steady step, first validation, first epoch end) is over after
    # step 33; steps 34-95 (6 validations, an epoch end, a falling learning rate) compile
    # nothing new. (The final step adds one graph: Lightning's end-of-fit bookkeeping.)
    assert counts[94] == counts[32], counts
    assert counts[-1] <= 8, counts
    assert "stable" in trainer.strategy.compilations.summary()


def test_gradient_accumulation_matches_cpu(xla) -> None:
    # validation every 8 batches: always between optimizer steps, never mid-accumulation
    cpu, cpu_trainer = xla.fit("cpu", 12, accumulate_grad_batches=4, val_check_interval=8)
    dev, trainer = xla.fit("xla_pjrt", 12, accumulate_grad_batches=4, val_check_interval=8)
    assert trainer.global_step == cpu_trainer.global_step == 12
    assert len(dev.losses) == 48  # 4 micro-batches per optimizer step
    torch.testing.assert_close(xla.losses(dev), xla.losses(cpu), rtol=1e-4, atol=1e-5)
    counts = trainer.strategy.compilations.counts
    assert counts[10] == counts[4], counts  # after the first epoch (4 steps) and validation, nothing new


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_trains_close_to_fp32(xla, precision: str) -> None:
    fp32, _ = xla.fit("cpu", STEPS)
    dev, trainer = xla.fit("xla_pjrt", STEPS, precision=precision)
    assert trainer.strategy.precision_plugin.precision == precision
    if precision == "bf16-true":
        assert next(dev.parameters()).dtype == torch.bfloat16
    else:
        assert next(dev.parameters()).dtype == torch.float32
    # bf16 keeps 8 bits of mantissa (~0.4% per rounding): the trajectory follows fp32
    # loosely, and the loss still falls.
    torch.testing.assert_close(xla.losses(dev), xla.losses(fp32), rtol=0.1, atol=0.02)
    assert xla.losses(dev)[-8:].mean() < 0.5 * xla.losses(dev)[:4].mean()


def test_fp16_is_refused_with_the_bf16_hint(xla) -> None:
    with pytest.raises(ValueError, match="precision='16-mixed' is not supported on XLA.*bf16-mixed"):
        xla.fit("xla_pjrt", 2, precision="16-mixed")


def test_device_prefetcher_uses_mp_device_loader(xla) -> None:
    from torch_xla.distributed.parallel_loader import MpDeviceLoader

    from lightning_accel.callbacks import DevicePrefetcher

    prefetcher = DevicePrefetcher()
    plain, _ = xla.fit("xla_pjrt", 20)
    dev, trainer = xla.fit("xla_pjrt", 20, callbacks=[prefetcher])
    assert prefetcher.active, prefetcher.message
    assert "MpDeviceLoader" in prefetcher.message
    assert isinstance(trainer.fit_loop._combined_loader.flattened[0], MpDeviceLoader)
    # Batches reach Lightning already on the XLA device (without the callback: on the host).
    assert set(dev.batch_devices) == {"xla"} and len(dev.batch_devices) == 20
    assert set(plain.batch_devices) == {"cpu"}
    torch.testing.assert_close(xla.losses(dev), xla.losses(plain), rtol=1e-5, atol=1e-6)


def test_checkpoint_through_any_checkpoint_io_lands_on_host(xla, tmp_path) -> None:
    from lightning_accel.plugins.io.atomic import AtomicCheckpointIO

    path = tmp_path / "last.ckpt"
    dev, trainer = xla.fit("xla_pjrt", 5, plugins=[AtomicCheckpointIO()])
    trainer.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["state_dict"]
    assert {t.device.type for t in state.values()} == {"cpu"}
    torch.testing.assert_close(state["net.0.weight"], dev.net[0].weight.cpu())


def test_more_devices_than_one_is_refused(xla) -> None:
    import lightning.pytorch as pl

    with pytest.raises(ValueError, match="devices=2 but the PJRT runtime has 1 device.*CPU_NUM_DEVICES"):
        pl.Trainer(accelerator="xla_pjrt", strategy="xla_pjrt", devices=2)
