"""DistributedGPipeStrategy on LightningModules that build their network in ``configure_model``: each of 2 gloo ranks
materializes only its stages and what is outside the blocks (the rest stays on ``meta``), with the values of the user's
own seeded build (run again whole, where it fits), and training equals plain Lightning's, float64."""

from __future__ import annotations

import functools

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy
from tests.support.user_script import finish_beside, params_of_collected, start_user_script
from tests.support.workers import WORKERS

NAMES = ["gpt", "llama", "litgpt"]


@functools.lru_cache(maxsize=None)
def _plain(name: str) -> tuple[dict[str, torch.Tensor], pl.LightningModule]:
    """Plain Lightning from the user's configure_model from seed 0, whole, in one process: its initial weights, and the
    model trained."""
    from tests.support.real_models import fit
    from tests.support.workers.deferred_worker import STEPS, reference

    plain = reference(name)
    start = {n: t.clone() for n, t in plain.state_dict().items()}
    fit(plain, steps=STEPS, precision="64-true")
    return start, plain


@pytest.fixture(scope="module")
def two_ranks(request, tmp_path_factory):
    """The worker's outputs; while its 2 ranks run, this process trains the plain references the session's
    test_configure_model_networks_train_like_plain_lightning_from_the_same_initial_weights cases need."""
    pytest.importorskip("transformers")
    pytest.importorskip("litgpt")
    out = tmp_path_factory.mktemp("deferred")
    job = start_user_script(WORKERS / "deferred_worker.py", [str(out), ",".join(NAMES)], 240, "2-process deferred init")
    finish_beside(job, lambda: [_plain(v) for v in params_of_collected(request, test_configure_model_networks_train_like_plain_lightning_from_the_same_initial_weights, "name")])
    return out


def _blocks_of(task: nn.Module) -> list[str]:
    """The parameter-name prefix of each block, in order (what blocks='auto' finds)."""
    from lightning_accel.models.block_policy import find_blocks

    return [f"net.{b.name}." for b in find_blocks(task.net)]


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_configure_model_networks_train_like_plain_lightning_from_the_same_initial_weights(two_ranks, name):
    from tests.support.real_models import assert_same_weights
    from tests.support.workers.deferred_worker import reference

    start, plain = _plain(name)  # the user's configure_model from seed 0, whole, in one process: the initial weights, then trained
    assert any(not torch.equal(start[n], t) for n, t in plain.state_dict().items())  # it trained
    piped = reference(name)
    piped.load_state_dict(torch.load(two_ranks / f"{name}.ckpt", weights_only=False)["state_dict"], strict=True)
    assert_same_weights(plain, piped, rtol=1e-9, atol=1e-11)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_each_rank_materializes_only_its_stages_and_what_is_outside_the_blocks(two_ranks, name):
    from tests.support.workers.deferred_worker import reference

    whole = reference(name)
    blocks = _blocks_of(whole)
    names = [n for n, _ in whole.named_parameters()]
    in_block = {n: next((k for k, prefix in enumerate(blocks) if n.startswith(prefix)), None) for n in names}
    from lightning_accel.models.block_policy import find_blocks
    from lightning_accel.pipeline.partition import balance_by_cost, block_bytes

    balance = balance_by_cost(block_bytes([b.module for b in find_blocks(whole.net)]), 2)  # the default, by_size
    owned = [set(range(balance[0])), set(range(balance[0], len(blocks)))]
    for r in range(2):
        info = torch.load(two_ranks / f"{name}-rank{r}.pt", weights_only=False)
        expected = {n for n in names if in_block[n] is None or in_block[n] in owned[r]}
        assert set(info["at_start"]) == set(info["after_fit"]) == expected, f"rank {r}"
        assert set(info["meta"]) == set(names) - expected and info["meta"], f"rank {r}: other stages stay on meta"


@pytest.mark.slow
def test_a_model_built_on_meta_resumes_from_a_checkpoint_into_each_ranks_part(two_ranks):
    """The checkpoint given to fit loads after setup has materialized each rank's part (seed 1's initial weights are all
    replaced): resumed from 2 steps to 4 equals plain Lightning resuming the same checkpoint."""
    from tests.support.workers.deferred_worker import STEPS, reference
    from tests.support.real_models import assert_same_weights, fit

    plain = reference("gpt")
    fit(plain, steps=STEPS, precision="64-true", ckpt_path=two_ranks / "gpt-half.ckpt")
    piped = reference("gpt")
    piped.load_state_dict(torch.load(two_ranks / "gpt-resumed.ckpt", weights_only=False)["state_dict"], strict=True)
    assert_same_weights(plain, piped, rtol=1e-9, atol=1e-11)


