"""GPipeStrategy against plain Lightning training: same gradients, same weights, same names."""

from __future__ import annotations

import copy
import warnings

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from lightning_accel._registry import register
from lightning_accel.models import GPT, LanguageModelTask
from lightning_accel.strategies import GPipeStrategy

STEPS = 3


class DictData(Dataset):
    """Regression samples as dicts, so the strategy must scatter a nested batch."""

    def __init__(self, n: int = 16) -> None:
        g = torch.Generator().manual_seed(7)
        self.x, self.y = torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i):
        return {"inputs": self.x[i], "target": self.y[i]}


class Regressor(pl.LightningModule):
    """A model built here: no ``net`` attribute, blocks in ``self.layers``, dict batches, MSE (mean) loss."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(5, 12)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(12, 12), nn.Tanh()) for _ in range(4))
        self.out = nn.Linear(12, 3)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)

    def training_step(self, batch, batch_idx):
        loss = nn.functional.mse_loss(self(batch["inputs"]), batch["target"])
        self.log("train/loss", loss)
        return {"loss": loss}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class FirstGrads(pl.Callback):
    """Records every gradient right before the first optimizer step."""

    def __init__(self) -> None:
        self.grads: dict[str, torch.Tensor] = {}

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if not self.grads:
            self.grads = {n: p.grad.detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None}


def _gpt_task() -> pl.LightningModule:
    torch.manual_seed(0)
    net = GPT("tiny", n_layer=4, n_embd=16, n_head=2, block_size=8, vocab_size=32)
    return LanguageModelTask(net, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))


def _gpt_loader() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 32, (16, 8), generator=g)
    return DataLoader(TensorDataset(x, torch.roll(x, -1, dims=1)), batch_size=8)


MODELS = {
    "gpt": (_gpt_task, _gpt_loader),
    "regressor": (lambda: (torch.manual_seed(0), Regressor())[1], lambda: DataLoader(DictData(), batch_size=8)),
}


def _fit(task: pl.LightningModule, loader: DataLoader, strategy, steps: int = STEPS, callbacks_extra=(),
         **trainer_kwargs) -> FirstGrads:
    grads = FirstGrads()
    trainer = pl.Trainer(
        max_steps=steps, strategy=strategy, accelerator="cpu", precision="64-true", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[grads, *callbacks_extra], **trainer_kwargs,
    )
    trainer.fit(task, loader)
    return grads


class Chained(pl.Callback):
    """After each batch: whether every stage of several blocks runs as one chain."""

    def __init__(self) -> None:
        self.seen: list[bool] = []

    def on_train_batch_end(self, trainer, *_):
        pipe = trainer.strategy.pipeline
        self.seen.append(all(pipe.stage_chained(s) for s, n in enumerate(pipe.balance) if n > 1))


_REFERENCE: dict[str, tuple[FirstGrads, dict[str, torch.Tensor], pl.LightningModule]] = {}


def _reference(model: str):
    """Plain Lightning training of the same model from the same weights (computed once per model)."""
    if model not in _REFERENCE:
        make, loader = MODELS[model]
        initial = make()
        task = copy.deepcopy(initial)
        grads = _fit(task, loader(), "auto")
        _REFERENCE[model] = (grads, {n: p.detach().clone() for n, p in task.named_parameters()}, initial)
    return _REFERENCE[model]


CASES = [
    # (model, checkpoint, chunks, balance, devices): every mode and every M, 2 to 4 stages
    ("gpt", "always", 1, [2, 2], 2),
    ("gpt", "except_last", 2, [1, 1, 2], 3),
    ("gpt", "never", 4, [1, 1, 1, 1], 4),
    ("gpt", "always", 8, "by_size", 4),
    ("gpt", "except_last", 8, [3, 1], 2),
    ("regressor", "never", 1, [1, 3], 2),
    ("regressor", "always", 2, "by_size", 2),
    ("regressor", "except_last", 4, [2, 1, 1], 3),
    ("regressor", "always", 8, [1, 1, 1, 1], 4),
    ("regressor", "never", 8, [2, 2], 2),
]


@pytest.mark.parametrize(("model", "checkpoint", "chunks", "balance", "devices"), CASES)
def test_gradients_and_weights_match_plain_training(model, checkpoint, chunks, balance, devices):
    ref_grads, ref_weights, initial = _reference(model)
    task = copy.deepcopy(initial)
    strategy = GPipeStrategy(chunks=chunks, balance=balance, devices=["cpu"] * devices, checkpoint=checkpoint)
    blocks = task.net.blocks if model == "gpt" else task.layers
    calls = []
    next(blocks[0].children()).register_forward_pre_hook(lambda *_: calls.append(1))  # runs again when re-materialized
    chained = Chained()
    grads = _fit(task, MODELS[model][1](), strategy, callbacks_extra=[chained])
    # every stage of several blocks was seen to chain, so it is re-materialized as one checkpoint per micro-batch
    assert chained.seen == [True] * STEPS
    # each step: one forward per micro-batch, plus one re-materialization per checkpointed micro-batch
    recomputed = {"always": chunks, "except_last": chunks - 1, "never": 0}[checkpoint]
    assert len(calls) == STEPS * (chunks + recomputed)
    assert strategy.pipeline is None  # torn down: the module is plain again
    assert all("forward" not in m.__dict__ for m in task.modules())
    assert grads.grads.keys() == ref_grads.grads.keys()
    for name, g in ref_grads.grads.items():
        torch.testing.assert_close(grads.grads[name], g, rtol=1e-10, atol=1e-12, msg=name)
    for name, p in task.named_parameters():
        torch.testing.assert_close(p.detach(), ref_weights[name], rtol=1e-10, atol=1e-12, msg=name)


def test_registered_name_and_gradient_accumulation():
    registry = copy.deepcopy(StrategyRegistry)  # leave the process-wide registry as the package sets it
    register(registry, "gpipe", GPipeStrategy, "GPipe micro-batching")
    register(registry, "gpipe", GPipeStrategy, "GPipe micro-batching")  # idempotent
    strategy = registry.get("gpipe")
    assert isinstance(strategy, GPipeStrategy) and strategy.strategy_name == "gpipe" and strategy.chunks == 1
    # accumulate_grad_batches=2 with batch 4 and M=2 equals plain training with the same accumulation
    make, _ = MODELS["regressor"]
    initial = make()
    plain, piped = copy.deepcopy(initial), copy.deepcopy(initial)
    _fit(plain, DataLoader(DictData(), batch_size=4), "auto", steps=2, accumulate_grad_batches=2, gradient_clip_val=0.5)
    _fit(piped, DataLoader(DictData(), batch_size=4), GPipeStrategy(chunks=2, devices=2), steps=2,
         accumulate_grad_batches=2, gradient_clip_val=0.5)
    for (n, p), (_, q) in zip(plain.named_parameters(), piped.named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-10, atol=1e-12, msg=n)


def _train_save_resume(initial, make_strategy, ckpt_dir):
    """4 steps saving at step 2, then a fresh run resumed from that checkpoint: (straight, resumed, checkpoint)."""
    kwargs = dict(accelerator="cpu", precision="64-true", logger=False, enable_progress_bar=False,
                  enable_model_summary=False)
    straight, resumed = copy.deepcopy(initial), copy.deepcopy(initial)
    saver = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1)
    pl.Trainer(max_steps=4, strategy=make_strategy(), callbacks=[saver], **kwargs).fit(straight, MODELS["gpt"][1]())
    (path,) = ckpt_dir.glob("*step=2.ckpt")
    trainer = pl.Trainer(max_steps=4, strategy=make_strategy(), enable_checkpointing=False, **kwargs)
    trainer.fit(resumed, MODELS["gpt"][1](), ckpt_path=path)
    return straight, resumed, path


@pytest.mark.parametrize("balance", ["by_size", "by_time"])  # by_time: optimizer state restored before the split
def test_checkpoint_keeps_names_loads_into_plain_model_and_resumes_like_plain_lightning(tmp_path, balance):
    initial = MODELS["gpt"][0]()
    straight, resumed, path = _train_save_resume(
        initial, lambda: GPipeStrategy(chunks=2, devices=2, balance=balance), tmp_path / "pipe")
    plain_straight, plain_resumed, _ = _train_save_resume(initial, lambda: "auto", tmp_path / "plain")

    state = torch.load(path, weights_only=False)["state_dict"]
    assert set(state) == set(plain_straight.state_dict())  # the user's names, nothing added
    plain = GPT("tiny", n_layer=4, n_embd=16, n_head=2, block_size=8, vocab_size=32).double()
    plain.load_state_dict({k.removeprefix("net."): v for k, v in state.items() if k.startswith("net.")}, strict=True)

    # Lightning's own resume differs from a straight run by AdamW's float32 step counter (~1e-8 here);
    # ours must reproduce plain Lightning's resume exactly, and both stay close to the straight run.
    for (n, p), (_, q) in zip(plain_resumed.named_parameters(), resumed.named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-10, atol=1e-12, msg=n)
    for (n, p), (_, q) in zip(straight.named_parameters(), resumed.named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=n)


def test_chunks_greater_than_batch_size_fails_before_the_first_step():
    task = MODELS["regressor"][0]()
    before = copy.deepcopy(task.state_dict())
    with pytest.raises(ValueError, match=r"chunks=16 is greater than the batch size 8.*set chunks <= 8"):
        _fit(task, DataLoader(DictData(), batch_size=8), GPipeStrategy(chunks=16, devices=2))
    for k, v in task.state_dict().items():
        assert torch.equal(v.to(before[k].dtype), before[k])


def test_balance_not_summing_to_blocks_fails_at_setup():
    with pytest.raises(ValueError, match=r"blocks: 4, sum of balance \[1, 2\]: 3\)"):
        _fit(MODELS["regressor"][0](), DataLoader(DictData(), batch_size=8), GPipeStrategy(balance=[1, 2], devices=2))


def test_no_blocks_names_the_fix():
    class Flat(Regressor):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Linear(12, 12), nn.Tanh()])  # two classes: not a block list

    with pytest.raises(ValueError, match="no blocks found in Flat.*pass blocks="):
        _fit(Flat(), DataLoader(DictData(), batch_size=8), GPipeStrategy(devices=2))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"chunks": 0}, r"chunks must be a positive int \(micro-batches per batch\), got 0"),
        ({"checkpoint": "sometimes"}, r"checkpoint must be one of always, except_last, never, got 'sometimes'"),
        ({"balance": "by_guess"}, r"balance must be a list of blocks per stage, 'by_size' or 'by_time', got 'by_guess'"),
        ({"balance": [1, 1, 2], "devices": ["cpu", "cpu"]}, r"3 stages but only 2 devices.*use fewer stages"),
        ({"devices": 0}, r"devices must be >= 1 \(one per stage\), got 0"),
        ({"devices": "cpu"}, r"devices must be an int or a list with one device per stage, got 'cpu'"),
        ({"devices": ["cpu", "cuda:7"]}, r"devices lists cuda:7 but this machine has \d+ CUDA device\(s\)"),
    ],
)
def test_bad_arguments_fail_at_construction(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GPipeStrategy(**kwargs)


class Work(nn.Module):
    """tanh(lin(x)) computed ``repeat`` times and averaged: the same value and bytes whatever ``repeat`` is,
    ``repeat`` times the time."""

    def __init__(self, width: int, repeat: int) -> None:
        super().__init__()
        self.lin, self.repeat = nn.Linear(width, width), repeat

    def forward(self, x):
        return sum(torch.tanh(self.lin(x)) for _ in range(self.repeat)) / self.repeat


class SlowLastBlock(Regressor):
    """Four blocks of equal size; the last one costs 64 times the others."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Work(12, 1), Work(12, 1), Work(12, 1), Work(12, 64)])


