"""Lightning's features that touch every parameter or every rank's outputs, under ``gpipe_distributed`` on 2 CPU ranks
in float64 (:mod:`tests.support.lightning_features`), against plain one-process Lightning on the same data order (the
pipeline's ranks see the whole batch, as plain training does; DDP's ranks would see shards). The 2-rank launch the
semantics tests use runs every case (its section ``features``), each a fit and what a script does with the trained
module after it, on every rank."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.support.lightning_features import fit_case, probe, run_case, state_of

TRAINED = ("finetune", "swa", "stopped")


@pytest.fixture
def two_ranks(semantics_ranks):
    """The 2-rank run's outputs: its section ``features`` (tests/strategies/conftest.py)."""
    return semantics_ranks


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    out = tmp_path_factory.mktemp("plain")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's notices on a tiny CPU run
        return out, {case: run_case(case, "auto", 1, str(out)) for case in TRAINED}


def _close(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert got.keys() == expected.keys(), what
    for name, value in expected.items():
        assert not got[name].is_meta, f"{what}: {name} is a placeholder"
        torch.testing.assert_close(got[name], value, rtol=1e-10, atol=1e-12, msg=f"{what}: {name}")


def _load(two_ranks, case: str, rank: int) -> dict:
    return torch.load(two_ranks / f"{case}-rank{rank}.pt", weights_only=False)


@pytest.mark.parametrize("case", TRAINED)
def test_every_rank_holds_the_trained_module_after_fit_and_evaluates_it_like_plain_lightning(two_ranks, plain, case):
    """BaseFinetuning (net.0 frozen, unfrozen at epoch 1 as a new param group; before: ``aten::equal`` on meta tensors)
    with a StepLR, clipping by norm, EarlyStopping on an epoch-end value and EMAWeightAveraging; SWA from epoch 1 with
    a BatchNorm (before, both averaging callbacks: "Cannot copy out of meta tensor"); a Timer with no time left, which
    stops fit before training begins (before: the module stayed split, no on_train_end ran). On both ranks after fit: the whole trained module, no placeholder, equal to plain
    Lightning's, ``model(x)`` computing plain's output (before: rank 1 held meta tensors and ``model(x)`` raised); then
    ``trainer.validate``, ``test`` and ``predict`` give plain's results and leave the module whole."""
    expected = plain[1][case]
    for rank in range(2):
        got = _load(two_ranks, case, rank)
        what = f"{case} rank {rank}"
        assert got["epoch"] == expected["epoch"], what  # EarlyStopping stopped both at the same epoch
        _close(got["state"], expected["state"], what)
        torch.testing.assert_close(got["probe"], expected["probe"], rtol=1e-10, atol=1e-12, msg=what)
        for stage in ("validate", "test"):
            assert got[stage][0].keys() == expected[stage][0].keys(), what
            for key, value in expected[stage][0].items():
                assert got[stage][0][key] == pytest.approx(value, rel=1e-10), (what, stage, key)
        torch.testing.assert_close(got["predict"], expected["predict"], rtol=1e-10, atol=1e-12, msg=what)
        if expected["batch_outputs"] is not None:  # on_validation_batch_end's outputs (before: None on rank 0)
            assert len(expected["batch_outputs"]) == 8, what  # the sanity check and 3 validations, 2 batches each
            torch.testing.assert_close(got["batch_outputs"], expected["batch_outputs"], rtol=1e-10, atol=1e-12, msg=what)
        _close(got["after_eval"], expected["after_eval"], f"{what} after validate/test/predict")


@pytest.mark.parametrize("case", TRAINED)
def test_logged_values_and_epoch_end_outputs_equal_plain_lightning(two_ranks, plain, case):
    """Every rank's callback metrics and rank 0's logger: ``sync_dist`` logs, the learning rates LearningRateMonitor logs
    (the new group's too), ``self.all_gather`` in validation (before: it hung), and Lightning 2's epoch-end outputs:
    ``training_step`` appends its loss and predictions, ``validation_step`` a dict, each stacked at epoch end (before:
    "stack expects a non-empty TensorList" on rank 0, and one item per micro-batch on rank 1): one item per batch on
    every rank (``train_outputs`` counts them), the whole batch's values."""
    expected = plain[1][case]
    for rank in range(2):
        got = _load(two_ranks, case, rank)
        assert got["metrics"].keys() == expected["metrics"].keys(), rank
        for key, value in expected["metrics"].items():
            assert got["metrics"][key] == pytest.approx(value, rel=1e-10, abs=1e-12), (case, rank, key)
    logged = _load(two_ranks, case, 0)["logged"]
    assert [sorted(m) for _, m in logged] == [sorted(m) for _, m in expected["logged"]]
    for (_, got), (_, want) in zip(logged, expected["logged"]):
        for key, value in want.items():
            assert got[key] == pytest.approx(value, rel=1e-10, abs=1e-12), (case, key)
    if case == "finetune":
        assert expected["metrics"]["train_outputs"] == 2.0 and "lr-SGD/pg2" in expected["metrics"]


@pytest.mark.parametrize("case", ["finetune", "swa"])
def test_a_checkpoint_after_fit_holds_the_whole_model_its_param_groups_and_callback_states(two_ranks, plain, case):
    """``trainer.save_checkpoint`` after fit: the module (EMA's averaged weights and the trained ones), the optimizer's
    state under plain training's indices in both param groups (BaseFinetuning's added group included), BaseFinetuning's
    record of the groups (the whole model's, by name) and SWA's averaged model (whole: before, rank 1's blocks were meta
    in it), each equal to plain Lightning's."""
    got = torch.load(two_ranks / f"{case}-2.ckpt", weights_only=False)
    expected = torch.load(plain[0] / f"{case}-1.ckpt", weights_only=False)
    models = [k for k in ("state_dict", "current_model_state", "averaging_state") if k in expected]
    assert models == [k for k in ("state_dict", "current_model_state", "averaging_state") if k in got]
    for key in models:  # EMAWeightAveraging saves the averaged weights as state_dict, the trained ones beside them
        _close(got[key], expected[key], f"{case}: {key}")
    (mine,), (theirs,) = got["optimizer_states"], expected["optimizer_states"]
    assert [g["params"] for g in mine["param_groups"]] == [g["params"] for g in theirs["param_groups"]]
    assert mine["state"].keys() == theirs["state"].keys() and theirs["state"]
    for index, state in theirs["state"].items():
        torch.testing.assert_close(mine["state"][index], state, rtol=1e-10, atol=1e-12, msg=f"{case}: state {index}")
    assert got["callbacks"].keys() == expected["callbacks"].keys()
    for key, state in expected["callbacks"].items():
        if "average_model_state" in state:
            _close(got["callbacks"][key]["average_model_state"], state["average_model_state"], f"{case}: SWA average")
        if "internal_optimizer_metadata" in state:
            assert got["callbacks"][key] == state


def test_model_pruning_is_refused_before_the_first_step_in_one_line(two_ranks):
    for rank in range(2):
        message = _load(two_ranks, "pruning", rank)["refused"]
        assert message == (
            "DistributedGPipeStrategy cannot run ModelPruning (callbacks=[ModelPruning(...)]): it reparametrizes every "
            "weight, by a threshold over all of them, and each rank holds only its own stages; prune after fit, when "
            "every rank holds the whole module (torch.nn.utils.prune), or train with strategy='ddp'"
        )


def test_a_module_the_host_cannot_hold_whole_stays_split_with_one_warning_per_rank_naming_gather_module(two_ranks, tmp_path):
    """The strategy told the host has 1 byte free: after fit each rank keeps its own stages (the other's are
    placeholders) and says so once, naming ``trainer.strategy.gather_module()``; that call then gives every rank the
    whole trained module, plain Lightning's."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, model, _ = fit_case("no_room", "auto", 1, str(tmp_path))
    expected = state_of(model)
    held = {0: {"net.2.weight", "net.2.bias", "net.4.weight", "net.4.bias"}, 1: {"net.0.weight", "net.0.bias"}}
    for rank in range(2):
        got = _load(two_ranks, "no_room", rank)
        assert got["placeholders"] == sorted(held[rank])
        assert len(got["said"]) == 1 and got["said"][0].startswith(
            f"DistributedGPipeStrategy: after fit rank {rank}'s module holds only its own stages: the others (0.0 GiB) do "
            "not fit the free host memory beside the other ranks'; trainer.strategy.gather_module() on every rank"
        ), got["said"]
        _close(got["state"], expected, f"rank {rank} after gather_module()")
        torch.testing.assert_close(got["probe"], model(probe()).detach(), rtol=1e-10, atol=1e-12)
