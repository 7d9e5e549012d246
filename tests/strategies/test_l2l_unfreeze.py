"""Gradual unfreezing, freezing again and pruning under ``l2l_offload`` and ``l2l_offload_ddp``, against plain Lightning
in float64 (issue 50).

Before, a parameter frozen when the offload was planned was refused at the step it was unfrozen (``BaseFinetuning``
died at its unfreeze epoch), and ``ModelPruning``'s lottery-ticket reset, which replaces the pruned weights' ``.data``,
left ``l2l_offload_ddp`` 0.08 away from DDP here in silence (and ``l2l_offload`` 0.15 away from plain Lightning
wherever it copies weights: bf16, a GPU). One device is compared bit for bit (torch's per-tensor AdamW on both sides); two gloo ranks against one
process on the batches the ranks read together (DDP itself does not average a parameter unfrozen after it wrapped
the model), to 1e-12, and in bf16 against one process accumulating the ranks' batches in turn.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

import lightning_accel.strategies.l2l_offload_hooks as hooks_module
from lightning_accel import L2LOffloadStrategy, OffloadPrecision
from lightning_accel.offload import L2LExecutor, make_plan
from lightning_accel.offload.host_store import HostStore
from tests.support.unfreeze_models import CASES, PER_RANK_BATCH, RankBatches, Transfer, data, fit_case, weights
from tests.support.user_script import run_user_script
from tests.support.workers import WORKERS


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    assert got.keys() == want.keys()  # the user's names (a pruned weight's made permanent again at the end)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=atol, msg=name)


def _trained_everywhere(got: dict[str, torch.Tensor], case: str) -> None:
    """Guard against an offload that silently does not train: every parameter but the one block never unfrozen moved."""
    start = weights(Transfer())
    still = {n for n in start if n.startswith("backbone.1.")} if case in ("finetune", "refreeze") else set()
    assert {n for n in start if torch.equal(start[n], got[n].to(start[n].dtype))} == still


class Seen(pl.Callback):
    """At each epoch's end: the host bytes the strategy states and the gradient bytes its last step brought back."""

    def __init__(self) -> None:
        self.host_bytes: list[int] = []
        self.d2h: list[int] = []

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.host_bytes.append(trainer.strategy.offload_stats.host_bytes)
        self.d2h.append(trainer.strategy.offload_stats.d2h_bytes_per_step)


# -- one device -----------------------------------------------------------------------------------------------------


# copies: every trainable weight copied to a fresh device tensor, as on a GPU (what reads a thawed master or adopted data)
@pytest.mark.parametrize(("case", "copies"), [*((c, False) for c in CASES), ("finetune", True), ("pruning", True)],
                         ids=[*CASES, "finetune-copies", "pruning-copies"])
