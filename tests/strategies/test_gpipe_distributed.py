"""DistributedGPipeStrategy on 2 gloo ranks launched by Lightning against plain single-process Lightning."""

from __future__ import annotations

import functools
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.utilities import grad_norm
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.models import MLP
from lightning_accel.pipeline.step_report import reduce_logs
from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy
from tests.support.gpipe_models import CLIP, gpt_loader, gpt_task, stage_names, val_loader
from tests.support.user_script import UserScript, start_user_script
from tests.support.workers import WORKERS
from tests.support.workers.gpipe_lightning_worker import CASES, RESUMED

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb", "zbv", "dualpipev"]
# the rank of each stage where it is not s % 2: V-wise, rank 0 holds the first and the last stage
RANK_OF = {"zbv": [0, 1, 1, 0], "dualpipev": [0, 1, 1, 0]}


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.returned: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.returned.append(float(outputs["loss"]))


def _plain_fit(epochs: int, ckpt_path=None, save=None, n: int = 32):
    """Plain single-process Lightning: the same model, data (validated at each epoch's end, as the worker does),
    optimizer and precision; then its validation."""
    task, losses = gpt_task(), Losses()
    trainer = pl.Trainer(
        max_epochs=epochs, accelerator="cpu", devices=1, precision="64-true", logger=False, enable_checkpointing=False,
        gradient_clip_val=CLIP,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[losses],
    )
    trainer.fit(task, gpt_loader(as_lightning_distributes_it=True, n=n), val_loader(), ckpt_path=ckpt_path)
    if save:
        trainer.save_checkpoint(save)
    val = trainer.validate(task, val_loader(), verbose=False)[0]
    return losses.returned, {n: p.detach().clone() for n, p in task.named_parameters()}, val


