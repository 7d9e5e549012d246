"""DistributedGPipeStrategy on 2 gloo ranks launched by Lightning against plain single-process Lightning."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.models import MLP
from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy, _reduce_logs

PIPELINE_TESTS = Path(__file__).resolve().parents[1] / "pipeline"
sys.path.insert(0, str(PIPELINE_TESTS))
from gpipe_models import CLIP, gpt_loader, gpt_task  # noqa: E402

STEPS = 4  # one epoch: the resumed run starts the next epoch, as plain training does
SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b"]


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.returned: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.returned.append(float(outputs["loss"]))


def _plain_fit(steps: int, ckpt_path=None, save=None):
    """Plain single-process Lightning: the same model, data, optimizer and precision."""
    task, losses = gpt_task(), Losses()
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", devices=1, precision="64-true", logger=False, enable_checkpointing=False,
        gradient_clip_val=CLIP,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[losses],
    )
    trainer.fit(task, gpt_loader(as_lightning_distributes_it=True), ckpt_path=ckpt_path)
    if save:
        trainer.save_checkpoint(save)
    return losses.returned, {n: p.detach().clone() for n, p in task.named_parameters()}


def _launch(out: Path, timeout: float = 90.0) -> subprocess.CompletedProcess:
    """Run the user script; Lightning starts rank 1 from it. Kill the whole process group on a hang."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for var in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)  # a fresh launch, not a rank of some outer job
    env["PYTHONPATH"] = os.pathsep.join([str(PIPELINE_TESTS.parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, str(PIPELINE_TESTS / "gpipe_lightning_worker.py"), str(out), ",".join(SCHEDULES), str(STEPS)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"2-process pipeline training still running after {timeout} s: a hang")
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """STEPS plain steps, then plain Lightning resuming from its own checkpoint for STEPS more."""
    ckpt = tmp_path_factory.mktemp("plain") / "plain.ckpt"
    losses, weights = _plain_fit(STEPS, save=ckpt)
    return losses, weights, _plain_fit(2 * STEPS, ckpt_path=ckpt)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpipe2")
    result = _launch(out)
    assert result.returncode == 0, result.stdout[-4000:]
    return out


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_processes_train_like_plain_lightning(two_ranks, reference, schedule):
    ref_losses, ref_weights, _ = reference
    rank0 = torch.load(two_ranks / f"{schedule}-rank0.pt", weights_only=False)
    # the loss every step returned on rank 0, and what training_step logged there, came from the last stage
    torch.testing.assert_close(rank0["returned"], ref_losses, rtol=1e-12, atol=0)
    torch.testing.assert_close(rank0["logged"], ref_losses, rtol=1e-12, atol=0)
    # the checkpoint holds the user's names and every stage's trained weights: load it into a plain model
    checkpoint = torch.load(two_ranks / f"{schedule}.ckpt", weights_only=False)
    plain = gpt_task().double()  # the 64-true run saved float64
    plain.load_state_dict(checkpoint["state_dict"], strict=True)
    for name, weight in ref_weights.items():
        torch.testing.assert_close(dict(plain.named_parameters())[name], weight, rtol=1e-10, atol=1e-12, msg=name)
        torch.testing.assert_close(rank0["weights"][name], weight, rtol=1e-10, atol=1e-12, msg=name)
    # the optimizer state of both stages, gathered: AdamW has a step for every parameter
    state = checkpoint["optimizer_states"][0]["state"]
    assert sorted(state) == list(range(len(ref_weights)))
    assert all(int(s["step"]) == STEPS for s in state.values())
    assert checkpoint["global_step"] == STEPS


def test_resuming_from_the_gathered_checkpoint_is_exact(two_ranks, reference):
    """The pipeline resuming from its checkpoint, and plain Lightning resuming from that same checkpoint,
    both continue exactly as plain Lightning resuming from its own."""
    _, _, (ref_losses, ref_weights) = reference
    resumed = torch.load(two_ranks / "gpipe-resumed-rank0.pt", weights_only=False)
    plain_losses, plain_weights = _plain_fit(2 * STEPS, ckpt_path=two_ranks / "gpipe.ckpt")
    for losses, weights in ((resumed["returned"], resumed["weights"]), (plain_losses, plain_weights)):
        torch.testing.assert_close(losses, ref_losses, rtol=1e-12, atol=0)
        for name, weight in ref_weights.items():
            torch.testing.assert_close(weights[name], weight, rtol=1e-10, atol=1e-12, msg=name)


def test_logged_values_reduce_over_micro_batches_like_the_loss():
    records = [[("loss", 1.0, {"batch_size": 2})], [("loss", 4.0, {"batch_size": 6}), ("tag", "x", {})]]
    assert _reduce_logs(records, [2, 6], "mean") == [("loss", 3.25, {"batch_size": 8}), ("tag", "x", {})]
    assert _reduce_logs(records, [2, 6], "sum") == [("loss", 5.0, {"batch_size": 8}), ("tag", "x", {})]


def test_bad_options_fail_before_any_work():
    with pytest.raises(ValueError, match=r"chunks must be a positive int.*got 0"):
        DistributedGPipeStrategy(chunks=0)
    with pytest.raises(ValueError, match=r"schedule must be one of gpipe, 1f1b, interleaved_1f1b, got 'zb'"):
        DistributedGPipeStrategy(schedule="zb")
    with pytest.raises(ValueError, match=r"loss_reduction must be 'mean' or 'sum'"):
        DistributedGPipeStrategy(loss_reduction="max")
    with pytest.raises(ValueError, match=r"balance must be a list of blocks per stage or 'by_size', got 'by_time'"):
        DistributedGPipeStrategy(balance="by_time")
    assert DistributedGPipeStrategy(timeout=5)._timeout == timedelta(seconds=5)
    assert DistributedGPipeStrategy().distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}


def test_is_a_parallel_strategy_lightning_launches_like_ddp():
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=DistributedGPipeStrategy(chunks=2), logger=False)
    assert trainer.world_size == 2 and trainer.strategy._get_process_group_backend() == "gloo"
    assert type(trainer.strategy._launcher).__name__ == "_SubprocessScriptLauncher"


