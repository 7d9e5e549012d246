"""gpipe_distributed keeps the pipeline semantics of the reference GPipe (torchgpipe), on 2 gloo ranks in float64:
BatchNorm statistics, ragged batches, a stage's exception, tuples between stages; against plain Lightning, or
``gpipe`` in one process where micro-batches change the arithmetic (BatchNorm per micro-batch)."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_accel.strategies.gpipe import GPipeStrategy
from tests.support.workers.semantics_worker import SECTIONS, data, fit, moe_loader, tiny_mixtral


@pytest.fixture
def two_ranks(semantics_ranks):
    """The 2-rank run's outputs (tests/strategies/conftest.py)."""
    return semantics_ranks


def _reference(case: str) -> dict[str, torch.Tensor]:
    """Plain Lightning at chunks=1; ``gpipe`` on 2 CPU devices in one process at more chunks (BatchNorm then sees
    micro-batches, which plain training does not)."""
    model, options, batch, n, kwargs = {k: v for s in SECTIONS.values() for k, v in s().items()}[case]
    task = model()
    if options["chunks"] == 1 or not case.startswith("bn"):
        fit(task, DataLoader(data(n), batch_size=batch), "auto", **kwargs)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the per-micro-batch BatchNorm notice
            fit(task, DataLoader(data(n), batch_size=batch), GPipeStrategy(devices=2, blocks=lambda net: list(net), **options))
    return task.state_dict()


BN_CASES = list(SECTIONS["batchnorm"]())


@pytest.mark.parametrize("case", BN_CASES)
def test_batch_norm_buffers_and_weights_equal_the_reference_after_fit(two_ranks, case):
    """Running statistics (and num_batches_tracked) once per micro-batch, or once per batch deferred, in every checkpoint
    mode, a BatchNorm a block of its own or inside one; neither recomputation nor torch's shape inference (a real
    forward and backward of micro-batch 0) leaves a trace, and dropout masks are plain training's. Before: 13 updates
    for 12 at chunks 4 "never", more with recomputation, and no deferred_batch_norm option."""
    assert (two_ranks / f"{case}-rank0.txt").read_text() == "ok"
    piped = torch.load(two_ranks / f"{case}.pt", weights_only=False)
    reference = _reference(case)
    assert piped.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(piped[name], value, rtol=1e-10, atol=1e-12, msg=f"{case}: {name}")
    _, options, _, _, _ = SECTIONS["batchnorm"]()[case]
    tracked = [v for k, v in piped.items() if k.endswith("num_batches_tracked")]
    per_step = 1 if options["deferred_batch_norm"] else options["chunks"]
    assert [int(t) for t in tracked] == [per_step * 3] * 2