def _start(out: Path, timeout: float = 90.0, script: str = "gpipe_lightning_worker.py", args=None, warm: bool = True) -> UserScript:
    """Start the user script (Lightning starts rank 1 from it); its ``result()`` waits for it."""
    args = args if args is not None else [str(out), ",".join([*SCHEDULES, "auto"]), "1"]
    return start_user_script(WORKERS / script, args, timeout, "2-process pipeline training", warm=warm)


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """The module's two 2-rank launches, started together at the first test that needs either (the workers' ranks wait on
    each other much of the time, the step report's are mostly a fresh interpreter's imports), while this process fits
    the plain references: one after another, the two launches and the references took a minute of CI's two cores with
    one mostly idle. Timeouts (hang guards): twice the one launch's alone, as the launches share the cores."""
    gpipe, steps = tmp_path_factory.mktemp("gpipe2"), tmp_path_factory.mktemp("step_results")
    # only the launches this session's tests of this module read (a -k selection may need one)
    needed = {name for i in request.session.items if getattr(i, "module", None) is request.module for name in getattr(i, "fixturenames", ())}
    jobs = {}
    if "two_ranks" in needed:
        jobs["gpipe"] = (gpipe, _start(gpipe, timeout=180.0))
    if "step_results" in needed:  # a fresh interpreter (warm=False): the worker counts threads at its exit after the strategy
        # module's exit hook, which holds only where the worker's hook is registered before that module is imported
        jobs["steps"] = (steps, _start(steps, timeout=180.0, script="step_report_worker.py", args=[str(steps)], warm=False))
    yield jobs
    for _out, job in jobs.values():
        job.kill()  # one still running when a test failed before waiting for it


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Per training-set size, one plain epoch; then plain Lightning resuming from its own checkpoint for another."""
    ckpt = tmp_path_factory.mktemp("plain") / "plain.ckpt"
    runs = {32: _plain_fit(1, save=ckpt), 36: _plain_fit(1, n=36)}  # 36: a fifth batch of 4
    return runs, _plain_fit(2, ckpt_path=ckpt)


@pytest.fixture(scope="module")
def two_ranks(launched, request):
    out, job = launched["gpipe"]
    request.getfixturevalue("reference")  # fitted while the ranks run
    result = job.result()
    assert result.returncode == 0, result.stdout[-4000:]
    (out / "stdout.txt").write_text(result.stdout)
    return out


def _ranks(out: Path, name: str) -> list[dict]:
    return [torch.load(out / f"{name}-rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_two_processes_train_like_plain_lightning(two_ranks, reference, schedule):
    chunks, balance, n = CASES[schedule]
    ref_losses, ref_weights, ref_val = reference[0][n]
    ranks = _ranks(two_ranks, schedule)
    # the loss every step returned on rank 0, and what training_step logged there, came from the last stage
    # (1f1b: 36 sequences, the fifth batch has 4 and got a schedule of its own)
    torch.testing.assert_close(ranks[0]["returned"], ref_losses, rtol=1e-12, atol=0)
    torch.testing.assert_close(ranks[0]["logged"], ref_losses, rtol=1e-12, atol=0)
    # validation through the pipeline (batches of 8, 8, 4), in fit and in trainer.validate after it, on every rank
    for rank in ranks:
        for val in (rank["val_in_fit"], rank["val_after"]):
            torch.testing.assert_close(val, {k: float(v) for k, v in ref_val.items()}, rtol=1e-10, atol=0)
    # the checkpoint holds the user's names and every stage's trained weights: load it into a plain model
    checkpoint = torch.load(two_ranks / f"{schedule}.ckpt", weights_only=False)
    plain = gpt_task().double()  # the 64-true run saved float64
    plain.load_state_dict(checkpoint["state_dict"], strict=True)
    for name, weight in ref_weights.items():
        torch.testing.assert_close(dict(plain.named_parameters())[name], weight, rtol=1e-10, atol=1e-12, msg=name)
    # the optimizer state of both stages, gathered under plain training's indices: AdamW has a step for every parameter
    state = checkpoint["optimizer_states"][0]["state"]
    assert sorted(state) == list(range(len(ref_weights)))
    assert all(int(s["step"]) == len(ref_losses) for s in state.values())
    assert checkpoint["global_step"] == len(ref_losses)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_rank_holds_only_its_stages_parameters_and_optimizer_state(two_ranks, reference, schedule):
    """Rank r keeps exactly the parameters of its stages' blocks and everything outside the blocks (pre, post), with the
    trained values; the other blocks are on the meta device. Each optimizer holds only its rank's parameters, with
    AdamW's two moments the size of each where the rank steps it: outside the blocks only the rank that uses it (pre:
    the first stage's, rank 0; post: the last stage's, rank 1) gets a gradient, steps it and keeps state for it."""
    _, balance, n = CASES[schedule]
    ref_weights = reference[0][n][1]
    ranks = _ranks(two_ranks, schedule)
    rank_of = RANK_OF.get(schedule, [s % 2 for s in range(len(balance))])
    expected = stage_names(gpt_task(), balance, 2, rank_of)
    outside = {n for n in ref_weights if not n.startswith("net.blocks.")}
    assert all(expected) and expected[0] & expected[1] == outside and expected[0] | expected[1] == set(ref_weights)
    nbytes = lambda names: sum(ref_weights[k].numel() * ref_weights[k].element_size() for k in names)  # noqa: E731
    for r, rank in enumerate(ranks):
        assert set(rank["resident"]) == expected[r], f"rank {r}"
        for name, weight in rank["resident"].items():
            torch.testing.assert_close(weight, ref_weights[name], rtol=1e-10, atol=1e-12, msg=name)
        resident_bytes = sum(t.numel() * t.element_size() for t in rank["resident"].values())
        assert resident_bytes == nbytes(expected[r]) < nbytes(ref_weights)
        assert set(rank["optimizer"]) == expected[r], f"rank {r}'s optimizer"
        # pre is used by the first stage's rank, post by the last's (V-wise both on rank 0, none on rank 1)
        used = {n for n in outside if (n.startswith("net.pre.") and rank_of[0] == r) or (n.startswith("net.post.") and rank_of[-1] == r)}
        assert {n for n, sizes in rank["optimizer"].items() if sizes} == (expected[r] - outside) | used
        for name, sizes in rank["optimizer"].items():
            if sizes:
                assert sizes["exp_avg"] == sizes["exp_avg_sq"] == ref_weights[name].numel(), name
    assert sum(sum(t.numel() for n, t in rank["resident"].items() if n not in outside) for rank in ranks) == sum(
        t.numel() for n, t in ref_weights.items() if n not in outside
    )


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_after_fit_every_ranks_module_is_the_whole_trained_model(two_ranks, schedule):
    """As after DDP: every rank's module holds every weight (the other stages gathered onto the CPU), equal to the
    gathered checkpoint, and computes what the plain model loaded from it computes (before: rank 1 kept its own stages
    only, its state_dict() held meta tensors and model(x) raised; before that, rank 0's too)."""
    ranks = _ranks(two_ranks, schedule)
    checkpoint = torch.load(two_ranks / f"{schedule}.ckpt", weights_only=False)["state_dict"]
    plain = gpt_task().double()  # the 64-true run saved float64
    plain.load_state_dict(checkpoint)
    for r, rank in enumerate(ranks):
        after = rank["after_fit"]
        assert set(after) == set(checkpoint), f"rank {r}"
        for name, tensor in checkpoint.items():
            torch.testing.assert_close(after[name], tensor, rtol=0, atol=0, msg=f"rank {r}: {name}")
        torch.testing.assert_close(rank["logits"], plain.net(rank["probe"]).detach(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_save_gathers_the_optimizer_state_on_rank_zero_only(two_ranks, schedule):
    """Rank 0 holds the whole model's optimizer state at a save; rank 1 only its own part (before: every rank of the
    pipeline gathered all of it, all_gather_object)."""
    whole = torch.load(two_ranks / f"{schedule}.ckpt", weights_only=False)["optimizer_states"][0]["state"]
    ranks = _ranks(two_ranks, schedule)
    assert ranks[0]["optimizer_entries"] == len(whole)
    own = sum(1 for sizes in ranks[1]["optimizer"].values() if sizes)
    assert ranks[1]["optimizer_entries"] == own < len(whole)


class Norms(pl.Callback):
    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.norms.append(float(grad_norm(pl_module, 2)["grad_2.0_norm_total"]))


@functools.cache
def _plain_norms(n: int) -> tuple[float, ...]:
    """Lightning's grad_norm total before each step of plain training on ``n`` sequences (one fit per ``n``)."""
    norms = Norms()
    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", devices=1, precision="64-true", logger=False, enable_checkpointing=False,
        gradient_clip_val=CLIP, enable_progress_bar=False, enable_model_summary=False, callbacks=[norms],
        num_sanity_val_steps=0,
    )
    trainer.fit(gpt_task(), gpt_loader(as_lightning_distributes_it=True, n=n))
    return tuple(norms.norms)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_the_whole_models_gradient_norm_is_one_call_on_every_rank(two_ranks, schedule):
    """Each rank holds its own stages' gradients in on_before_optimizer_step: strategy.grad_norm(2) on every rank equals
    the total of Lightning's grad_norm in plain training (before clipping), and the notice says so once."""
    for rank in _ranks(two_ranks, schedule):
        torch.testing.assert_close(rank["norms"], list(_plain_norms(CASES[schedule][2])), rtol=1e-10, atol=0)
    said = (two_ranks / "stdout.txt").read_text()
    assert said.count("DistributedGPipeStrategy: in on_after_backward and on_before_optimizer_step each rank holds the "
                      "gradients of its own stages") == 1  # rank 0 only; Python's warning filter: once per process
    assert "trainer.strategy.grad_norm(2) gives the whole model's norm" in said


@pytest.mark.parametrize("schedule", RESUMED)
def test_resuming_from_the_gathered_checkpoint_is_exact(two_ranks, reference, schedule):
    """The pipeline resuming from its checkpoint (each rank taking its stages' weights and optimizer state), and plain
    Lightning resuming from that same checkpoint, both continue exactly as plain Lightning resuming from its own."""
    _, (ref_losses, ref_weights, _) = reference
    resumed = _ranks(two_ranks, f"{schedule}-resumed")
    torch.testing.assert_close(resumed[0]["returned"], ref_losses, rtol=1e-12, atol=0)
    weights = {**resumed[0]["resident"], **resumed[1]["resident"]}
    assert set(weights) == set(ref_weights)
    for name, weight in ref_weights.items():
        torch.testing.assert_close(weights[name], weight, rtol=1e-10, atol=1e-12, msg=name)
    if schedule not in ("gpipe", "zbv"):  # plain Lightning reads one checkpoint per placement (one stage, V-wise)
        return
    plain_losses, plain_weights, _ = _plain_fit(2, ckpt_path=two_ranks / f"{schedule}.ckpt")
    torch.testing.assert_close(plain_losses, ref_losses, rtol=1e-12, atol=0)
    for name, weight in ref_weights.items():
        torch.testing.assert_close(plain_weights[name], weight, rtol=1e-10, atol=1e-12, msg=name)


def test_logged_values_reduce_over_micro_batches_like_the_loss():
    records = [[("loss", 1.0, {"batch_size": 2})], [("loss", 4.0, {"batch_size": 6}), ("tag", "x", {})]]
    assert reduce_logs(records, [2, 6], "mean") == [("loss", 3.25, {"batch_size": 8}), ("tag", "x", {})]
    assert reduce_logs(records, [2, 6], "sum") == [("loss", 5.0, {"batch_size": 8}), ("tag", "x", {})]


@pytest.mark.parametrize(("fx", "expected"), [("sum", 24.0), (torch.sum, 24.0), ("max", 16.0), ("min", 8.0), ("mean", 12.0)])
def test_logged_values_keep_their_reduce_fx_over_micro_batches(fx, expected):
    """A value logged with reduce_fx="sum" (a count) is the micro-batches' sum, as the whole batch would log it, whatever
    the loss reduction; "max"/"min" likewise; the default mean is weighted like the loss (before: every value averaged)."""
    records = [[("count", torch.tensor(8.0), {"reduce_fx": fx})], [("count", torch.tensor(16.0), {"reduce_fx": fx})]]
    [(name, value, kwargs)] = reduce_logs(records, [4, 4], "mean")
    assert (name, float(value), kwargs) == ("count", expected, {"reduce_fx": fx})


@pytest.fixture(scope="module")
def step_results(launched):
    """tests/support/workers/step_report_worker.py on 2 ranks: what each rank logged and returned per step."""
    out, job = launched["steps"]
    result = job.result()
    assert result.returncode == 0, result.stdout[-4000:]
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return ranks, [int((out / f"threads-at-exit-rank{r}.txt").read_text()) for r in range(2)]


def test_logs_that_come_and_go_change_name_or_are_not_numbers_arrive_exactly_on_every_rank(step_results):
    from tests.support.workers.step_report_worker import CHANGED, STEPS, expected_logs
    from tests.support.workers.step_report_worker import bits

    first, last = step_results[0]  # rank 1 runs training_step: its values are the source
    for step in range(STEPS):
        names = [name for name, _, _ in expected_logs(step, torch.tensor(0.0))]
        assert [name for name, _, _ in last["seen"][step]] == names, step
        # every rank logged the same names, options and values, to the bit (and dtype, shape, python type)
        assert [(n, bits(v), kw) for n, v, kw in first["seen"][step]] == [
            (n, bits(v), kw) for n, v, kw in last["seen"][step]
        ], step
        assert bits(first["returned"][step]) == bits(last["returned"][step]), step
        logged = {name: value for name, value, _ in last["seen"][step]}
        assert logged["step_int"] == float(step) and type(logged["step_int"]) is float  # the micro-batches' mean
        assert logged["half"].dtype == torch.bfloat16
        # logged with reduce_fx="max": the micro-batches' max, an int64 as the whole batch would log it
        assert logged["count"].dtype == torch.int64 and int(logged["count"]) == step * 1000
        torch.testing.assert_close(logged["always"], last["returned"][step].float())
        if step in (2, 3):
            assert logged["sometimes"] == step / 3
        if step == 6:
            assert type(logged["np32"]) is np.float32 and logged["np32"] == np.float32(6.25)
    # a dict's key beside the loss reaches every rank, the whole batch's (equal micro-batches' means: their mean), to
    # the bit; before, on_train_batch_end got the loss alone
    assert [keys for keys, _ in first["others"]] == [["loss", "mae"]] * STEPS
    assert [bits(v) for _, v in first["others"]] == [bits(v) for _, v in last["others"]]
    # the object path only where the names or kinds changed; otherwise one float64 tensor broadcast
    assert [step for step, calls in enumerate(first["object_calls"]) if calls] == CHANGED
    assert first["object_calls"] == last["object_calls"]
    assert set(first["object_calls"]) <= {0, 1}


def test_after_destroy_process_group_no_gloo_thread_outlives_into_interpreter_teardown(step_results):
    """The mesh's gloo groups (new ones even for dp = 1) each run threads that destroy_process_group does not stop;
    left to interpreter teardown they were joined at some arbitrary point of it. The worker destroys the process
    group after fit and, at exit, counts gloo threads after the strategy module's exit hook has run."""
    counts = step_results[1]
    if -1 in counts:
        pytest.skip("no /proc/<pid>/task to count threads in")
    assert counts == [0, 0]


def test_every_fit_in_a_process_shares_one_mesh_until_the_process_group_is_replaced(one_rank):
    import torch.distributed as dist

    from lightning_accel.pipeline.mesh import process_mesh

    meshes = []
    for _ in range(2):  # a process group, destroyed, then a new one (one rank: an in-memory store, no port)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        meshes.append(process_mesh("cpu", 1, 1, timedelta(seconds=17)))
        assert process_mesh("cpu", 1, 1, timedelta(seconds=17)) is meshes[-1]  # a second fit: the same groups
        for dim in ("pp", "dp"):  # the strategy's timeout, not torch's 30-minute default for new groups
            assert meshes[-1].get_group(dim)._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=17)
        dist.destroy_process_group()
    assert meshes[1] is not meshes[0]  # the first mesh's groups went with the first process group


def test_bad_options_fail_before_any_work():
    with pytest.raises(ValueError, match=r"chunks must be a positive int.*got 0"):
        DistributedGPipeStrategy(chunks=0)
    with pytest.raises(ValueError, match=r"schedule must be one of gpipe, 1f1b, interleaved_1f1b, interleaved_zb, zbv, dualpipev, got 'zb'"):
        DistributedGPipeStrategy(schedule="zb")
    with pytest.raises(ValueError, match=r"loss_reduction must be 'mean' or 'sum'"):
        DistributedGPipeStrategy(loss_reduction="max")
    with pytest.raises(ValueError, match=r"balance must be a list of blocks per stage, 'by_size' or 'by_time', got 'fast'"):
        DistributedGPipeStrategy(balance="fast")
    with pytest.raises(ValueError, match=r"checkpoint must be one of always, except_last, never, got 'some'"):
        DistributedGPipeStrategy(checkpoint="some")
    assert DistributedGPipeStrategy(timeout=5)._timeout == timedelta(seconds=5)
    assert DistributedGPipeStrategy().distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}


