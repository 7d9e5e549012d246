"""A tuned StatefulDataLoader checkpoints the state the user's loader would have: resume serves the same rest."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_accel.prefetch import LoaderSettings, RebuildError
from lightning_accel.prefetch.stream import PositionStream
from lightning_accel.prefetch.stateful_tunable import StatefulTunableLoader, tunable_loader
from lightning_accel.prefetch.tunable_loader import TunableLoader

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader", reason="needs torchdata").StatefulDataLoader


class Indices(Dataset):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


def user_loader(workers: int) -> StatefulDataLoader:
    torch.manual_seed(5)  # the stateful RandomSampler seeds itself from the global generator
    return StatefulDataLoader(Indices(), batch_size=4, shuffle=True, num_workers=workers)


def rest(state: dict, workers: int) -> list[list[int]]:
    """What a fresh user loader serves after loading ``state``: the rest of that epoch."""
    fresh = user_loader(workers)
    fresh.load_state_dict(state)
    return [b.tolist() for b in fresh]


@pytest.mark.parametrize("workers", [0, 2])
def test_state_after_each_batch_matches_the_users_loader_across_a_switch(workers):
    reference = user_loader(workers)
    ref_epochs, ref_states = [], []
    for _ in range(2):
        it = iter(reference)
        epoch = []
        for k, batch in enumerate(it):
            epoch.append(batch.tolist())
            if k % 3 == 1:  # a few points per epoch: each check forks workers twice
                ref_states.append(rest(reference.state_dict(), workers))
        ref_epochs.append(epoch)

    tuned = tunable_loader(user_loader(workers))
    assert isinstance(tuned, StatefulTunableLoader)
    there, back = LoaderSettings(1, 2) if workers == 0 else LoaderSettings(0), tuned.settings
    epochs, states = [], []
    for e in range(2):
        epoch = []
        for k, batch in enumerate(tuned):
            epoch.append(batch.tolist())
            if (e, k) == (0, 1):
                tuned.switch(there)
            if (e, k) == (1, 3):
                tuned.switch(back)
            if k % 3 == 1:
                states.append(rest(tuned.state_dict(), workers))
        epochs.append(epoch)
    tuned.close()
    assert tuned.switches == 2
    assert epochs == ref_epochs  # the user's order, epoch after epoch, though served by other loaders
    assert len(states) == 4 and states == ref_states  # mid-epoch, a resumed user loader serves exactly the same rest


def test_loading_a_mid_epoch_state_serves_the_rest_of_that_epoch():
    reference = user_loader(0)
    it = iter(reference)
    for _ in range(2):
        next(it)
    state = reference.state_dict()
    expected = [b.tolist() for b in it]
    tuned = tunable_loader(user_loader(0))
    tuned.load_state_dict(state)
    assert [b.tolist() for b in tuned] == expected
    # And its own state mid-way through that rest resumes a user loader there.
    tuned.load_state_dict(state)
    served = []
    for batch in tuned:
        served.append(batch.tolist())
        if len(served) == 2:
            assert rest(tuned.state_dict(), 0) == expected[2:]


def test_plain_loaders_stay_stateless_and_iterable_stateful_loaders_are_refused():
    plain = tunable_loader(DataLoader(Indices(), batch_size=4))
    assert type(plain) is TunableLoader and not hasattr(plain, "state_dict")

    class Stream(PositionStream):
        def read(self, position: int) -> torch.Tensor:
            return torch.tensor(position)

    with pytest.raises(RebuildError, match=r"a StatefulDataLoader over an iterable dataset keeps per-worker state"):
        tunable_loader(StatefulDataLoader(Stream(8), batch_size=2))


def test_checkpoints_move_no_random_stream_and_orders_match_an_untuned_loader():
    # E's data modules: shuffle from the loader's own seeded generator (data/loaders.py seeded_loader).
    def seeded() -> StatefulDataLoader:
        return StatefulDataLoader(Indices(), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(3))

    user = seeded()
    untuned = []
    for _ in range(2):
        untuned.append([b.tolist() for b in user])
    tuned_user = seeded()
    tuned = tunable_loader(tuned_user)
    served = []
    for _ in range(2):
        epoch = []
        for batch in tuned:
            epoch.append(batch.tolist())
            before = (torch.get_rng_state(), tuned_user.generator.get_state())
            tuned.state_dict()  # a checkpoint
            after = (torch.get_rng_state(), tuned_user.generator.get_state())
            assert all(torch.equal(a, b) for a, b in zip(before, after))
        served.append(epoch)
    assert served == untuned