class Balances(pl.Callback):
    def __init__(self) -> None:
        self.seen: list[list[int]] = []

    def on_train_batch_end(self, trainer, *_):
        self.seen.append(trainer.strategy.pipeline.balance)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_balance_by_time_gives_the_slow_block_a_stage_and_trains_like_plain(checkpoint):
    torch.manual_seed(0)
    initial = SlowLastBlock()
    plain, by_size, by_time = copy.deepcopy(initial), copy.deepcopy(initial), copy.deepcopy(initial)
    ref = _fit(plain, DataLoader(DictData(), batch_size=8), "auto")
    size_balances, time_balances = Balances(), Balances()
    _fit(by_size, DataLoader(DictData(), batch_size=8), GPipeStrategy(chunks=2, devices=2, balance="by_size"),
         callbacks_extra=[size_balances])
    grads = _fit(by_time, DataLoader(DictData(), batch_size=8),
                 GPipeStrategy(chunks=2, devices=2, balance="by_time", checkpoint=checkpoint),
                 callbacks_extra=[time_balances])
    assert size_balances.seen == [[2, 2]] * STEPS  # equal bytes: an even split
    # by time the last block outweighs the other three together (64 : 3), so it runs alone; the plan is made once
    assert time_balances.seen == [[3, 1]] * STEPS
    for name, g in ref.grads.items():  # measuring on the first batch left no trace in training
        torch.testing.assert_close(grads.grads[name], g, rtol=1e-10, atol=1e-12, msg=name)
    for (n, p), (_, q) in zip(plain.named_parameters(), by_time.named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-10, atol=1e-12, msg=n)