def test_is_a_parallel_strategy_lightning_launches_like_ddp():
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=DistributedGPipeStrategy(chunks=2), logger=False)
    assert trainer.strategy.num_processes == 2 and trainer.strategy._get_process_group_backend() == "gloo"
    assert trainer.world_size == 1  # replicas, as DDP's world size counts them: one pipeline of 2 stages
    assert type(trainer.strategy._launcher).__name__ == "_SubprocessScriptLauncher"


class SumRegressor(pl.LightningModule):
    """A model built here: a zoo MLP block network under ``self.net``, MSE summed or averaged over samples."""

    def __init__(self, reduction: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.reduction = MLP(5, 3, hidden=8, depth=2), reduction
        self.samples = 0  # side effects after the network call: samples the loss was computed on

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        self.samples += x.size(0)
        loss = torch.nn.functional.mse_loss(out, y, reduction=self.reduction)
        self.log("train/loss", loss)
        return loss

    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


def _fit_both(data, strategy_kwargs, max_steps=-1, accumulate=1, reduction="mean"):
    """The same SumRegressor trained by plain Lightning and by the pipeline strategy on one rank."""
    runs = []
    for strategy in ("auto", DistributedGPipeStrategy(loss_reduction=reduction, **strategy_kwargs)):
        model = SumRegressor(reduction)
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, strategy=strategy, max_steps=max_steps, max_epochs=None if max_steps > 0 else 1,
            accumulate_grad_batches=accumulate, precision="64-true", logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
        )
        trainer.fit(model, DataLoader(data, batch_size=8))
        runs.append((model, {n: p.detach().clone() for n, p in model.named_parameters()}))
    return runs


