"""L2LOffloadStrategy inside a real Trainer: same weights as plain Lightning training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.callbacks.offload_monitor import OffloadMonitor
from lightning_accel.models import GPT, LanguageModelTask
from lightning_accel.plugins.precision import OffloadPrecision
from lightning_accel.strategies.l2l_offload import L2LOffloadStrategy


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.relu(self.a(x)))


class Regressor(pl.LightningModule):
    """A model built here: blocks in a dict of lists, called by hand, SGD with momentum + StepLR."""

    def __init__(self, depth: int = 4, width: int = 8, lr: float = 0.05) -> None:
        super().__init__()
        self.inp = nn.Linear(3, width)
        self.stack = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, 1)
        self.lr = lr

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.stack:
            h = block(h)
        return self.out(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=1e-3)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5), "interval": "step"}}


def _regression_data(n: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8)


def _lm_data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (48, 17), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)


def _fit(model: pl.LightningModule, data: DataLoader, strategy: Any = "auto", **trainer_kwargs: Any) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, **{"max_steps": 6, **trainer_kwargs},
    )
    trainer.fit(model, data)
    return trainer


def _assert_same_weights(a: nn.Module, b: nn.Module, atol: float = 1e-6) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()  # the user's parameter names, unchanged
    for name in sa:
        torch.testing.assert_close(sb[name].cpu(), sa[name].cpu(), rtol=0, atol=atol, msg=name)


def _pair(factory: Any) -> tuple[pl.LightningModule, pl.LightningModule]:
    torch.manual_seed(0)
    plain = factory()
    offloaded = factory()
    offloaded.load_state_dict(plain.state_dict())
    return plain, offloaded


@pytest.mark.parametrize("trainer_kwargs", [{}, {"accumulate_grad_batches": 3}, {"gradient_clip_val": 0.05}],
                         ids=["plain", "accumulate", "clip"])
def test_custom_model_matches_plain_training(trainer_kwargs: dict[str, Any]) -> None:
    plain, offloaded = _pair(Regressor)
    initial = {k: v.clone() for k, v in plain.state_dict().items()}
    _fit(plain, _regression_data(), **trainer_kwargs)
    trainer = _fit(offloaded, _regression_data(), L2LOffloadStrategy(blocks=["Block"], overlap_step=True), **trainer_kwargs)
    _assert_same_weights(plain, offloaded)
    # the host step overlaps the backward unless clipping needs every gradient first
    stepped = trainer.strategy.offload_stats.blocks_stepped_in_backward
    assert stepped == (0 if "gradient_clip_val" in trainer_kwargs else 4 * trainer.global_step)
    # guard against an offload that silently does not train
    assert all(not torch.equal(initial[k], v) for k, v in offloaded.state_dict().items())


@pytest.mark.parametrize("overlap_step", [True, False])
def test_zoo_gpt_matches_plain_training(overlap_step: bool) -> None:
    plain, offloaded = _pair(lambda: LanguageModelTask(GPT("tiny", n_layer=3, block_size=16)))
    _fit(plain, _lm_data())
    trainer = _fit(offloaded, _lm_data(), L2LOffloadStrategy(prefetch_blocks=1, overlap_step=overlap_step))
    _assert_same_weights(plain, offloaded, atol=2e-6)
    assert trainer.strategy.offload_stats.blocks_stepped_in_backward == (18 if overlap_step else 0)
    assert trainer.strategy.offload_stats.steps == 6
    assert trainer.strategy.offload_stats.peak_resident_blocks <= 2


def test_registered_name_and_offload_of_the_resident_unit() -> None:
    plain, offloaded = _pair(Regressor)
    _fit(plain, _regression_data())
    trainer = _fit(offloaded, _regression_data(), "l2l_offload")
    assert isinstance(trainer.strategy, L2LOffloadStrategy)
    _assert_same_weights(plain, offloaded)
    # on a CPU "device" the host step would compete with the compute: no overlap by default
    assert trainer.strategy.offload_stats.blocks_stepped_in_backward == 0
    plain, offloaded = _pair(Regressor)
    _fit(plain, _regression_data())
    _fit(offloaded, _regression_data(), L2LOffloadStrategy(offload_resident=True))
    _assert_same_weights(plain, offloaded)


def test_resume_from_checkpoint_equals_uninterrupted(tmp_path: Path) -> None:
    # Stop at an epoch boundary (a checkpoint taken when max_steps cuts an epoch short
    # resumes differently under plain Lightning too), then train the second epoch.
    plain, first = _pair(Regressor)
    _fit(plain, _regression_data(), max_steps=-1, max_epochs=2)
    trainer = _fit(first, _regression_data(), L2LOffloadStrategy(), max_steps=-1, max_epochs=1)
    ckpt = tmp_path / "half.ckpt"
    trainer.save_checkpoint(ckpt)
    # the checkpoint is a normal Lightning checkpoint: plain names, loadable without our strategy
    state = torch.load(ckpt, weights_only=False)
    assert set(state["state_dict"]) == set(plain.state_dict())
    assert all(t.device.type == "cpu" for t in state["optimizer_states"][0]["state"][0].values() if torch.is_tensor(t))
    resumed = Regressor()
    trainer = pl.Trainer(accelerator="cpu", strategy=L2LOffloadStrategy(), max_epochs=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(resumed, _regression_data(), ckpt_path=ckpt)
    _assert_same_weights(plain, resumed)
    # and a plain Trainer resumes the same checkpoint to the same place
    again = Regressor()
    plain_resume = pl.Trainer(accelerator="cpu", max_epochs=2, logger=False, enable_checkpointing=False,
                              enable_progress_bar=False, enable_model_summary=False)
    plain_resume.fit(again, _regression_data(), ckpt_path=ckpt)
    _assert_same_weights(plain, again)


def test_bf16_offload_on_cpu_tracks_plain_bf16_and_moves_half_the_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    plain, offloaded = _pair(lambda: LanguageModelTask(GPT("tiny", n_layer=2, block_size=16)))
    _fit(plain, _lm_data(), precision="bf16-mixed", max_steps=4)
    trainer = _fit(offloaded, _lm_data(), L2LOffloadStrategy(), plugins=[OffloadPrecision("bf16-mixed")],
                   max_steps=4, callbacks=[OffloadMonitor()])
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(offloaded.state_dict()[name], value, rtol=0, atol=2e-2, msg=name)
    stats = trainer.strategy.offload_stats
    matrices = sum(p.numel() for p in offloaded.net.blocks.parameters() if p.ndim >= 2)
    vectors = sum(p.numel() for p in offloaded.net.blocks.parameters() if p.ndim < 2)
    # weight matrices travel as bf16 (2 bytes), biases and norm scales as fp32 (4 bytes),
    # twice a step (forward and recompute); gradients come back in the dtype they were made in
    assert stats.h2d_bytes_per_step == 2 * (2 * matrices + 4 * vectors)
    assert stats.d2h_bytes_per_step == 2 * matrices + 4 * vectors
    assert "L2L offload: 4 steps" in capsys.readouterr().out


def test_fp16_overflow_skips_the_step_and_lowers_the_scale() -> None:
    torch.manual_seed(0)
    model = Regressor()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plugin = OffloadPrecision("16-mixed", init_scale=2.0**60)  # the scaled fp16 gradients overflow
    _fit(model, _regression_data(), L2LOffloadStrategy(), plugins=[plugin], max_steps=1)
    assert plugin.scaler is not None and plugin.scaler.get_scale() == 2.0**59
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), f"{name} moved although the step overflowed"
    # with a sane scale it trains
    plugin = OffloadPrecision("16-mixed", init_scale=2.0**8)
    _fit(model, _regression_data(), L2LOffloadStrategy(), plugins=[plugin], max_steps=2)
    assert not torch.equal(model.state_dict()["stack.0.a.weight"], before["stack.0.a.weight"])


def test_unsupported_precision_is_refused_before_training() -> None:
    with pytest.raises(ValueError, match=r"does not support the precision plugin MixedPrecision.*HINT: pass plugins=\[OffloadPrecision"):
        _fit(Regressor(), _regression_data(), L2LOffloadStrategy(), precision="bf16-mixed")
    with pytest.raises(ValueError, match=r"OffloadPrecision does not support precision='64-true'"):
        OffloadPrecision("64-true")  # type: ignore[arg-type]


def test_model_without_blocks_is_refused() -> None:
    class Flat(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.stack = nn.ModuleList()

    with pytest.raises(ValueError, match=r"L2LOffloadStrategy: no blocks found in Flat under 'auto'"):
        _fit(Flat(), _regression_data(), L2LOffloadStrategy())


def test_optimizer_that_cannot_run_on_the_host_is_refused() -> None:
    class WithLBFGS(Regressor):
        def configure_optimizers(self) -> Any:
            return torch.optim.LBFGS(self.parameters())

    with pytest.raises(ValueError, match=r"cannot run LBFGS on the host.*HINT: use a per-parameter optimizer"):
        _fit(WithLBFGS(), _regression_data(), L2LOffloadStrategy())

    class Fused(Regressor):
        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), fused=True)

    with pytest.raises(ValueError, match=r"Adam\(fused=True\) needs CUDA parameters; HINT: set fused=False"):
        _fit(Fused(), _regression_data(), L2LOffloadStrategy())


def test_bad_prefetch_depth() -> None:
    with pytest.raises(ValueError, match=r"prefetch_blocks must be >= 0, got -2"):
        L2LOffloadStrategy(prefetch_blocks=-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_offload_trains_with_flat_peak_memory() -> None:
    peaks = []
    for layers in (4, 12):
        torch.cuda.reset_peak_memory_stats()
        model = LanguageModelTask(GPT("tiny", n_layer=layers, n_embd=256, n_head=4, block_size=16))
        trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=L2LOffloadStrategy(), plugins=[OffloadPrecision("bf16-mixed")],
                             max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False)
        trainer.fit(model, _lm_data())
        peaks.append(trainer.strategy.offload_stats.peak_device_bytes)
        assert trainer.strategy.offload_stats.peak_resident_blocks <= 2
        assert all(p.device.type == "cpu" for p in model.net.blocks.parameters())
    assert peaks[0] == peaks[1]


def test_xla_devices_are_refused_with_the_reason() -> None:
    # torch.device("xla:0") needs no torch_xla; the refusal comes before anything touches it
    with pytest.raises(ValueError, match=r"L2LOffloadStrategy does not run on XLA devices.*HINT: on a TPU use strategy='xla_pjrt'"):
        _fit(Regressor(), _regression_data(), L2LOffloadStrategy(device="xla:0"))
