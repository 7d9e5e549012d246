"""TrainLoaderHook: the fit's train loader, and only it, passes through the wrap before the fit loop reads it."""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
from torch.utils.data import DataLoader

from lightning_accel.callbacks import PrefetchTuner
from lightning_accel.callbacks._process_hook import TrainLoaderHook


class Seen(pl.Callback):
    """Installs the hook for each fit and records what the wrap was handed."""

    def __init__(self) -> None:
        self.wrapped: list = []
        self.hook: TrainLoaderHook | None = None

    def setup(self, trainer, pl_module, stage):
        self.hook = TrainLoaderHook(trainer, self.wrap)

    def wrap(self, loader):
        self.wrapped.append(loader)
        return Counted(loader)

    def teardown(self, trainer, pl_module, stage):
        self.hook.remove()


class Counted:
    """A wrapper that counts the batches read through it (the fit loop's first reads included)."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader, self.read = loader, 0

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            self.read += 1
            yield batch


def test_only_the_train_loader_is_wrapped_and_the_strategy_is_restored(sleepy, recorder, make_trainer):
    class WithValidation(recorder):
        def validation_step(self, batch, batch_idx):
            return None

    train, val = DataLoader(sleepy(6), batch_size=2), DataLoader(sleepy(4), batch_size=2)
    seen, model = Seen(), WithValidation()
    trainer = make_trainer([seen], max_epochs=2, num_sanity_val_steps=2)
    trainer.fit(model, train, val)
    assert seen.wrapped == [train]  # not the sanity check's or validation's loader, once for both epochs
    wrapper = trainer.fit_loop._combined_loader.flattened[0]
    assert isinstance(wrapper, Counted) and wrapper.read == 6  # both epochs read through the wrapper
    assert sorted(model.indices) == sorted(list(range(6)) * 2)
    assert "process_dataloader" not in vars(trainer.strategy)


def test_workers_are_seeded_before_the_wrap_as_lightning_would(sleepy, recorder, make_trainer, monkeypatch):
    # What seed_everything(workers=True) sets (through monkeypatch: the variable must not outlive the test,
    # or every later multi-process test would seed its ranks differently from its reference).
    monkeypatch.setenv("PL_SEED_WORKERS", "1")
    train, seen = DataLoader(sleepy(4), batch_size=2), Seen()
    make_trainer([seen], max_epochs=1).fit(recorder(), train)
    assert seen.wrapped == [train] and train.worker_init_fn is not None  # Lightning skips a non-DataLoader


def test_a_streams_read_ahead_comes_through_the_tuned_loader(recorder, make_trainer, endless):
    tuner = PrefetchTuner()
    model = recorder()
    trainer = make_trainer([tuner], max_steps=5)
    trainer.fit(model, DataLoader(endless(), batch_size=1))
    assert trainer.fit_loop._combined_loader.flattened[0] is tuner.loader  # the wrapper Lightning read ahead of
    assert tuner.loader.handed_out == 6 and model.indices == list(range(5))  # five trained, one read ahead
    assert "process_dataloader" not in vars(trainer.strategy)


def test_the_first_of_several_train_loaders_serves_untuned_and_the_tuner_says_why(sleepy, recorder, make_trainer):
    class TwoLoaders(recorder):
        def training_step(self, batch, batch_idx):
            return super().training_step(batch["a"], batch_idx)

    a, b = DataLoader(sleepy(6, latency_s=0.05), batch_size=1), DataLoader(sleepy(6), batch_size=1)
    tuner, model = PrefetchTuner(), TwoLoaders()
    trainer = make_trainer([tuner])
    trainer.fit(model, {"a": a, "b": b})
    assert tuner.reason == "kept your loader: 2 train loaders; only a single train loader is supported"
    assert tuner.loader is None and tuner.online is None
    assert model.indices == list(range(6))
    served = trainer.fit_loop._combined_loader.flattened[0]  # the wrapper that served "a", closed at the end
    assert served._inner is None and served.reaper._thread is None


class Marked:
    """A wrapper that says which hook made it."""

    def __init__(self, loader, mark: str) -> None:
        self.loader, self.mark = loader, mark

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        return iter(self.loader)


@pytest.mark.parametrize("first_removed", ["lower", "upper"])
def test_stacked_hooks_wrap_in_the_order_installed_and_come_off_in_either_order(sleepy, recorder, make_trainer, first_removed):
    class Both(pl.Callback):
        def setup(self, trainer, pl_module, stage):
            self.lower = TrainLoaderHook(trainer, lambda loader: Marked(loader, "lower"))
            self.upper = TrainLoaderHook(trainer, lambda loader: Marked(loader, "upper"))

        def teardown(self, trainer, pl_module, stage):
            hooks = [self.lower, self.upper] if first_removed == "lower" else [self.upper, self.lower]
            hooks[0].remove()
            self.patched_between = "process_dataloader" in vars(trainer.strategy)
            hooks[1].remove()

    train, both = DataLoader(sleepy(4), batch_size=2), Both()
    trainer = make_trainer([both])
    trainer.fit(recorder(), train)
    served = trainer.fit_loop._combined_loader.flattened[0]
    assert (served.mark, served.loader.mark, served.loader.loader) == ("upper", "lower", train)
    assert both.patched_between  # one hook still on
    assert "process_dataloader" not in vars(trainer.strategy)  # the strategy's own method shows through