def _regression_data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g))


@pytest.mark.parametrize(("reduction", "accumulate"), [("sum", 1), ("mean", 2)])
def test_one_rank_sum_losses_and_gradient_accumulation_match_plain_lightning(one_rank, reduction, accumulate):
    """In this process (a group of 1): the schedule's micro-batches, its 1/M scaling (or none for a
    summed loss) and the gradients held back until Lightning's backward, against plain Lightning."""
    (plain, weights), (piped, piped_weights) = _fit_both(
        _regression_data(32), {"chunks": 4}, max_steps=3, accumulate=accumulate, reduction=reduction
    )
    for name, weight in weights.items():
        torch.testing.assert_close(piped_weights[name], weight, rtol=1e-12, atol=1e-14, msg=name)
    # training_step ran once per micro-batch: torch's shape inference on the first step did not run it again
    assert piped.samples == plain.samples == 3 * accumulate * 8


def test_one_rank_smaller_last_batch_gets_its_own_schedule(one_rank):
    """36 samples in batches of 8: the last has 4, still a multiple of chunks=4, and trains like plain Lightning."""
    (plain, weights), (piped, piped_weights) = _fit_both(_regression_data(36), {"chunks": 4})
    for name, weight in weights.items():
        torch.testing.assert_close(piped_weights[name], weight, rtol=1e-12, atol=1e-14, msg=name)
    assert piped.samples == plain.samples == 36


