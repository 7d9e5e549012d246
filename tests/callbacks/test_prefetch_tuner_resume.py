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


def test_a_state_loaded_into_the_users_loader_before_fit_is_where_the_tuned_loader_starts(sleepy, recorder, make_trainer):
    # The user positioned their StatefulDataLoader by hand (load_state_dict before fit, no checkpoint):
    # the tuned loader starts its first epoch there, as that loader would.
    first = loader(sleepy)
    seen = [batch[0].tolist() for _, batch in zip(range(3), first)]  # three batches of an epoch
    state = first.state_dict()
    rest_untuned, rest_tuned = recorder(), recorder()
    plain = loader(sleepy)
    plain.load_state_dict(state)
    make_trainer([], max_epochs=1).fit(rest_untuned, plain)
    tuned = loader(sleepy)
    tuned.load_state_dict(state)
    tuner = PrefetchTuner(max_workers=2)
    make_trainer([tuner], max_epochs=1).fit(rest_tuned, tuned)
    assert tuner.loader is not None, tuner.reason
    assert len(rest_untuned.indices) == 28 and rest_tuned.indices == rest_untuned.indices
    assert sorted(sum(seen, []) + rest_tuned.indices) == list(range(40))


def test_a_plain_loader_resumed_mid_epoch_is_kept_and_the_tuner_says_why(sleepy, recorder, make_trainer, tmp_path):
    from torch.utils.data import DataLoader

    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3, save_top_k=-1, filename="{step}")
    make_trainer([every], max_epochs=1, enable_checkpointing=True).fit(recorder(), DataLoader(sleepy(40), batch_size=4))
    tuner = PrefetchTuner(max_workers=2)
    trainer = make_trainer([tuner], max_epochs=1, enable_checkpointing=True, default_root_dir=tmp_path)
    trainer.fit(recorder(), DataLoader(sleepy(40), batch_size=4), ckpt_path=str(tmp_path / "step=3.ckpt"))
    assert tuner.loader is None and tuner.reason == (
        "kept your loader: fit resumed part-way through an epoch and the loader cannot report its position"
    )
    assert "process_dataloader" not in vars(trainer.strategy)


def test_a_fit_resumed_from_a_checkpoint_serves_the_tuners_choice_without_searching(sleepy, recorder, make_trainer, tmp_path, caplog):
    import logging

    from torch.utils.data import DataLoader

    data = sleepy(64, latency_s=0.04)  # data-bound: 40 ms items against 5 ms steps
    tuner = PrefetchTuner(max_workers=4, warmup_steps=1, trial_steps=3)  # no cache_path: only the checkpoint remembers
    every = ModelCheckpoint(dirpath=tmp_path, save_last=True)
    make_trainer([tuner, every], max_epochs=1, enable_checkpointing=True).fit(recorder(step_s=0.005), DataLoader(data, batch_size=1))
    assert tuner.search is not None and tuner.chosen is not None and tuner.chosen.num_workers >= 2, tuner.report()
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)["callbacks"]["PrefetchTuner"]
    assert saved == {"chosen": tuner.chosen.as_kwargs(), "reason": tuner.reason, "finished": True}

    again, model = PrefetchTuner(max_workers=4, warmup_steps=1, trial_steps=3), recorder(step_s=0.005)
    trainer = make_trainer([again], max_epochs=2, enable_checkpointing=True, default_root_dir=tmp_path)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        trainer.fit(model, DataLoader(data, batch_size=1), ckpt_path=str(tmp_path / "last.ckpt"))
    assert again.online is None and again.search is None  # no search ran
    assert again.chosen == tuner.chosen and again.loader.settings == tuner.chosen and again.loader.switches == 0
    assert again.reason == f"from checkpoint: {tuner.reason}"
    said = [r.getMessage() for r in caplog.records if "PrefetchTuner" in r.getMessage()]
    assert said == [f"PrefetchTuner: resumed with the checkpoint's choice, no search: {tuner.chosen.label()} ({tuner.reason})"]
    assert sorted(model.indices) == list(range(64))  # the second epoch, whole
    assert again.state_dict() == saved  # a checkpoint of the resumed run carries the choice on


def test_a_checkpoint_taken_before_the_search_finished_is_searched_again(sleepy, recorder, make_trainer, tmp_path):
    tuner = PrefetchTuner(max_workers=2, warmup_steps=1, trial_steps=2, max_search_steps=12)
    every = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1, filename="{step}")
    make_trainer([tuner, every], max_epochs=1, enable_checkpointing=True).fit(recorder(step_s=0.002), loader(sleepy))
    saved = torch.load(tmp_path / "step=2.ckpt", weights_only=False)["callbacks"]["PrefetchTuner"]
    assert saved["finished"] is False and saved["chosen"] is None, saved  # the start was still being measured

    again = PrefetchTuner(max_workers=2, warmup_steps=1, trial_steps=2, max_search_steps=12)
    trainer = make_trainer([again], max_epochs=1, enable_checkpointing=True, default_root_dir=tmp_path)
    trainer.fit(recorder(step_s=0.002), loader(sleepy), ckpt_path=str(tmp_path / "step=2.ckpt"))
    assert again.online is not None and again.online.done and not again.reason.startswith("from checkpoint"), again.reason