def test_one_device_trains_as_plain_lightning_bit_for_bit(case: str, copies: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if copies:
        monkeypatch.setattr(hooks_module, "L2LExecutor", functools.partial(L2LExecutor, alias=False))
    want, got = Transfer(foreach=False), Transfer(foreach=False)
    fit_case(case, want, DataLoader(data(), batch_size=PER_RANK_BATCH))
    fit_case(case, got, DataLoader(data(), batch_size=PER_RANK_BATCH), L2LOffloadStrategy)
    _assert_equal(weights(got), weights(want))
    _trained_everywhere(weights(got), case)


def _store_bytes(trainable_blocks: list[int], compute: torch.dtype = torch.float32, dtype: torch.dtype = torch.float64) -> int:
    """What a store planned with ``trainable_blocks`` requiring grad (the rest frozen) states: the reference for the
    host bytes of a store whose parameters were thawed and frozen again since its planning."""
    model = Transfer(dtype).requires_grad_(False)
    for index in trainable_blocks:
        model.backbone[index].requires_grad_(True)
    return HostStore(make_plan(model).blocks, compute, pin=False).host_bytes()


def test_host_bytes_are_restated_as_blocks_thaw_and_freeze_again() -> None:
    """``refreeze``: block 0 trains from the start, blocks 2 and 3 from epoch 1, block 2 is frozen again at epoch 2
    (float64: 8 bytes a frozen parameter, 16 a trainable one with its gradient buffer)."""
    seen = Seen()
    fit_case("refreeze", Transfer(), DataLoader(data(), batch_size=PER_RANK_BATCH), L2LOffloadStrategy, callbacks_too=[seen])
    assert seen.host_bytes == [_store_bytes([0]), _store_bytes([0, 2, 3]), _store_bytes([0, 3])]
    assert seen.host_bytes == [5760, 8064, 6912]


def test_bf16_thawed_matrices_travel_in_bf16_and_train_as_plain_bf16_mixed() -> None:
    """OffloadPrecision('bf16-mixed') on the fp32 model: a thawed matrix gets a bf16 shadow (its gradient comes back in
    bf16, 2 bytes, a vector's in fp32), and the weights follow plain Lightning's bf16-mixed run (fused vs loop AdamW)."""
    seen = Seen()
    want, got = Transfer(torch.float32), Transfer(torch.float32)
    fit_case("finetune", want, DataLoader(data(), batch_size=PER_RANK_BATCH), precision="bf16-mixed")
    fit_case("finetune", got, DataLoader(data(), batch_size=PER_RANK_BATCH), L2LOffloadStrategy,
             plugins=[OffloadPrecision("bf16-mixed")], callbacks_too=[seen])
    _assert_equal(weights(got), weights(want), atol=1e-6)
    block = 2 * 2 * 64 + 4 * 2 * 8  # two 8x8 matrices in bf16, two biases in fp32
    assert seen.d2h == [block, 3 * block, 3 * block]
    assert seen.host_bytes == [_store_bytes([0], torch.bfloat16, torch.float32), *[_store_bytes([0, 2, 3], torch.bfloat16, torch.float32)] * 2]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", ["refreeze", "pruning"])
def test_cuda_thawed_masters_train_as_plain_lightning(case: str) -> None:
    """On a GPU every weight is a copy: a thawed master (pageable, as the others: copies cross the pinned rings of
    offload/staging.py) is what the copy reads, the adopted
    lottery-ticket weights are, and the pruning masks made on the host are planned as block buffers and streamed."""
    want, got = Transfer(), Transfer()
    fit_case(case, want, DataLoader(data(), batch_size=PER_RANK_BATCH), accelerator="gpu", devices=1)
    fit_case(case, got, DataLoader(data(), batch_size=PER_RANK_BATCH), L2LOffloadStrategy, accelerator="gpu", devices=1)
    _assert_equal({k: v.cpu() for k, v in weights(got).items()}, weights(want), atol=1e-10)  # host fused vs device loop
    if case == "refreeze":  # nothing the host store holds is pinned: a whole pinned copy of the model is what the rings avoid
        assert all(p.device.type == "cpu" and not p.is_pinned() for p in got.backbone.parameters())


# -- two gloo ranks -------------------------------------------------------------------------------------------------

DDP_CASES = [*(f"{case}-part" for case in CASES), "finetune-repl", "pruning-ddp", "finetune-part-bf16", "refreeze-part-delayed",
             "finetune-part-tier", "refreeze-part-tier"]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("unfreeze_ddp")
    result = run_user_script(WORKERS / "unfreeze_ddp_worker.py", [str(out), ",".join(DDP_CASES)], 600, "2-process unfreezing")
    assert result.returncode == 0, result.stdout[-4000:]
    return out


def _ranks(out: Path, case: str) -> list[dict[str, Any]]:
    return [torch.load(out / f"{case}-rank{r}.pt", weights_only=False) for r in range(2)]


@functools.lru_cache(maxsize=None)
def _one_process(case: str, turns: bool = False, **kwargs: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``case`` on one process over the batches the 2 ranks read: its weights and its optimizer's state dict."""
    bf16 = kwargs.get("precision") == "bf16-mixed"
    task = Transfer(torch.float32 if bf16 else torch.float64)
    trainers = fit_case(case, task, DataLoader(data(2), batch_sampler=RankBatches(turns=turns)), **kwargs)
    return weights(task), trainers[-1].optimizers[0].state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in DDP_CASES if "bf16" not in c and "delayed" not in c])