def test_one_rank_last_batch_not_divisible_by_chunks_trains_in_fewer_micro_batches(one_rank):
    """34 samples: the last batch of 2 cannot make 4 equal micro-batches; it trains as 2 of 1 (before: skipped with a
    warning, so the pipeline trained on 32 samples where plain Lightning trained on 34)."""
    (plain, weights), (piped, piped_weights) = _fit_both(_regression_data(34), {"chunks": 4})
    for name, weight in weights.items():
        torch.testing.assert_close(piped_weights[name], weight, rtol=1e-12, atol=1e-14, msg=name)
    assert piped.samples == plain.samples == 34


def test_a_module_split_by_one_fit_refuses_another_split(one_rank):
    """After fit the module stays split; a later run must use the same layout, or build a fresh model."""
    model = SumRegressor("mean")
    assert len(model.net.blocks) == 2
    trainer_kwargs = dict(
        accelerator="cpu", devices=1, max_steps=1, precision="64-true", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )
    loader = DataLoader(_regression_data(8), batch_size=8)
    pl.Trainer(strategy=DistributedGPipeStrategy(chunks=2, balance=[2]), **trainer_kwargs).fit(model, loader)
    with pytest.raises(ValueError, match=r"split for 1 ranks with balance \[2\] by an earlier run.*; build a fresh"):
        pl.Trainer(strategy=DistributedGPipeStrategy(chunks=2, schedule="interleaved_1f1b"), **trainer_kwargs).fit(
            model, loader
        )