@pytest.fixture
def one_rank():
    """Lightning's process group of 1 in this process, destroyed afterwards (other tests make their own)."""
    import torch.distributed as dist

    yield
    if dist.is_initialized():
        dist.destroy_process_group()


class SumRegressor(pl.LightningModule):
    """A model built here: a zoo MLP block network under ``self.net``, MSE summed or averaged over samples."""

    def __init__(self, reduction: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.reduction = MLP(5, 3, hidden=8, depth=2), reduction

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y, reduction=self.reduction)
        self.log("train/loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


@pytest.mark.parametrize(("reduction", "accumulate"), [("sum", 1), ("mean", 2)])
def test_one_rank_sum_losses_and_gradient_accumulation_match_plain_lightning(one_rank, reduction, accumulate):
    """In this process (a group of 1): the schedule's micro-batches, its 1/M scaling (or none for a
    summed loss) and the gradients held back until Lightning's backward, against plain Lightning."""
    g = torch.Generator().manual_seed(2)
    data = TensorDataset(torch.randn(32, 5, generator=g), torch.randn(32, 3, generator=g))
    weights = []
    for strategy in ("auto", DistributedGPipeStrategy(chunks=4, loss_reduction=reduction)):
        model = SumRegressor(reduction)
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, strategy=strategy, max_steps=3, accumulate_grad_batches=accumulate,
            precision="64-true", logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, use_distributed_sampler=False,
        )
        trainer.fit(model, DataLoader(data, batch_size=8))
        weights.append({n: p.detach().clone() for n, p in model.named_parameters()})
    for name, weight in weights[0].items():
        torch.testing.assert_close(weights[1][name], weight, rtol=1e-12, atol=1e-14, msg=name)
