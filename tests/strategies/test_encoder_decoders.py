"""Encoder-decoders under L2L offload and gpipe: T5 and BART (transformers, tiny, random weights, float64) stream or
pipeline both stacks, the encoder's blocks and the decoder's, and train to plain Lightning's weights.

Before, ``blocks="auto"`` took one stack (the decoder's) and the encoder stayed resident on the device: L2L's "only
the running block on the device" did not hold for half the model, and gpipe put the whole encoder on one stage.
"""

from __future__ import annotations

import functools

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel.strategies.l2l_offload_hooks as l2l_module
from lightning_accel import GPipeStrategy, L2LOffloadStrategy
from lightning_accel.offload import L2LExecutor

transformers = pytest.importorskip("transformers", reason="needs the hf extra")

from tests.support.real_models import Seq2Seq, seq2seq_data  # noqa: E402
from tests.support.real_models import build_bart as bart  # noqa: E402
from tests.support.real_models import build_t5 as t5  # noqa: E402


def train(build, strategy, callbacks: list[pl.Callback] | None = None) -> Seq2Seq:
    torch.manual_seed(0)
    task = Seq2Seq(build().double())
    data = seq2seq_data()
    pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=3, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks).fit(task, DataLoader(data, batch_size=4))
    return task


@functools.lru_cache(maxsize=None)
def plain(build) -> Seq2Seq:
    """Plain Lightning's run, trained once per model for every strategy compared with it."""
    return train(build, "auto")


def assert_same_weights(reference: Seq2Seq, task: Seq2Seq) -> None:
    want, got = reference.net.state_dict(), task.net.state_dict()
    assert got.keys() == want.keys()  # the user's parameter names
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("copies", [False, True], ids=["cpu", "copies"])
@pytest.mark.parametrize("build", [t5, bart], ids=["t5", "bart"])
def test_l2l_streams_the_encoder_and_the_decoder_and_trains_like_plain_lightning(build, copies: bool,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    if copies:  # blocks copied to fresh device tensors, as on a GPU: the resident count is measured
        monkeypatch.setattr(l2l_module, "L2LExecutor", functools.partial(L2LExecutor, alias=False))
    reference = plain(build)
    strategy = L2LOffloadStrategy()
    task = train(build, strategy)
    stacks = {name: module for name, module in task.net.named_modules() if name.endswith(("encoder.block", "decoder.block",
                                                                                       "encoder.layers", "decoder.layers"))}
    assert len(stacks) == 2
    assert strategy.offload_stats.offloaded_params == sum(p.numel() for m in stacks.values() for p in m.parameters())
    assert_same_weights(reference, task)
    if copies:
        assert strategy.offload_stats.peak_resident_blocks <= 2  # the running block and the one prefetched


class Stages(pl.Callback):
    """The stage of every block, read when training starts (the pipeline is taken down at teardown)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pipeline = trainer.strategy.pipeline
        self.blocks = {name: stage for name, stage in pipeline.assignment().items() if name in {b.name for b in pipeline.blocks}}


@pytest.mark.parametrize(("build", "stages"), [
    (t5, {"encoder.block.0": 0, "encoder.block.1": 0, "decoder.block.0": 0, "decoder.block.1": 1, "decoder.block.2": 1}),
    (bart, {"model.encoder.layers.0": 0, "model.encoder.layers.1": 0, "model.decoder.layers.0": 1, "model.decoder.layers.1": 1}),
], ids=["t5", "bart"])
def test_gpipe_pipelines_the_encoder_then_the_decoder_and_trains_like_plain_lightning(build, stages: dict[str, int]) -> None:
    # 2 CPU stages, chunks 2, micro-batch 0 re-materialized: the decoder's blocks on stage 1 get the encoder's output
    # (and T5's position bias, the masks) from the model's own forward, and hand their tuple outputs on
    seen = Stages()
    task = train(build, GPipeStrategy(devices=2, chunks=2, checkpoint="except_last"), callbacks=[seen])
    assert seen.blocks == stages
    assert_same_weights(plain(build), task)


class Carried(torch.nn.Module):
    """A block returning its output inside an object: no stage copy can move the tensor in it."""

    class Output:
        def __init__(self, hidden: torch.Tensor) -> None:
            self.hidden = hidden

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Output]:
        y = self.linear(x)
        return y, self.Output(y)


class Objects(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(Carried() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)[1].hidden
        return x

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch[0]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_gpipe_refuses_a_block_output_it_cannot_carry_naming_the_block() -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=GPipeStrategy(devices=2, chunks=2), max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(RuntimeError, match=r"block 'blocks\.0' \(Carried\) returned a tensor inside an object at "
                                           r"output\[1\]\.hidden \(Output\)"):
        trainer.fit(Objects(), DataLoader(TensorDataset(torch.randn(4, 4)), batch_size=4))