def test_one_rank_predict_runs_the_stages_in_order(one_rank):
    """predict through the pipeline's evaluation path returns what plain Lightning's predict returns."""
    (plain, _), (piped, _) = _fit_both(_regression_data(16), {"chunks": 2})
    loader = DataLoader(_regression_data(12), batch_size=8)  # batches of 8 and 4
    kwargs = dict(accelerator="cpu", devices=1, precision="64-true", logger=False, enable_progress_bar=False,
                  use_distributed_sampler=False)
    expected = pl.Trainer(**kwargs).predict(plain, loader)
    got = pl.Trainer(strategy=DistributedGPipeStrategy(chunks=2), **kwargs).predict(piped, loader)
    assert [p.shape for p in got] == [(8, 3), (4, 3)]
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-14)


def test_auto_switches_once_between_steps_and_trains_as_a_run_started_with_its_choice(two_ranks):
    """schedule="auto" from gpipe at chunks=8 on 64 sequences (8 steps): 6 steps of measurement (3 at 8 micro-batches,
    3 at 4), one decision, 2 steps of its choice. Every step trained once: the losses and the weights equal a run
    started with the choice, in float64 (to the order of float sums: another micro-batch count sums gradients in
    another order; AdamW turns 1e-16 into 1e-14 on a near-zero bias); rank 0 said what it chose, once."""
    chosen, chunks = (two_ranks / "auto-chosen.txt").read_text().split()
    auto, ref = (torch.load(two_ranks / f"{n}.ckpt", weights_only=False) for n in ("auto", "auto-chosen"))
    assert auto["global_step"] == ref["global_step"] == 8
    for name, weight in ref["state_dict"].items():
        torch.testing.assert_close(auto["state_dict"][name], weight, rtol=1e-10, atol=1e-12, msg=name)  # as against plain
    torch.testing.assert_close(_ranks(two_ranks, "auto")[0]["returned"], _ranks(two_ranks, "auto-chosen")[0]["returned"],
                               rtol=1e-12, atol=0)
    lines = [ln for ln in (two_ranks / "stdout.txt").read_text().splitlines() if "schedule='auto':" in ln]
    assert len(lines) == 1 and f"{chosen}/chunks={chunks}" in lines[0] and "candidates" in lines[0], lines