def test_two_ranks_train_as_one_process_on_the_global_batches(two_ranks: Path, case: str) -> None:
    want, _ = _one_process(case.split("-")[0])
    for rank in _ranks(two_ranks, case):  # every rank ends with the same weights
        _assert_equal(rank["weights"], want, atol=1e-12)
    _trained_everywhere(_ranks(two_ranks, case)[0]["weights"], case.split("-")[0])


@pytest.mark.slow
def test_two_ranks_in_bf16_train_as_one_process_accumulating_their_batches(two_ranks: Path) -> None:
    want, _ = _one_process("finetune", turns=True, precision="bf16-mixed", accumulate_grad_batches=2)
    for rank in _ranks(two_ranks, "finetune-part-bf16"):
        _assert_equal(rank["weights"], want, atol=1e-6)


@pytest.mark.slow
def test_two_ranks_delayed_equal_one_device_delayed(two_ranks: Path) -> None:
    """One step late, the ranks land the pending update (and send its weights) before a block is frozen again: the
    same weights as the one-device delayed update on the global batches."""
    want, _ = _one_process("refreeze", strategy=lambda: L2LOffloadStrategy(delayed_update=True, delayed_update_warmup=0))
    for rank in _ranks(two_ranks, "refreeze-part-delayed"):
        _assert_equal(rank["weights"], want, atol=1e-12)


@pytest.mark.slow
def test_thawed_blocks_get_owners_and_the_checkpoint_holds_plain_state(two_ranks: Path) -> None:
    """Block 0 trains from the start (rank 0 steps it); blocks 2 and 3, thawed at epoch 1, are given to the ranks
    around it; block 1 never trains. Rank 0's checkpoint gathers every rank's state: the one process's, in float64."""
    ranks = _ranks(two_ranks, "finetune-part")
    owned = [{n.split(".")[1] for n in r["owned"]} for r in ranks]
    assert owned[0].isdisjoint(owned[1]) and owned[0] | owned[1] == {"0", "2", "3"} and "0" in owned[0]
    assert sum(r["host_optimizer_bytes"] for r in ranks) == _ranks(two_ranks, "finetune-repl")[0]["host_optimizer_bytes"]
    _, want = _one_process("finetune")
    got = torch.load(two_ranks / "finetune-part.ckpt", weights_only=False)["optimizer_states"][0]
    assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in want["param_groups"]]
    assert sorted(got["state"]) == sorted(want["state"])
    for index, state in want["state"].items():
        for key, value in state.items():
            torch.testing.assert_close(got["state"][index][key], value, rtol=0, atol=1e-12, msg=f"{index}.{key}")


@pytest.mark.slow
@pytest.mark.parametrize("case", ["finetune", "refreeze"])
def test_two_ranks_with_the_tier_lay_it_out_again_and_equal_the_run_in_memory(two_ranks: Path, case: str) -> None:
    """Blocks thawed (and frozen again) during fit under the NVMe tier: each rank lays its files out again, with the
    state of the units it steps from then on (a thawed block's new owner), and every rank's weights and rank 0's
    checkpoint equal the 2-rank run in memory's bit for bit."""
    for want, got in zip(_ranks(two_ranks, f"{case}-part"), _ranks(two_ranks, f"{case}-part-tier")):
        _assert_equal(got["weights"], want["weights"])
        assert got["owned"] == want["owned"] and got["nvme_bytes"] > 0
        if case == "finetune":  # the moments of every unit the rank steps in the files, a thawed one's too (a unit frozen
            # again keeps its state in memory, as on one device: the tier lays out the parameters that train)
            assert got["state_in_memory"] <= 8 * len(got["owned"]) < want["state_in_memory"] / 10
    saved = [torch.load(two_ranks / f"{c}.ckpt", weights_only=False) for c in (f"{case}-part", f"{case}-part-tier")]
    for key in ("state_dict", "optimizer_states"):
        torch.testing.assert_close(saved[1][key], saved[0][key], rtol=0, atol=0)
    assert not list((two_ranks / "nvme").iterdir())