class Unresettable(nn.Module):
    """A layer with a parameter and no way to initialize it again: no reset_parameters, no model initializer."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class Late(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net: nn.Module | None = None

    def configure_model(self) -> None:
        if self.net is None:
            self.net = nn.Sequential(nn.Linear(4, 4), Unresettable(), nn.Linear(4, 4))

    def training_step(self, batch, batch_idx):
        return nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(**strategy) -> pl.Trainer:
    return pl.Trainer(
        accelerator="cpu", devices=1, strategy=DistributedGPipeStrategy(chunks=2, **strategy), max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )


def _data() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(4, 4), torch.randn(4, 4)), batch_size=4)


class Starts(pl.Callback):
    """The module's parameters once setup has placed them."""

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.values = {n: p.detach().clone() for n, p in pl_module.named_parameters()}


def test_a_network_built_on_meta_starts_from_the_users_own_seeded_build(one_rank):
    """configure_model builds on meta; setup runs it again whole from the random state it started from (it fits), so the
    starting weights are the user's seed's draws, as under plain Lightning, even for a layer that could not be
    initialized again (Unresettable). Before: per-module seeds (the conformance cell configure_model: 0.86 off)."""
    pl.seed_everything(5, verbose=False)
    plain = Late()
    plain.configure_model()
    pl.seed_everything(5, verbose=False)
    starts, model = Starts(), Late()
    trainer = _trainer()
    trainer.callbacks.append(starts)
    trainer.fit(model, _data())
    assert starts.values.keys() == dict(plain.named_parameters()).keys()
    for name, value in plain.named_parameters():
        assert torch.equal(starts.values[name], value), name


def test_a_network_too_big_to_build_again_whole_is_materialized_in_parts_or_refused_in_one_line(one_rank, monkeypatch):
    import lightning_accel.strategies.gpipe_configure_model as strategy

    monkeypatch.setattr(strategy, "available_host_bytes", lambda: 0)  # no room for the whole network
    with pytest.warns(UserWarning, match=r"the network built in configure_model \(0.0 GiB\) does not fit whole .* each rank "
                      r"initializes its own part from per-module seeds"):
        with pytest.raises(ValueError, match=r"cannot initialize 'net.1' \(Unresettable\) after building it on the meta device: "
                           r"it has no reset_parameters\(\) for \['scale'\]; give Unresettable a reset_parameters\(\)"
                           r".*or build the network in __init__") as err:
            _trainer().fit(Late(), _data())
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"cannot initialize 'net.1' \(Unresettable\)"):  # never whole, asked for
        _trainer(deferred_init="parts").fit(Late(), _data())


def test_deferred_init_off_builds_the_whole_network_as_before(one_rank):
    model = Late()
    _trainer(deferred_init=False).fit(model, _data())
    assert not any(p.is_meta for p in model.parameters())


def test_balance_by_time_is_refused_for_a_network_built_on_meta(one_rank):
    """by_time times every block on rank 0, which a deferred network never has whole (2 stages on one rank here)."""

    class TwoStages(Late):
        def configure_model(self) -> None:
            if self.net is None:
                self.net = nn.Sequential(*(nn.Linear(4, 4) for _ in range(2)))

    with pytest.raises(ValueError, match=r"balance='by_time' times every block of Sequential on rank 0.*; use balance='by_size'"):
        _trainer(schedule="interleaved_1f1b", balance="by_time").fit(TwoStages(), _data())


def test_only_configure_model_builds_on_meta_not_trainer_init_module():
    trainer = _trainer()
    with pytest.warns(UserWarning, match="Please instantiate your model inside the`LightningModule.configure_model`"):
        with trainer.init_module():
            layer = nn.Linear(2, 2)
    assert not layer.weight.is_meta
    with trainer.strategy.model_sharded_context():
        assert nn.Linear(2, 2).weight.is_meta
