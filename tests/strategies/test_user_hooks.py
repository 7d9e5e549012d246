"""What the user's hooks call, read before they run (:func:`lightning_accel.strategies.user_hooks.calls_in`), and the
refusal that rests on it: ``self.all_gather`` in a ``training_step`` that micro-batches run under ``gpipe_distributed``."""

from __future__ import annotations

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch

from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy
from lightning_accel.strategies.user_hooks import calls_in


class Gathers(pl.LightningModule):
    def training_step(self, batch, batch_idx):
        # all_gather in a comment or a string ("self.all_gather(x)") is no call
        everyone = self.all_gather(batch)
        return everyone.sum()


class GathersInValidation(pl.LightningModule):
    def training_step(self, batch, batch_idx):
        return self.all_gather_but_not(batch)

    def all_gather_but_not(self, batch):
        return self.all_gather(batch).sum()  # through a helper: the source of training_step does not show it

    def validation_step(self, batch, batch_idx):
        self.all_gather(batch)


def test_a_call_is_read_from_the_users_own_hook_only():
    assert calls_in(Gathers(), "training_step", "all_gather")
    assert not calls_in(GathersInValidation(), "training_step", "all_gather")
    assert calls_in(GathersInValidation(), "validation_step", "all_gather")
    assert not calls_in(Gathers(), "validation_step", "all_gather")  # Lightning's own, not overridden
    assert not calls_in(Gathers(), "no_such_hook", "all_gather")


def test_all_gather_in_a_micro_batched_training_step_is_refused_before_the_first_step_or_when_called():
    """DDP gathers the whole batch's values; a micro-batch's training_step would gather half of them (2 vs 4 numbers
    in the all_gather_training conformance cell, before the step ran once per batch under GPipe). chunks=1, or GPipe
    (training_step once per batch: lightning_accel.pipeline.whole_step): allowed."""
    strategy = DistributedGPipeStrategy(chunks=2, schedule="1f1b")
    line = (r"^DistributedGPipeStrategy\(chunks=2, schedule='1f1b'\) runs training_step once per micro-batch on the last "
            r"stage's rank: self.all_gather there would gather one micro-batch's values, not the batch's as under DDP; "
            r"gather in on_train_batch_end or validation_step, use schedule='gpipe' \(training_step once per batch\), or "
            r"chunks=1$")
    with pytest.raises(ValueError, match=line):
        strategy.check_fit(Gathers(), False)
    DistributedGPipeStrategy(chunks=2).check_fit(Gathers(), False)  # GPipe: the step runs once per batch
    strategy.check_fit(GathersInValidation(), False)  # not seen in the source: refused at the call instead
    strategy.pipeline = SimpleNamespace(_forwarding=True, step_chunks=2)
    with pytest.raises(ValueError, match=line):
        strategy.all_gather(torch.ones(2))
    DistributedGPipeStrategy(chunks=1).check_fit(Gathers(), False)