def test_balance_by_time_keeps_dropout_masks_and_batch_norm_statistics_of_plain_training():
    class Noisy(SlowLastBlock):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Sequential(nn.Linear(5, 12), nn.BatchNorm1d(12), nn.Dropout(0.5))  # before the first block

    torch.manual_seed(0)
    initial = Noisy()
    plain, piped = copy.deepcopy(initial), copy.deepcopy(initial)
    torch.manual_seed(1)
    _fit(plain, DataLoader(DictData(), batch_size=8), "auto", steps=1)
    torch.manual_seed(1)
    _fit(piped, DataLoader(DictData(), batch_size=8), GPipeStrategy(chunks=1, devices=2, balance="by_time"), steps=1)
    for (n, p), (_, q) in zip(plain.named_parameters(), piped.named_parameters()):
        torch.testing.assert_close(q, p, rtol=1e-10, atol=1e-12, msg=n)
    bn, ref = piped.embed[1], plain.embed[1]
    assert int(bn.num_batches_tracked) == int(ref.num_batches_tracked) == 1  # the sample forward did not count
    torch.testing.assert_close(bn.running_mean, ref.running_mean, rtol=1e-10, atol=1e-12)


class NormedRegressor(Regressor):
    """Blocks with BatchNorm; SGD with lr=0 so every step's BatchNorm inputs match plain training's."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(12, 12), nn.BatchNorm1d(12)) for _ in range(4))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_deferred_batch_norm_keeps_whole_batch_running_statistics():
    torch.manual_seed(0)
    initial = NormedRegressor()
    plain, piped = copy.deepcopy(initial), copy.deepcopy(initial)
    _fit(plain, DataLoader(DictData(), batch_size=8), "auto")
    strategy = GPipeStrategy(chunks=4, devices=2, checkpoint="always", deferred_batch_norm=True)
    _fit(piped, DataLoader(DictData(), batch_size=8), strategy)
    bn, ref = piped.layers[0][1], plain.layers[0][1]  # the first BatchNorm sees plain training's inputs exactly
    assert int(bn.num_batches_tracked) == int(ref.num_batches_tracked) == STEPS
    torch.testing.assert_close(bn.running_mean, ref.running_mean, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(bn.running_var, ref.running_var, rtol=1e-10, atol=1e-12)


class BatchNormBlocks(pl.LightningModule):
    """The mixed nn.Sequential of the docs: each layer a block, two of them BatchNorm layers of their own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self(batch["inputs"]), batch["target"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


@pytest.mark.parametrize("chunks", [1, 4])
@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_a_batch_norm_block_is_not_updated_again_by_its_recomputation(checkpoint, chunks):
    """A BatchNorm that is a block of its own updates its running statistics once per micro-batch in every checkpoint
    mode, as checkpoint="never" does (one micro-batch: plain training's statistics exactly). Before, recomputation
    updated it again: chunks 1 "always" 6 updates for plain's 3; chunks 4: "never" 12, "except_last" 21, "always" 24."""
    plain, piped = BatchNormBlocks(), BatchNormBlocks()
    _fit(plain, DataLoader(DictData(), batch_size=8), "auto", steps=STEPS)
    blocks = lambda net: list(net)  # noqa: E731  every layer a block
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # chunks=4 without deferral: the per-micro-batch notice
        _fit(piped, DataLoader(DictData(), batch_size=8), GPipeStrategy(chunks=chunks, devices=2, checkpoint=checkpoint, blocks=blocks, deferred_batch_norm=False), steps=STEPS)
    for k in (1, 4):
        assert int(piped.net[k].num_batches_tracked) == chunks * int(plain.net[k].num_batches_tracked) == chunks * STEPS
    if chunks == 1:
        for (name, a), b in zip(plain.state_dict().items(), piped.state_dict().values()):
            torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=name)


