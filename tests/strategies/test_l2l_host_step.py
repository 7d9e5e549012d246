"""L2LOffloadStrategy's host optimizer step: torch's fused CPU kernel for the user's optimizer,
same weights as plain Lightning, the user's flags honoured, shadows refreshed by the update."""

from __future__ import annotations

import functools
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.models import GPT, LanguageModelTask
from lightning_accel.offload import shadow_fold
from lightning_accel.plugins.precision import OffloadPrecision
from lightning_accel.strategies.l2l_offload import L2LOffloadStrategy

OptimizerFactory = Callable[..., torch.optim.Optimizer]

# (optimizer, the torch kernel its fused CPU path calls)
_OPTIMIZERS: dict[str, tuple[OptimizerFactory, str]] = {
    "AdamW": (functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.1), "_fused_adamw_"),
    "Adam-amsgrad": (functools.partial(torch.optim.Adam, lr=3e-3, amsgrad=True), "_fused_adam_"),
    "SGD-nesterov": (functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3), "_fused_sgd_"),
    "Adagrad": (functools.partial(torch.optim.Adagrad, lr=0.05), "_fused_adagrad_"),
}


class Net(pl.LightningModule):
    """nn.Sequential blocks (a model this project did not write), two param groups (the last
    block with its own lr and no weight decay) and a step-wise LR scheduler."""

    def __init__(self, optimizer: OptimizerFactory, depth: int = 3, width: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(4, width)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.LayerNorm(width)) for _ in range(depth))
        self.out = nn.Linear(width, 1)
        self.optimizer = optimizer
        self.seen_groups: list[dict[str, Any]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> Any:
        last = list(self.blocks[-1].parameters())
        rest = [p for p in self.parameters() if all(p is not q for q in last)]
        kwargs = {"weight_decay": 0.0} if "weight_decay" in self.optimizer.keywords else {}
        opt = self.optimizer([{"params": rest}, {"params": last, "lr": self.optimizer.keywords["lr"] / 2, **kwargs}])
        sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_batch_end(self, *args: Any) -> None:
        # what the user sees of the param groups between steps
        self.seen_groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizers().optimizer.param_groups]


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(48, 4, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=8)


def _fit(model: pl.LightningModule, data: DataLoader, strategy: Any = "auto", ckpt_path: Path | None = None,
         **kwargs: Any) -> pl.Trainer:
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, **{"max_steps": 6, **kwargs})
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return trainer


def _twins(factory: Callable[[], pl.LightningModule]) -> tuple[pl.LightningModule, pl.LightningModule]:
    torch.manual_seed(0)
    first, second = factory(), factory()
    second.load_state_dict(first.state_dict())
    return first, second