def test_batch_norm_counts_batches_by_default_and_a_cumulative_average_equals_plain_lightning(two_ranks):
    """deferred_batch_norm=True (the statistics deferral; not given, it is refused with micro-batches: see
    tests/strategies/test_gpipe_batch_layers.py), 4 micro-batches, 3 steps: every BatchNorm's num_batches_tracked is 3,
    as in plain Lightning, and the first one (momentum=None: the cumulative average over batches; its inputs are the data) holds
    plain Lightning's running statistics. Before: 12 updates of a micro-batch's statistics each (the default counted
    micro-batches), and momentum=None crashed on rank 1, whose meta run of rank 0's BatchNorm read the meta counter."""
    assert [(two_ranks / f"bn-first-default-rank{r}.txt").read_text() for r in range(2)] == ["ok", "ok"]
    piped = torch.load(two_ranks / "bn-first-default.pt", weights_only=False)
    model, _, batch, n, _ = SECTIONS["bn_default"]()["bn-first-default"]
    plain = model()
    fit(plain, DataLoader(data(n), batch_size=batch), "auto")
    reference = plain.state_dict()
    assert [int(v) for k, v in piped.items() if k.endswith("num_batches_tracked")] == [3, 3]
    for name in ("net.0.running_mean", "net.0.running_var", "net.0.num_batches_tracked"):
        torch.testing.assert_close(piped[name], reference[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("case", ["ragged-last-smaller-gpipe", "ragged-batch6-1f1b"])
def test_ragged_batches_train_like_plain_lightning(two_ranks, case):
    """A last batch smaller than chunks (2 with chunks=4) and a batch_size chunks does not divide (6) train in equal
    micro-batches of another count, every sample as in plain Lightning (drop_last=False). Before: the last batch was
    left out with a warning and batch_size=6 was refused."""
    assert [(two_ranks / f"{case}-rank{r}.txt").read_text() for r in range(2)] == ["ok", "ok"]
    piped, reference = torch.load(two_ranks / f"{case}.pt", weights_only=False), _reference(case)
    for name, value in reference.items():
        torch.testing.assert_close(piped[name], value, rtol=1e-10, atol=1e-12, msg=f"{case}: {name}")


def test_a_batch_no_micro_batch_count_fits_is_refused_before_the_first_step(two_ranks):
    """1F1B on 2 stages needs 2 micro-batches; 33 samples in batches of 8 end with 1: refused on both ranks, in one
    line naming drop_last=True, before any step (the weights are the initial ones), never mid-epoch."""
    for r in range(2):
        assert (two_ranks / f"ragged-refused-1f1b-rank{r}.txt").read_text() == (
            "DistributedGPipeStrategy(chunks=4, schedule='1f1b'): the training DataLoader's last batch of 1 cannot be "
            "split into equal micro-batches that '1f1b' runs on 2 stages (it needs at least 2); use drop_last=True on "
            "the DataLoader, or schedule='gpipe'"
        )
    initial = SECTIONS["ragged"]()["ragged-refused-1f1b"][0]().state_dict()
    piped = torch.load(two_ranks / "ragged-refused-1f1b.pt", weights_only=False)
    held = [name for name, value in piped.items() if not value.is_meta]  # rank 0's stage (the other is on meta)
    assert "net.0.weight" in held
    for name in held:
        torch.testing.assert_close(piped[name], initial[name].double(), rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("case", ["tuple-gpipe", "tuple-1f1b"])
def test_a_tuple_between_stages_trains_and_validates_like_plain_lightning(two_ranks, case):
    """A block that returns a pair at the stage boundary: both tensors cross, each element's gradient reaches the
    weights that made it (``b`` and ``gate`` only through the second), and validation streams the pair. Before:
    "a pipeline stage sends one activation to the next"."""
    piped, reference = torch.load(two_ranks / f"{case}.pt", weights_only=False), _reference(case)
    for name, value in reference.items():
        torch.testing.assert_close(piped[name], value, rtol=1e-10, atol=1e-12, msg=f"{case}: {name}")
    model = SECTIONS["tuples"]()[case][0]().double()
    model.load_state_dict(reference)
    with torch.no_grad():
        x, y = data(8)[:]
        expected = torch.nn.functional.mse_loss(model(x.double()), y.double())
    for r in range(2):
        status, value = (two_ranks / f"{case}-rank{r}.txt").read_text().split(" val_loss=")
        assert status == "ok"
        assert float(value) == pytest.approx(float(expected), rel=1e-10)


def test_a_stages_exception_ends_fit_on_every_rank_as_itself_with_the_module_whole(two_ranks):
    """Rank 1's layer raises MyError in the second step: fit raises that MyError on both ranks (rank 0 a copy), its
    message first, then the stage and rank that raised it; on_exception gets it on both, and after the fit each rank's
    module is whole again (the other stage gathered), as after DDP. Before: rank 1 raised MyError and exited; rank 0
    ended with a RuntimeError "pipeline step stopped on rank 0 ..." only because its peer's process had died (a rank
    that went on, to its on_exception callbacks and teardown, left rank 0 waiting until the timeout)."""
    for r in range(2):
        assert (two_ranks / f"raising-rank{r}.txt").read_text() == (
            "MyError: boom at forward 5 (raised by pipeline stage 1 on rank 1) | on_exception: MyError | whole: True"
        )


def test_a_validation_steps_exception_ends_fit_on_every_rank_as_itself(two_ranks):
    """validation_step raises MyError on its second batch, before calling the network. Every rank runs the step to its
    end, as DDP's ranks do, so each raises its own MyError (its message first, then where it was raised); on_exception
    gets it on both and the module is whole after the fit. Before: rank 1 waited for the activations until the timeout."""
    for r in range(2):
        assert (two_ranks / f"raising-validation-rank{r}.txt").read_text() == (
            f"MyError: boom in validation batch 1 (raised by pipeline stage {r} on rank {r}) | on_exception: MyError | "
            "whole: True"
        )


def test_a_training_step_returning_none_after_the_models_call_skips_the_batch_as_under_ddp(two_ranks):
    """Lightning skips a batch whose training_step returns None, with one replica as in one process (with several it
    refuses, as under DDP). Every rank ran the step, and the call's forwards, so every rank drops that batch's pending
    backwards and trains on: the weights equal plain Lightning's skipping the same batch. Before: refused in one line
    inside the step (the last rank alone saw the None)."""
    from tests.support.workers.semantics_worker import SkipsAfterTheCall

    for r in range(2):
        assert (two_ranks / f"raising-none-rank{r}.txt").read_text() == "trained | on_exception:  | whole: True"
    plain = SkipsAfterTheCall()
    fit(plain, DataLoader(data(24), batch_size=8), "auto")
    piped = torch.load(two_ranks / "raising-none.pt", weights_only=False)
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(piped[name], value, rtol=1e-10, atol=1e-12, msg=name)


def test_a_mixture_of_experts_trains_like_plain_lightning(two_ranks):
    """transformers' Mixtral (its experts' grouped_mm refuses meta float32) on 2 ranks, 2 micro-batches, float32: the
    next stage's rank gets the structure of the block output it receives with torch's shape metadata, so no block runs
    on meta; weights equal plain Lightning's to float32 rounding (6e-6 here, where training moved them by 3e-2).
    Before: the run crashed at its first step ("Expected inputs of BF16 type but got mat_a.dtype=torch.float32")."""
    pytest.importorskip("transformers")
    plain = tiny_mixtral()
    pl.seed_everything(1, verbose=False)
    pl.Trainer(
        accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    ).fit(plain, moe_loader())
    piped = torch.load(two_ranks / "moe.pt", weights_only=False)
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(piped[name], value, rtol=1e-4, atol=3e-5, msg=name)


def test_the_router_loss_covers_every_layer_on_every_rank_per_micro_batch(two_ranks):
    """Mixtral of 4 layers, 2 per rank, ``output_router_logits=True`` (coefficient 0.5) with a padding mask, 1f1b, 2
    micro-batches, float32, the user's shuffling loader with Lightning's defaults: each stage carries its routers' sums
    (expert counts, router probabilities, tokens) to the last, whose loss is transformers' over all 4 layers and whose
    gradient reaches rank 0's routers through the sends. Equal to plain Lightning accumulating the same micro-batches
    (measured 0.0); one whole-batch step differs (5.4e-2); said once. Before: the last rank's loss saw its own 2 layers
    only (the weights then 5.6e-2 off the reference), and rank 1 ran rank 0's MoE layers on meta to learn their output,
    which grouped_mm refuses in float32 (a 4-layer Mixtral crashed at its first step). Validation of the trained model
    carries the sums too: its router loss is the whole batch's over all 4 layers, plain Lightning's (before: the last
    rank's 2 layers only); and Lightning's sanity check, validating before the first step, runs (before: rank 1 ran rank
    0's MoE layers on meta for their output structure, which grouped_mm refuses, and stopped)."""
    pytest.importorskip("transformers")
    from torch.utils.data import DataLoader

    from tests.support.real_models import shuffled_order
    from tests.support.workers.semantics_worker import RouterLM

    def plain(batch_size: int, accumulate: int) -> RouterLM:
        task, dataset = RouterLM(), moe_loader().dataset
        pl.Trainer(
            accelerator="cpu", devices=1, max_steps=3, accumulate_grad_batches=accumulate, logger=False,
            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        ).fit(task, DataLoader(dataset, batch_size=batch_size, sampler=shuffled_order(len(dataset))))
        return task

    piped = torch.load(two_ranks / "moe-router.pt", weights_only=False)
    reference = plain(4, accumulate=2)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(piped[name], value, rtol=1e-6, atol=1e-7, msg=name)
    validated = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False)
    expected = validated.validate(reference, moe_loader(), verbose=False)[0]
    got = torch.load(two_ranks / "moe-router-val.pt", weights_only=False)
    for key in ("val_router_loss", "val_loss"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5), (key, got, expected)
    whole = plain(8, accumulate=1).state_dict()
    assert max(float((whole[n] - piped[n]).abs().max()) for n in whole) > 1e-3
    said = (two_ranks / "moe-router-said.txt").read_text().splitlines()
    assert len(said) == 1 and said[0].startswith("DistributedGPipeStrategy(chunks=2): MixtralConfig.output_router_logits=True")
