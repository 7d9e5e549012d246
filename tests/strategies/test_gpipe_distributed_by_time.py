"""DistributedGPipeStrategy(balance="by_time") on 2 gloo ranks launched by Lightning, against plain Lightning."""

from __future__ import annotations


import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.models import MLP
from lightning_accel.pipeline.partition import balance_by_cost, block_bytes
from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy
from tests.support.user_script import run_user_script
from tests.support.workers import WORKERS
from tests.support.workers.gpipe_by_time_worker import Losses, UnevenRegressor, train_loader, val_loader


def _plain_fit():
    """Plain single-process Lightning on the same model, data order, optimizer and precision."""
    model, losses = UnevenRegressor(), Losses()
    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", devices=1, precision="64-true", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[losses],
    )
    trainer.fit(model, train_loader(as_lightning_distributes_it=True), val_loader())
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    return losses.returned, weights, float(trainer.callback_metrics["val/loss"])


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Run the user script; Lightning starts rank 1 from it. Kill the whole process group on a hang."""
    out = tmp_path_factory.mktemp("by_time")
    result = run_user_script(WORKERS / "gpipe_by_time_worker.py", [str(out)], 120, "2-process by_time training")
    assert result.returncode == 0, result.stdout[-4000:]
    assert "balance='by_time' [1, 3]:" in result.stdout  # rank 0 says what it measured
    return [torch.load(out / f"by_time-rank{r}.pt", weights_only=False) for r in range(2)]


def test_by_time_splits_as_the_measured_times_say_and_every_rank_agrees(two_ranks):
    """Block 0 has the bytes of one block and the time of 100: by_size splits [2, 2], by_time [1, 3]; rank 0's
    times reach rank 1, so both split the same, and each holds the parameters of its stage of that split."""
    net = UnevenRegressor().net
    assert balance_by_cost(block_bytes(list(net.blocks)), 2) == [2, 2]
    times = two_ranks[0]["times"]
    assert len(times) == 4 and times[0] > 10 * max(times[1:]), times
    assert two_ranks[1]["times"] == times  # broadcast, not measured again
    assert two_ranks[0]["balance"] == two_ranks[1]["balance"] == balance_by_cost(times, 2) == [1, 3]
    for r, rank in enumerate(two_ranks):  # stage 0 (rank 0): block 0; stage 1: blocks 1-3; pre and post on both
        blocks = {n.split(".")[2] for n in rank["resident"] if n.startswith("net.blocks.")}
        assert blocks == ({"0"} if r == 0 else {"1", "2", "3"}), (r, blocks)
        assert {n for n in rank["resident"] if not n.startswith("net.blocks.")} == {
            n for n, _ in UnevenRegressor().named_parameters() if not n.startswith("net.blocks.")
        }


def test_by_time_trains_like_plain_lightning(two_ranks):
    """The timing runs the model before training: it must leave the weights as they were, so every loss, weight and
    validation equals plain Lightning's (float64)."""
    ref_losses, ref_weights, ref_val = _plain_fit()
    for rank in two_ranks:
        torch.testing.assert_close(rank["returned"], ref_losses, rtol=1e-12, atol=0)
        torch.testing.assert_close(rank["val"], ref_val, rtol=1e-10, atol=0)
    weights = {**two_ranks[0]["resident"], **two_ranks[1]["resident"]}
    assert set(weights) == set(ref_weights)
    for name in set(two_ranks[0]["resident"]) & set(two_ranks[1]["resident"]):  # pre, post: the same on both ranks
        torch.testing.assert_close(two_ranks[0]["resident"][name], two_ranks[1]["resident"][name], rtol=0, atol=0)
    for name, weight in ref_weights.items():
        torch.testing.assert_close(weights[name], weight, rtol=1e-10, atol=1e-12, msg=name)


def test_an_unknown_balance_mode_fails_before_any_work():
    with pytest.raises(ValueError, match=r"balance must be a list of blocks per stage, 'by_size' or 'by_time', got 'fast'"):
        DistributedGPipeStrategy(balance="fast")
    assert DistributedGPipeStrategy(balance="by_time").balance == "by_time"


class NoExample(UnevenRegressor):
    def __init__(self) -> None:
        super().__init__()
        self.example_input_array = None


def _fit_one_rank(model: pl.LightningModule, **strategy_kwargs) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=DistributedGPipeStrategy(chunks=2, **strategy_kwargs), max_steps=1,
        precision="64-true", logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, use_distributed_sampler=False,
    )
    trainer.fit(model, DataLoader(TensorDataset(torch.randn(8, 5), torch.randn(8, 3)), batch_size=8))
    return trainer


def test_by_time_without_example_input_array_says_how_to_fix_it(one_rank):
    """Two stages on one rank (interleaved_1f1b): the split needs the times, and there is no sample."""
    with pytest.raises(ValueError, match=r"balance='by_time' times each block before the first batch, on NoExample\."
                                         r"example_input_array, which is None; set self\.example_input_array"):
        _fit_one_rank(NoExample(), schedule="interleaved_1f1b", balance="by_time", blocks=lambda net: list(net.blocks))


def test_by_time_on_one_rank_leaves_the_blocks_where_they_were(one_rank):
    """interleaved_1f1b on one rank: 2 stages, timed on this rank's device; the blocks come back to the CPU whole."""
    model = UnevenRegressor()
    trainer = _fit_one_rank(model, schedule="interleaved_1f1b", balance="by_time", blocks=lambda net: list(net.blocks))
    times = trainer.strategy._block_times
    # the split, not a ratio of wall times: on a loaded machine one of the 0.1 ms blocks measured 14 ms against
    # block 0's 23 ms (every one of its 5 rounds preempted), and block 0 alone still outweighs the rest
    assert times[0] == max(times) and balance_by_cost(times, 2) == [1, 3], times
    assert all(not p.is_meta for p in model.parameters())  # one rank holds every stage
    assert isinstance(model.net, MLP)
