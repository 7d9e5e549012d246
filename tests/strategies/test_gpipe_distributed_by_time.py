"""DistributedGPipeStrategy(balance="by_time") on 2 gloo ranks launched by Lightning, against plain Lightning."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.models import MLP
from lightning_accel.pipeline.partition import balance_by_cost, block_bytes
from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy, _time_blocks

PIPELINE_TESTS = Path(__file__).resolve().parents[1] / "pipeline"
sys.path.insert(0, str(PIPELINE_TESTS))
from gpipe_by_time_worker import Losses, UnevenRegressor, train_loader, val_loader  # noqa: E402


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
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # a fresh launch, not a rank of some outer job
    env["PYTHONPATH"] = os.pathsep.join([str(PIPELINE_TESTS.parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, str(PIPELINE_TESTS / "gpipe_by_time_worker.py"), str(out)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        stdout, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail("2-process by_time training still running after 120 s: a hang")
    assert proc.returncode == 0, stdout[-4000:]
    assert "balance='by_time' [1, 3]:" in stdout  # rank 0 says what it measured
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
    for r, rank in enumerate(two_ranks):  # stage 0 (rank 0): pre and block 0; stage 1: blocks 1-3 and post
        names = list(rank["resident"])
        assert names and all(n.startswith(("net.pre.", "net.blocks.0.")) == (r == 0) for n in names), (r, names)


def test_by_time_trains_like_plain_lightning(two_ranks):
    """The timing runs the model before training: it must leave the weights as they were, so every loss, weight and
    validation equals plain Lightning's (float64)."""
    ref_losses, ref_weights, ref_val = _plain_fit()
    for rank in two_ranks:
        torch.testing.assert_close(rank["returned"], ref_losses, rtol=1e-12, atol=0)
        torch.testing.assert_close(rank["val"], ref_val, rtol=1e-10, atol=0)
    weights = {**two_ranks[0]["resident"], **two_ranks[1]["resident"]}
    assert set(weights) == set(ref_weights)
    for name, weight in ref_weights.items():
        torch.testing.assert_close(weights[name], weight, rtol=1e-10, atol=1e-12, msg=name)


def test_an_unknown_balance_mode_fails_before_any_work():
    with pytest.raises(ValueError, match=r"balance must be a list of blocks per stage, 'by_size' or 'by_time', got 'fast'"):
        DistributedGPipeStrategy(balance="fast")
    assert DistributedGPipeStrategy(balance="by_time").balance == "by_time"


def test_timing_leaves_the_rng_buffers_and_gradients_as_they_were():
    """Dropout in the sample forward and the timed blocks, BatchNorm statistics, a gradient already there: after
    _time_blocks the RNG draws what it would have, and buffers and gradients are unchanged."""
    torch.manual_seed(0)
    net = MLP(5, 3, hidden=16, depth=3, dropout=0.5)
    net.blocks[1] = torch.nn.Sequential(torch.nn.BatchNorm1d(16), torch.nn.Dropout(0.5))
    net.blocks[0].fc1.weight.grad = torch.ones_like(net.blocks[0].fc1.weight)
    buffers = {n: b.clone() for n, b in net.named_buffers()}
    x = torch.randn(8, 5)
    state = torch.get_rng_state()
    times = _time_blocks(net, list(net.blocks), lambda: net(x), torch.device("cpu"))
    assert len(times) == 3 and all(t > 0 for t in times)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(b, buffers[n]) for n, b in net.named_buffers())
    assert torch.equal(net.blocks[0].fc1.weight.grad, torch.ones_like(net.blocks[0].fc1.weight))
    assert all(p.grad is None for n, p in net.named_parameters() if n != "blocks.0.fc1.weight")


@pytest.fixture
def one_rank():
    """Lightning's process group of 1 in this process, destroyed afterwards (other tests make their own)."""
    import torch.distributed as dist

    saved = dict(os.environ)  # Lightning sets MASTER_PORT, LOCAL_RANK, WORLD_SIZE, ... for the group
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(saved)


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
                                         r"example_input_array, which is None\. HINT: set self\.example_input_array"):
        _fit_one_rank(NoExample(), schedule="interleaved_1f1b", balance="by_time")


def test_by_time_on_one_rank_leaves_the_blocks_where_they_were(one_rank):
    """interleaved_1f1b on one rank: 2 stages, timed on this rank's device; the blocks come back to the CPU whole."""
    model = UnevenRegressor()
    trainer = _fit_one_rank(model, schedule="interleaved_1f1b", balance="by_time")
    times = trainer.strategy._block_times
    assert times[0] > 10 * max(times[1:]) and balance_by_cost(times, 2) == [1, 3]
    assert all(not p.is_meta for p in model.parameters())  # one rank holds every stage
    assert isinstance(model.net, MLP)
