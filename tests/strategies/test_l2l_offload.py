"""L2LOffloadStrategy inside a real Trainer: same weights as plain Lightning training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
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


# LanguageModelTask's AdamW leaves foreach/fused unset: under l2l_offload its host parameters
# step on torch's fused CPU kernel, under plain Lightning on torch's per-tensor loop. Same
# math, different rounding: measured 7e-6 apart after 6 steps between two plain runs, one
# with fused=True (l2l_offload equals that one exactly; see test_l2l_host_step.py).
FUSED_VS_LOOP_ATOL = 2e-5


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
    _assert_same_weights(plain, offloaded, atol=FUSED_VS_LOOP_ATOL)
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


def test_bf16_offload_on_cpu_tracks_plain_bf16_and_moves_half_the_bytes(caplog: pytest.LogCaptureFixture) -> None:
    plain, offloaded = _pair(lambda: LanguageModelTask(GPT("tiny", n_layer=2, block_size=16)))
    _fit(plain, _lm_data(), precision="bf16-mixed", max_steps=4)
    trainer = _fit(offloaded, _lm_data(), L2LOffloadStrategy(), plugins=[OffloadPrecision("bf16-mixed")],
                   max_steps=4, callbacks=[OffloadMonitor()])
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(offloaded.state_dict()[name], value, rtol=0, atol=2e-2, msg=name)
    stats = trainer.strategy.offload_stats
    def nbytes(module: torch.nn.Module) -> int:  # matrices as bf16 (2 bytes), biases and norm scales as fp32 (4)
        return sum((2 if p.ndim >= 2 else 4) * p.numel() for p in module.parameters())

    blocks, last = offloaded.net.blocks, offloaded.net.blocks[-1]
    # twice a step (forward and recompute), except the last block, which stays on the device for
    # its backward; gradients come back in the dtype they were made in
    assert stats.h2d_bytes_per_step == 2 * nbytes(blocks) - nbytes(last)
    assert stats.d2h_bytes_per_step == nbytes(blocks)
    assert "L2L offload: 4 steps" in caplog.text  # OffloadMonitor says it through rank_zero_info


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


@pytest.mark.parametrize("lightning", [{"precision": "bf16-mixed"}, {"plugins": [MixedPrecision("bf16-mixed", "cpu")]}],
                         ids=["flag", "plugin"])
def test_lightning_mixed_precision_trains_as_the_offload_plugin(lightning: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    ours, theirs = Regressor(), Regressor()
    theirs.load_state_dict(ours.state_dict())
    _fit(ours, _regression_data(), L2LOffloadStrategy(), plugins=[OffloadPrecision("bf16-mixed")], max_steps=3)
    with caplog.at_level("INFO"):
        trainer = _fit(theirs, _regression_data(), L2LOffloadStrategy(), max_steps=3, **lightning)
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, OffloadPrecision) and plugin.precision == "bf16-mixed"
    _assert_same_weights(ours, theirs, atol=0)
    said = [r.getMessage() for r in caplog.records if "runs as OffloadPrecision" in r.getMessage()]
    assert said == ["strategy='l2l_offload': precision='bf16-mixed' runs as OffloadPrecision('bf16-mixed') "
                    "(fp32 masters on the host, device copies in bfloat16)"]


def test_lightning_fp16_keeps_its_initial_scale() -> None:
    # Lightning's MixedPrecision('16-mixed') with its GradScaler: the offload plugin starts from the same scale,
    # here one so high that the first step overflows, is skipped and halves it, as OffloadPrecision's does
    torch.manual_seed(0)
    model = Regressor()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**60)
    trainer = _fit(model, _regression_data(), L2LOffloadStrategy(), plugins=[MixedPrecision("16-mixed", "cpu", scaler)], max_steps=1)
    plugin = trainer.strategy.precision_plugin
    assert isinstance(plugin, OffloadPrecision) and plugin.precision == "16-mixed"
    assert plugin.scaler is not None and plugin.scaler.get_scale() == 2.0**59
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), f"{name} moved although the step overflowed"


@pytest.mark.parametrize("strategy", ["l2l_offload", "l2l_offload_ddp"])
@pytest.mark.parametrize(("precision", "kind"), [("bf16-true", "HalfPrecision"), ("16-true", "HalfPrecision"),
                                                 ("64-true", "DoublePrecision")])
def test_precision_offload_cannot_honour_is_refused_when_the_trainer_is_built(strategy: str, precision: str, kind: str) -> None:
    with pytest.raises(ValueError, match=rf"^precision='{precision}' \({kind}\): strategy='{strategy}' keeps fp32 masters on the "
                                         r"host .*; use precision='bf16-mixed', '16-mixed' or '32-true'"):
        pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, precision=precision, logger=False)


def test_a_loss_scaler_other_than_torchs_is_refused() -> None:
    class OwnScaler:  # a scaler offload's host step would not know how to drive
        pass

    with pytest.raises(ValueError, match=r"^precision='16-mixed' with a OwnScaler loss scaler: strategy='l2l_offload' scales with "
                                         r"torch.amp.GradScaler only; pass plugins=\[OffloadPrecision\('16-mixed', init_scale=...\)\]"):
        pl.Trainer(accelerator="cpu", strategy=L2LOffloadStrategy(), plugins=[MixedPrecision("16-mixed", "cpu", OwnScaler())])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"OffloadPrecision does not support precision='64-true'"):
        OffloadPrecision("64-true")  # type: ignore[arg-type]


def test_model_without_blocks_is_refused() -> None:
    class Flat(Regressor):  # every parameter its own: no child to stream
        def __init__(self) -> None:
            super().__init__()
            self.inp = self.stack = self.out = None
            self.w = nn.Parameter(torch.zeros(3, 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.w

    with pytest.raises(ValueError, match=r"L2LOffloadStrategy: no blocks found in Flat under 'auto' \(.*else each child with "
                                         r"parameters\); candidates: none"):
        _fit(Flat(), _regression_data(), L2LOffloadStrategy())


def test_optimizer_that_cannot_run_on_the_host_is_refused() -> None:
    class WithLBFGS(Regressor):
        def configure_optimizers(self) -> Any:
            return torch.optim.LBFGS(self.parameters())

    with pytest.raises(ValueError, match=r"cannot run LBFGS on the host.*; use a per-parameter optimizer"):
        _fit(WithLBFGS(), _regression_data(), L2LOffloadStrategy())

    class Capturable(Regressor):
        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), capturable=True)

    with pytest.raises(ValueError, match=r"Adam\(capturable=True\) is for CUDA-graph capture.*; set capturable=False"):
        _fit(Capturable(), _regression_data(), L2LOffloadStrategy())


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
    with pytest.raises(ValueError, match=r"L2LOffloadStrategy does not run on XLA devices.*; on a TPU use strategy='xla_pjrt'"):
        _fit(Regressor(), _regression_data(), L2LOffloadStrategy(device="xla:0"))


# -- one-step delayed update (ZeRO-Offload DPU) and activation offload -------------------


class AdamRegressor(Regressor):
    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.01, weight_decay=1e-3)


def _sgd_step_lr(params: list[nn.Parameter]) -> tuple[torch.optim.Optimizer, Any]:
    opt = torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)
    return opt, torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)


def _adam(params: list[nn.Parameter]) -> tuple[torch.optim.Optimizer, Any]:
    return torch.optim.Adam(params, lr=0.01, weight_decay=1e-3), None


def _delayed_reference(model: nn.Module, data: DataLoader, optimizer: Any, late: set[str], steps: int, warmup: int = 0,
                       accumulate: int = 1, clip: float | None = None, land_after: tuple[int, ...] = (),
                       autocast: torch.dtype | None = None) -> None:
    """ZeRO-Offload's delayed update written out in plain PyTorch, one optimizer (and LR
    scheduler) per parameter set. Step t's gradient is taken at the current weights; then
    the ``late`` parameters receive update t-1 and the others update t. Update t of the late
    ones waits for step t+1, except during the first ``warmup`` steps and after the steps in
    ``land_after`` (validation, checkpoint); the last one lands at the end. ``autocast``:
    each forward under CPU autocast in that dtype (entered per forward: autocast caches its
    weight casts until the context exits)."""
    params = dict(model.named_parameters())
    sets = {True: [p for n, p in params.items() if n in late], False: [p for n, p in params.items() if n not in late]}
    pairs = {k: optimizer(v) if v else None for k, v in sets.items()}

    def apply(is_late: bool, grads: dict[nn.Parameter, torch.Tensor]) -> None:
        pair = pairs[is_late]
        if pair is None:
            return
        for p in sets[is_late]:
            p.grad = grads[p]
        pair[0].step()
        if pair[1] is not None:
            pair[1].step()

    batches = [b for _, b in zip(range(steps * accumulate), (b for _ in range(99) for b in data))]
    pending = None
    for t in range(steps):
        grads = {p: torch.zeros_like(p) for p in params.values()}
        for x, y in batches[t * accumulate:(t + 1) * accumulate]:
            with torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None):
                loss = nn.functional.mse_loss(model(x), y) / accumulate
            for p, g in zip(params.values(), torch.autograd.grad(loss, list(params.values()))):
                grads[p] += g
        if clip is not None:  # by the global norm of step t's gradients, before any of it is applied
            norm = torch.stack([g.norm() for g in grads.values()]).norm()
            grads = {p: g * min(1.0, clip / (float(norm) + 1e-6)) for p, g in grads.items()}
        if pending is not None:
            apply(True, pending)
        apply(False, grads)
        pending = grads
        if t < warmup or t in land_after:
            apply(True, pending)
            pending = None
    if pending is not None:
        apply(True, pending)


def _double_data(n: int = 64, batch: int = 8) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, generator=g, dtype=torch.float64)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=batch)


_BLOCKS = {f"stack.{i}.{m}.{w}" for i in range(4) for m in "ab" for w in ("weight", "bias")}
_ALL = _BLOCKS | {f"{m}.{w}" for m in ("inp", "out") for w in ("weight", "bias")}

_DELAYED_CASES = {
    # name: (module, reference optimizer, strategy kwargs, trainer kwargs, reference kwargs, dtype)
    "sgd-all-host": (Regressor, _sgd_step_lr, {"offload_resident": True}, {}, {"late": _ALL}, torch.float64),
    "sgd-warmup": (Regressor, _sgd_step_lr, {"delayed_update_warmup": 2}, {}, {"late": _BLOCKS, "warmup": 2}, torch.float64),
    "sgd-warmup-overlapped": (Regressor, _sgd_step_lr, {"delayed_update_warmup": 2, "overlap_step": True}, {},
                              {"late": _BLOCKS, "warmup": 2}, torch.float64),
    "adam": (AdamRegressor, _adam, {}, {}, {"late": _BLOCKS}, torch.float64),
    "adam-fp32": (AdamRegressor, _adam, {"offload_resident": True}, {}, {"late": _ALL}, torch.float32),
    "accumulate": (Regressor, _sgd_step_lr, {}, {"accumulate_grad_batches": 4}, {"late": _BLOCKS, "accumulate": 4},
                   torch.float64),
    "clip": (Regressor, _sgd_step_lr, {}, {"gradient_clip_val": 0.05}, {"late": _BLOCKS, "clip": 0.05}, torch.float64),
    "activations": (AdamRegressor, _adam, {"offload_activations": True}, {}, {"late": _BLOCKS}, torch.float64),
    # bf16 device copies (really copied, from bf16 shadows and fp32 snapshots) over fp32 masters
    "bf16": (Regressor, _sgd_step_lr, {}, {"plugins": [OffloadPrecision("bf16-mixed")]},
             {"late": _BLOCKS, "autocast": torch.bfloat16}, torch.float32),
}


@pytest.mark.parametrize("case", list(_DELAYED_CASES))
def test_delayed_update_matches_a_hand_written_delayed_loop(case: str) -> None:
    module, optimizer, strategy_kwargs, trainer_kwargs, reference_kwargs, dtype = _DELAYED_CASES[case]
    torch.manual_seed(0)
    lit = module().to(dtype)
    reference, undelayed = module().to(dtype), module().to(dtype)
    reference.load_state_dict(lit.state_dict())
    undelayed.load_state_dict(lit.state_dict())
    data = _double_data() if dtype == torch.float64 else _regression_data()
    steps = 4
    strategy_kwargs = {"delayed_update_warmup": 0, **strategy_kwargs}
    trainer = _fit(lit, data, L2LOffloadStrategy(blocks=["Block"], delayed_update=True, **strategy_kwargs),
                   max_steps=steps, **trainer_kwargs)
    _delayed_reference(reference, data, optimizer, steps=steps, **reference_kwargs)
    _assert_same_weights(reference, lit, atol=1e-12 if dtype == torch.float64 else 1e-6)
    stats = trainer.strategy.offload_stats
    assert stats.delayed_steps == steps - reference_kwargs.get("warmup", 0)
    # the delay is real: the same loop updating at once ends elsewhere
    _delayed_reference(undelayed, data, optimizer, steps=steps, **{**reference_kwargs, "warmup": steps})
    assert any((a - b).abs().max() > 1e-6 for a, b in zip(undelayed.state_dict().values(), reference.state_dict().values()))
    if strategy_kwargs.get("offload_activations"):
        # one (batch 8, width 8) float64 input per block per micro-batch, out and back
        assert stats.activation_d2h_bytes == stats.activation_h2d_bytes == steps * 4 * 8 * 8 * 8


class Validated(Regressor):
    """Records, at each validation, the weights it validates."""

    def __init__(self) -> None:
        super().__init__()
        self.validated: list[dict[str, torch.Tensor]] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 0:
            self.validated.append({k: v.clone() for k, v in self.state_dict().items()})
        self.log("val_loss", nn.functional.mse_loss(self(batch[0]), batch[1]))


def test_delayed_update_lands_before_validation_and_checkpoints_and_resumes_exactly(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    def trainer(epochs: int, **kwargs: Any) -> pl.Trainer:
        return pl.Trainer(accelerator="cpu", devices=1, strategy=L2LOffloadStrategy(delayed_update=True, delayed_update_warmup=2),
                          max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
                          num_sanity_val_steps=0, **kwargs)

    def models(n: int) -> list[Validated]:
        torch.manual_seed(0)
        out = [Validated().double() for _ in range(n)]
        for m in out[1:]:
            m.load_state_dict(out[0].state_dict())
        return out

    data, val = _double_data(), _double_data(16)
    # A: 2 epochs of 8 steps, validated after each, ModelCheckpoint saving right after validation
    whole, reference, first_epoch = models(3)
    trainer(2, callbacks=[ModelCheckpoint(dirpath=tmp_path / "a", save_top_k=-1, every_n_epochs=1)]).fit(whole, data, val)
    _delayed_reference(reference, data, _sgd_step_lr, _BLOCKS, steps=16, warmup=2, land_after=(7,))
    _assert_same_weights(reference, whole, atol=1e-12)
    # validation, and the checkpoint after it, saw every update of the first 8 steps
    _delayed_reference(first_epoch, data, _sgd_step_lr, _BLOCKS, steps=8, warmup=2)
    ckpt = tmp_path / "a" / "epoch=0-step=8.ckpt"
    saved = torch.load(ckpt, weights_only=False)["state_dict"]
    for name, value in first_epoch.state_dict().items():
        torch.testing.assert_close(whole.validated[0][name], value, rtol=0, atol=1e-12, msg=name)
        torch.testing.assert_close(saved[name], value, rtol=0, atol=1e-12, msg=name)
    # resuming from that checkpoint continues exactly like the uninterrupted run (no second warm-up)
    resumed, = models(1)
    trainer(2, enable_checkpointing=False).fit(resumed, data, val, ckpt_path=ckpt)
    _assert_same_weights(whole, resumed, atol=0)
    # B: no validation, a checkpoint every 5 steps: each save lands the pending update too
    saving, reference = models(2)
    trainer(2, limit_val_batches=0, callbacks=[ModelCheckpoint(dirpath=tmp_path / "b", save_top_k=-1, every_n_train_steps=5)]
            ).fit(saving, data)
    _delayed_reference(reference, data, _sgd_step_lr, _BLOCKS, steps=16, warmup=2, land_after=(4, 9, 14))
    _assert_same_weights(reference, saving, atol=1e-12)
    five, = models(1)
    _delayed_reference(five, data, _sgd_step_lr, _BLOCKS, steps=5, warmup=2)
    saved = torch.load(tmp_path / "b" / "epoch=0-step=5.ckpt", weights_only=False)["state_dict"]
    for name, value in five.state_dict().items():
        torch.testing.assert_close(saved[name], value, rtol=0, atol=1e-12, msg=name)


def test_activation_offload_matches_plain_training_and_counts_the_boundary_bytes(caplog: pytest.LogCaptureFixture) -> None:
    plain, offloaded = _pair(lambda: LanguageModelTask(GPT("tiny", n_layer=2, block_size=16)))
    _fit(plain, _lm_data(), max_steps=4)
    trainer = _fit(offloaded, _lm_data(), L2LOffloadStrategy(offload_activations=True), max_steps=4,
                   callbacks=[OffloadMonitor()])
    _assert_same_weights(plain, offloaded, atol=FUSED_VS_LOOP_ATOL)
    stats = trainer.strategy.offload_stats
    # each block's input, (batch 8, seq 16, n_embd 128) fp32, goes to the host and comes back once a step
    boundary = 2 * 8 * 16 * 128 * 4
    assert stats.activation_d2h_bytes_per_step == boundary
    assert stats.activation_d2h_bytes == stats.activation_h2d_bytes == 4 * boundary
    assert stats.as_metrics()["offload/activation_d2h_bytes_per_step"] == boundary
    assert "0.000 GiB of boundary activations parked on the host per step" in caplog.text


def test_delayed_update_and_activation_offload_refuse_what_they_cannot_do() -> None:
    started: list[int] = []

    class Counting(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            started.append(batch_idx)
            return super().training_step(batch, batch_idx)

    with pytest.raises(ValueError, match=r"delayed_update_warmup=3 has no effect with delayed_update=False; set delayed_update=True"):
        L2LOffloadStrategy(delayed_update_warmup=3)
    with pytest.raises(ValueError, match=r"delayed_update_warmup must be >= 0, got -1"):
        L2LOffloadStrategy(delayed_update=True, delayed_update_warmup=-1)
    with pytest.raises(ValueError, match=r"offload_activations=True needs checkpoint_blocks=True.*; set checkpoint_blocks=True"):
        L2LOffloadStrategy(offload_activations=True, checkpoint_blocks=False)
    with pytest.raises(ValueError, match=r"delayed_update=True\) cannot run with fp16 loss scaling.*; use OffloadPrecision\('bf16-mixed'\)"):
        _fit(Counting(), _regression_data(), L2LOffloadStrategy(delayed_update=True), plugins=[OffloadPrecision("16-mixed")])

    class Manual(Counting):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(ValueError, match=r"needs automatic optimization, but Manual sets automatic_optimization=False"):
        _fit(Manual(), _regression_data(), L2LOffloadStrategy(delayed_update=True))

    class WholeModelSGD(torch.optim.SGD):
        """Not in the per-parameter list: e.g. a step that rescales by a norm over all parameters."""

    class Global(Counting):
        def configure_optimizers(self) -> Any:
            return WholeModelSGD(self.parameters(), lr=0.1)

    with pytest.raises(ValueError, match=r"one step only for a per-parameter optimizer, not WholeModelSGD; use one of SGD"):
        _fit(Global(), _regression_data(), L2LOffloadStrategy(delayed_update=True))
    assert started == []  # refused before any training step


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_delayed_update_with_activations_on_host_matches_the_delayed_loop() -> None:
    # the copy-stream paths: snapshots streamed in through the pinned ring, activations out and back on CUDA
    torch.manual_seed(0)
    lit, reference = Regressor(), Regressor()
    reference.load_state_dict(lit.state_dict())
    strategy = L2LOffloadStrategy(blocks=["Block"], delayed_update=True, delayed_update_warmup=0, offload_activations=True)
    trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=strategy, max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(lit, _regression_data())
    _delayed_reference(reference, _regression_data(), _sgd_step_lr, _BLOCKS, steps=4)
    _assert_same_weights(reference, lit, atol=1e-5)
    stats = trainer.strategy.offload_stats
    assert stats.delayed_steps == 4
    assert stats.activation_d2h_bytes == stats.activation_h2d_bytes == 4 * 4 * 8 * 8 * 4  # steps x blocks x (8, 8) fp32
