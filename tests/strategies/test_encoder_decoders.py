"""Encoder-decoders under L2L offload: T5 and BART (transformers, tiny, random weights, float64) stream both stacks,
the encoder's blocks and the decoder's, and train to plain Lightning's weights.

Before, ``blocks="auto"`` took one stack (the decoder's) and the encoder stayed resident on the device: L2L's "only
the running block on the device" did not hold for half the model.
"""

from __future__ import annotations

import functools

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_accel.strategies.l2l_offload_hooks as l2l_module
from lightning_accel import L2LOffloadStrategy
from lightning_accel.offload import L2LExecutor

transformers = pytest.importorskip("transformers", reason="needs the hf extra")


def t5() -> torch.nn.Module:
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=3, num_heads=4, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0))


def bart() -> torch.nn.Module:
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0))


class Seq2Seq(pl.LightningModule):
    """The model's own loss on (source, target) token batches; AdamW."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.net(input_ids=batch[0], labels=batch[1]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def train(build, strategy) -> Seq2Seq:
    torch.manual_seed(0)
    task = Seq2Seq(build().double())
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(1, 64, (12, 12), generator=g), torch.randint(1, 64, (12, 10), generator=g))
    pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=3, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False).fit(task, DataLoader(data, batch_size=4))
    return task


@pytest.mark.parametrize("copies", [False, True], ids=["cpu", "copies"])
@pytest.mark.parametrize("build", [t5, bart], ids=["t5", "bart"])
def test_l2l_streams_the_encoder_and_the_decoder_and_trains_like_plain_lightning(build, copies: bool,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    if copies:  # blocks copied to fresh device tensors, as on a GPU: the resident count is measured
        monkeypatch.setattr(l2l_module, "L2LExecutor", functools.partial(L2LExecutor, alias=False))
    reference = train(build, "auto")
    strategy = L2LOffloadStrategy()
    task = train(build, strategy)
    stacks = {name: module for name, module in task.net.named_modules() if name.endswith(("encoder.block", "decoder.block",
                                                                                       "encoder.layers", "decoder.layers"))}
    assert len(stacks) == 2
    assert strategy.offload_stats.offloaded_params == sum(p.numel() for m in stacks.values() for p in m.parameters())
    want, got = reference.net.state_dict(), task.net.state_dict()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=name)
    if copies:
        assert strategy.offload_stats.peak_resident_blocks <= 2  # the running block and the one prefetched
