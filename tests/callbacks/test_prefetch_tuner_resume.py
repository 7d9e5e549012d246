"""A run tuned by PrefetchTuner over a StatefulDataLoader resumes mid-epoch exactly (issue 19's exact resume)."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_accel.callbacks import PrefetchTuner

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader", reason="needs torchdata").StatefulDataLoader


def loader(sleepy) -> StatefulDataLoader:
    torch.manual_seed(11)  # the stateful RandomSampler seeds itself from the global generator
    return StatefulDataLoader(sleepy(40, latency_s=0.01), batch_size=4, shuffle=True)


def test_checkpoint_mid_epoch_resumes_with_the_same_samples(sleepy, recorder, make_trainer, tmp_path):
    # The uninterrupted run: 2 epochs of 10 batches, tuned (the tuner switches loaders mid-epoch 1).
    full = recorder(step_s=0.002)
    tuner = PrefetchTuner(max_workers=2, warmup_steps=1, trial_steps=2, max_search_steps=12)
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=7, save_top_k=-1, filename="{step}")
    make_trainer([tuner, every], max_epochs=2, enable_checkpointing=True).fit(full, loader(sleepy))
    assert tuner.search is not None and tuner.loader.switches >= 1, tuner.report()
    assert sorted(full.indices[:40]) == list(range(40)) == sorted(full.indices[40:])

    # Resume from step 7 (mid-epoch 1) and step 14 (mid-epoch 2), tuned again: the rest is what the full run saw.
    for step in (7, 14):
        resumed = recorder(step_s=0.002)
        again = PrefetchTuner(max_workers=2, warmup_steps=1, trial_steps=2, max_search_steps=12)
        trainer = make_trainer([again], max_epochs=2, enable_checkpointing=True, default_root_dir=tmp_path)
        trainer.fit(resumed, loader(sleepy), ckpt_path=str(tmp_path / f"step={step}.ckpt"))
        assert again.loader is not None, again.reason  # wrapped although fit resumed part-way through an epoch
        assert resumed.indices == full.indices[4 * step :], step