def _max_diff(a: nn.Module, b: nn.Module | dict[str, torch.Tensor]) -> float:
    sa, sb = a.state_dict(), (b if isinstance(b, dict) else b.state_dict())
    assert sa.keys() == sb.keys()
    return max((sa[k] - sb[k]).abs().max().item() for k in sa)


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the calls of torch's fused optimizer kernels (looked up on ``torch`` at each step)."""
    calls = {name: 0 for _, name in _OPTIMIZERS.values()}
    for name in calls:
        real = getattr(torch, name)

        def counting(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(torch, name, counting)
    return calls


@pytest.mark.parametrize("name", list(_OPTIMIZERS))
def test_unset_flags_step_on_the_fused_kernel_and_match_plain_training(name: str, kernel_calls: dict[str, int],
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    optimizer, kernel = _OPTIMIZERS[name]
    fused = functools.partial(optimizer.func, **optimizer.keywords, fused=True)
    plain, offloaded = _twins(lambda: Net(optimizer))
    plain_fused = Net(fused)
    plain_fused.load_state_dict(plain.state_dict())
    initial = {k: v.clone() for k, v in plain.state_dict().items()}
    _fit(plain, _data())
    assert kernel_calls[kernel] == 0  # plain Lightning with unset flags: torch's per-tensor loop
    _fit(plain_fused, _data())
    plain_fused_calls, kernel_calls[kernel] = kernel_calls[kernel], 0
    with caplog.at_level("INFO"):
        _fit(offloaded, _data(), L2LOffloadStrategy(blocks=["Sequential"]))
    # the host step called the fused kernel, once per step and param group (it never needs more
    # calls than plain fused training; the first step splits the group by "has state" for SGD)
    assert 6 * 2 <= kernel_calls[kernel] <= plain_fused_calls + 2
    # the same weights as plain Lightning with the same optimizer: exactly those of the fused
    # kernel, within fp32 rounding of torch's default loop
    assert _max_diff(offloaded, plain_fused) <= 1e-7
    assert _max_diff(offloaded, plain) <= 2e-5
    assert _max_diff(offloaded, initial) > 1e-3  # it trained
    # the user's param groups are unchanged (flags unset, scheduler-halved lr), and the switch is said once
    assert [g["fused"] for g in offloaded.seen_groups] == [None, None]
    assert [g["lr"] for g in offloaded.seen_groups] == [g["lr"] for g in plain.seen_groups]
    said = [r.getMessage() for r in caplog.records if "fused CPU kernel" in r.getMessage()]
    # one setup line: the plan, then the optimizer's kernel
    assert len(said) == 1 and said[0].startswith("L2LOffloadStrategy: ")
    assert f"; {type(offloaded.optimizers().optimizer).__name__}: host parameters step on torch's fused CPU kernel" in said[0]


@pytest.mark.parametrize("flags", [{"fused": False}, {"foreach": True}, {"foreach": False}], ids=str)
def test_explicit_flags_are_honoured(flags: dict[str, bool], kernel_calls: dict[str, int], caplog: pytest.LogCaptureFixture) -> None:
    optimizer = functools.partial(torch.optim.AdamW, lr=3e-3, **flags)
    plain, offloaded = _twins(lambda: Net(optimizer))
    _fit(plain, _data())
    with caplog.at_level("INFO"):
        _fit(offloaded, _data(), L2LOffloadStrategy(blocks=["Sequential"]))
    assert kernel_calls["_fused_adamw_"] == 0
    assert _max_diff(offloaded, plain) <= 1e-6  # the same implementation as plain Lightning
    assert any("as configured" in r.getMessage() for r in caplog.records)


def test_explicit_fused_true_is_allowed_on_host_parameters(kernel_calls: dict[str, int]) -> None:
    optimizer = functools.partial(torch.optim.Adam, lr=3e-3, fused=True)
    plain, offloaded = _twins(lambda: Net(optimizer))
    _fit(plain, _data())
    _fit(offloaded, _data(), L2LOffloadStrategy(blocks=["Sequential"], offload_resident=True))
    assert kernel_calls["_fused_adam_"] == 2 * 6 * 2
    assert _max_diff(offloaded, plain) <= 1e-7


def test_optimizer_without_a_fused_kernel_keeps_its_own_step(caplog: pytest.LogCaptureFixture) -> None:
    optimizer = functools.partial(torch.optim.RMSprop, lr=1e-3)
    plain, offloaded = _twins(lambda: Net(optimizer))
    _fit(plain, _data())
    with caplog.at_level("INFO"):
        _fit(offloaded, _data(), L2LOffloadStrategy(blocks=["Sequential"]))
    assert _max_diff(offloaded, plain) <= 1e-6
    assert any("RMSprop has no fused CPU kernel" in r.getMessage() for r in caplog.records)


def test_overlapped_steps_batch_blocks_and_match_plain_training(kernel_calls: dict[str, int]) -> None:
    optimizer = functools.partial(torch.optim.AdamW, lr=3e-3, fused=True)
    plain, offloaded = _twins(lambda: Net(optimizer, depth=4))
    _fit(plain, _data())
    trainer = _fit(offloaded, _data(), L2LOffloadStrategy(blocks=["Sequential"], overlap_step=True))
    stats = trainer.strategy.offload_stats
    assert stats.blocks_stepped_in_backward == 4 * 6
    # one optimizer call per batch of blocks whose gradients had landed: never more than blocks
    assert 6 <= stats.host_step_calls <= stats.blocks_stepped_in_backward
    assert _max_diff(offloaded, plain) <= 1e-7


class _ShadowCheck(pl.Callback):
    """After every step: each low-precision shadow holds its master's current value."""

    def __init__(self) -> None:
        self.checked = 0

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        store = trainer.strategy._executor.store
        for param, master in store.master.items():
            shadow = store.shadow[param]
            if shadow is not master:
                assert torch.equal(shadow, master.to(shadow.dtype))
                self.checked += 1


@pytest.mark.parametrize(("overlap_step", "offload_resident"), [(False, False), (True, False), (True, True)])
def test_bf16_shadows_are_refreshed_by_the_update(overlap_step: bool, offload_resident: bool) -> None:
    check = _ShadowCheck()
    plain, offloaded = _twins(lambda: LanguageModelTask(GPT("tiny", n_layer=2, block_size=16)))
    tokens = torch.randint(0, 256, (32, 17), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)
    _fit(plain, data, precision="bf16-mixed", max_steps=3)
    _fit(offloaded, data, L2LOffloadStrategy(overlap_step=overlap_step, offload_resident=offload_resident),
         plugins=[OffloadPrecision("bf16-mixed")], max_steps=3, callbacks=[check])
    shadowed = offloaded.net.parameters() if offload_resident else offloaded.net.blocks.parameters()
    assert check.checked == 3 * sum(p.ndim >= 2 for p in shadowed)
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(offloaded.state_dict()[name], value, rtol=0, atol=2e-2, msg=name)


@pytest.mark.parametrize(("overlap_step", "clip"), [(False, None), (True, None), (False, 0.5)], ids=["after", "overlapped", "clipped"])
def test_the_update_reading_the_bf16_gradients_is_the_fp32_one_bit_for_bit(overlap_step: bool, clip: float | None,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # the fused update's C kernel reads the device's bf16 gradients instead of their fp32 widening (after the
    # backward, or block by block during it); clipping writes the fp32 ones, which are read then. Weights and
    # optimizer state as when it never reads them
    handed: list[int] = []  # per fused kernel call: how many bf16 gradients the fold was handed
    intercept = shadow_fold.ShadowFold.intercept

    def counting(self: shadow_fold.ShadowFold, *args: Any) -> bool:
        handed.append(len(self.low_grads))
        return intercept(self, *args)

    monkeypatch.setattr(shadow_fold.ShadowFold, "intercept", counting)
    runs = []
    for reads in (True, False):
        if not reads:
            monkeypatch.setattr(L2LOffloadStrategy, "_reads_low_grads", lambda self, fuse: False)
        handed.clear()
        torch.manual_seed(0)
        module = LanguageModelTask(GPT("tiny", n_layer=2, block_size=16))
        tokens = torch.randint(0, 256, (24, 17), generator=torch.Generator().manual_seed(0))
        trainer = _fit(module, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8),
                       L2LOffloadStrategy(overlap_step=overlap_step), plugins=[OffloadPrecision("bf16-mixed")], max_steps=3,
                       gradient_clip_val=clip)
        runs.append((module.state_dict(), trainer.optimizers[0].state_dict()["state"], sum(handed)))
    (weights, state, read), (ref_weights, ref_state, ref_read) = runs
    matrices = sum(p.ndim >= 2 for p in module.net.blocks.parameters())
    assert read == (0 if clip else 3 * matrices) and ref_read == 0
    for name, value in ref_weights.items():
        assert torch.equal(weights[name].view(torch.int32), value.view(torch.int32)), name
    for index, entries in ref_state.items():
        for key, value in entries.items():
            assert torch.equal(state[index][key], value), (index, key)


def test_checkpoint_of_a_fused_run_resumes_in_plain_lightning(tmp_path: Path) -> None:
    optimizer = functools.partial(torch.optim.AdamW, lr=3e-3)
    reference, first = _twins(lambda: Net(optimizer))
    _fit(reference, _data(), max_steps=-1, max_epochs=2)
    trainer = _fit(first, _data(), L2LOffloadStrategy(blocks=["Sequential"]), max_steps=-1, max_epochs=1)
    ckpt = tmp_path / "half.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)["optimizer_states"][0]
    assert [g["fused"] for g in saved["param_groups"]] == [None, None]  # the user's flags, not ours
    resumed = Net(optimizer)
    _fit(resumed, _data(), max_steps=-1, max_epochs=2, ckpt_path=ckpt)
    assert _max_diff(resumed, reference) <= 2e-5


def test_hugging_face_gpt2_steps_fused_and_matches_plain_fused(kernel_calls: dict[str, int]) -> None:
    transformers = pytest.importorskip("transformers")

    class HFTask(pl.LightningModule):
        def __init__(self, fused: bool | None) -> None:
            super().__init__()
            config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16,
                                             use_cache=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
            self.model = transformers.GPT2LMHeadModel(config)
            self.fused = fused

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.model(input_ids=batch[0], labels=batch[0]).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=self.fused)

    tokens = torch.randint(0, 64, (32, 16), generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(tokens), batch_size=8)
    torch.manual_seed(0)
    plain = HFTask(True)
    offloaded = HFTask(None)
    offloaded.load_state_dict(plain.state_dict())
    _fit(plain, data, max_steps=4)
    calls, kernel_calls["_fused_adamw_"] = kernel_calls["_fused_adamw_"], 0
    _fit(offloaded, data, L2LOffloadStrategy(), max_steps=4)
    assert kernel_calls["_fused_adamw_"] == calls
    assert _max_diff(offloaded, plain) <= 1e-7


def test_delayed_update_steps_the_masters_on_the_fused_kernel(kernel_calls: dict[str, int]) -> None:
    # the delayed update's worker steps a view of the optimizer; unset flags switch there too,
    # to the same weights as the user's explicit fused=True under the same strategy
    auto, explicit = _twins(lambda: Net(functools.partial(torch.optim.AdamW, lr=3e-3)))
    explicit.optimizer = functools.partial(torch.optim.AdamW, lr=3e-3, fused=True)
    _fit(auto, _data(), L2LOffloadStrategy(blocks=["Sequential"], delayed_update=True, delayed_update_warmup=0))
    assert kernel_calls["_fused_adamw_"] >= 6
    _fit(explicit, _data(), L2LOffloadStrategy(blocks=["Sequential"], delayed_update=True, delayed_update_warmup=0))
    assert _max_diff(auto, explicit) == 0.0


@pytest.fixture
def two_threads() -> Iterator[None]:
    """More intra-op threads than a budget of one core, so that lowering them shows (the tests run on one: tests/conftest.py)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


def test_host_step_threads_follow_the_rank_budget(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                                  two_threads: None) -> None:
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    before = torch.get_num_threads()
    seen: list[tuple[str, int]] = []

    class Recording(Net):
        def configure_optimizers(self) -> Any:
            config = super().configure_optimizers()
            config["optimizer"].register_step_pre_hook(
                lambda *_: seen.append((threading.current_thread().name, torch.get_num_threads())))
            return config

    with caplog.at_level("INFO"):
        _fit(Recording(functools.partial(torch.optim.AdamW, lr=1e-3)), _data(),
             L2LOffloadStrategy(blocks=["Sequential"], overlap_step=True), max_steps=2)
    workers = {n for name, n in seen if name.startswith("l2l-host-step")}
    assert workers == {1}  # the overlapped block steps ran in the worker, on the budget's one thread
    assert {n for name, n in seen if not name.startswith("l2l-host-step")} == {1}  # and the final step
    assert any("host step and copies on 1 intra-op thread; budget 1 CPU core per rank (from SLURM_CPUS_PER_TASK"
               in r.getMessage() for r in caplog.records)
    assert torch.get_num_threads() == before  # put back at teardown