def test_batch_norm_with_micro_batches_warns_what_differs():
    with pytest.warns(UserWarning, match=r"chunks=4\): 4 BatchNorm layer\(s\) \(e.g. 'layers.0.1'\) normalize each micro-batch.*; set deferred_batch_norm=True to keep"):
        _fit(NormedRegressor(), DataLoader(DictData(), batch_size=8), GPipeStrategy(chunks=4, devices=2, deferred_batch_norm=False), steps=1)


def test_zoo_resnet_with_deferred_batch_norm_on_three_stages():
    from lightning_accel.models import ClassifierTask, ResNet

    torch.manual_seed(0)
    initial = ClassifierTask(ResNet("resnet-tiny", in_channels=3, num_classes=3), num_classes=3,
                             optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
    g = torch.Generator().manual_seed(5)
    loader = DataLoader(TensorDataset(torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 3, (16,), generator=g)),
                        batch_size=8)
    plain, piped = copy.deepcopy(initial), copy.deepcopy(initial)
    _fit(plain, loader, "auto")
    _fit(piped, loader, GPipeStrategy(chunks=2, devices=3, checkpoint="except_last", deferred_batch_norm=True))
    stem, ref = piped.net.pre[1], plain.net.pre[1]  # the stem's BatchNorm sees plain training's inputs exactly
    assert isinstance(stem, nn.BatchNorm2d) and int(stem.num_batches_tracked) == STEPS
    torch.testing.assert_close(stem.running_mean, ref.running_mean, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(stem.running_var, ref.running_var, rtol=1e-10, atol=1e-12)
    assert all(int(m.num_batches_tracked) == STEPS for m in piped.modules() if isinstance(m, nn.BatchNorm2d))


def test_xla_devices_are_refused_with_the_reason() -> None:
    from lightning_accel.strategies.gpipe import _devices

    with pytest.raises(ValueError, match=r"GPipeStrategy does not run on XLA devices.*; on a TPU use strategy='xla_pjrt'"):
        _devices(["xla:0", "xla:1"])
