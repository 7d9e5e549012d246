"""L2L offload on several processes: L2LOffloadDDPStrategy against plain Lightning DDP on the same global batch, and
the refusals of what neither L2L strategy can honour (a second device for 'l2l_offload' first of all)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_accel.plugins.precision import OffloadPrecision
from lightning_accel.strategies.l2l_offload import L2LOffloadStrategy
from lightning_accel.strategies.l2l_offload_ddp import L2LOffloadDDPStrategy
from tests.support.user_script import run_user_script
from tests.support.workers import WORKERS
from tests.support.workers.l2l_ddp_worker import FP16_SCALE, PER_RANK_BATCH, TIER_BUDGET, GlobalBatches, gpt_data, gpt_task


def _trainer(strategy: Any, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, **kwargs)


# -- bad input: refused when the Trainer is built, or before the first step ------------------------


@pytest.mark.parametrize(("kwargs", "named"), [({"devices": 2}, "devices=2"), ({"devices": 1, "num_nodes": 3}, "num_nodes=3")])
def test_l2l_offload_refuses_more_than_one_device_when_the_trainer_is_built(kwargs: dict[str, Any], named: str) -> None:
    for strategy in ("l2l_offload", L2LOffloadStrategy()):
        with pytest.raises(ValueError, match=rf"strategy='l2l_offload' trains on one device in one process, but {named} asks "
                                             r"for more; use strategy='l2l_offload_ddp'"):
            _trainer(strategy, **kwargs)


def test_l2l_offload_refuses_a_launcher_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"but WORLD_SIZE=4 \(a launcher such as torchrun\) asks for more"):
        _trainer("l2l_offload", devices=1)


def test_one_device_is_honoured_and_counted() -> None:
    trainer = _trainer("l2l_offload", devices=1)
    assert trainer.num_devices == 1 and trainer.strategy.root_device == torch.device("cpu")


def test_the_data_parallel_name_takes_every_device() -> None:
    trainer = _trainer("l2l_offload_ddp", devices=2)
    assert isinstance(trainer.strategy, L2LOffloadDDPStrategy) and trainer.num_devices == 2
    assert trainer.strategy.host_step == "partitioned"


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_the_data_parallel_strategy_runs_lightnings_mixed_flag_as_the_offload_plugin(precision: str, caplog: pytest.LogCaptureFixture) -> None:
    # Lightning hands its MixedPrecision over when the Trainer is built (16-mixed on the CPU: Lightning makes it bf16-mixed)
    with caplog.at_level("INFO"):
        plugin = _trainer(L2LOffloadDDPStrategy(), devices=2, precision=precision).strategy.precision_plugin
    assert isinstance(plugin, OffloadPrecision) and plugin.precision == "bf16-mixed"
    assert [r.getMessage() for r in caplog.records if "runs as OffloadPrecision" in r.getMessage()] == [
        "strategy='l2l_offload_ddp': precision='bf16-mixed' runs as OffloadPrecision('bf16-mixed') "
        "(fp32 masters on the host, device copies in bfloat16)"]


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"host_step": "sharded"}, r"host_step='sharded' is not one of 'partitioned', 'replicated'"),
    ({"overlap_step": True}, r"overlap_step=True\): a block's host step needs its gradients averaged.*; leave overlap_step unset"),
    ({"find_unused_parameters": True}, r"does not wrap the model in DistributedDataParallel, so find_unused_parameters=\.\.\. would be ignored"),
    ({"ddp_comm_hook": print}, r"so ddp_comm_hook=\.\.\. would be ignored"),
    ({"nvme_path": "/tmp", "delayed_update": True}, r"^strategy.nvme_path with delayed_update=True is not supported: .*; set "
                                                    r"delayed_update=False or drop nvme_path"),
    ({"host_budget": "lots"}, r"^strategy.host_budget='lots' is not a size"),
])
def test_data_parallel_options_it_cannot_honour_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        L2LOffloadDDPStrategy(**kwargs)


def _gpt_loader() -> DataLoader:
    return DataLoader(gpt_data(), batch_size=PER_RANK_BATCH)


@pytest.mark.usefixtures("one_rank")
def test_manual_optimization_is_refused_before_training() -> None:
    task = gpt_task()
    task.automatic_optimization = False
    with pytest.raises(ValueError, match=r"needs automatic optimization \(LanguageModelTask sets automatic_optimization=False\)"):
        _trainer(L2LOffloadDDPStrategy(), devices=1, max_steps=1).fit(task, _gpt_loader())


# -- 2 gloo ranks against plain Lightning DDP ---------------------------------------------------------

CASES = [
    "gpt64-ddp", "gpt64-part", "gpt64-repl",
    "gpt64-ddp-accclip", "gpt64-part-accclip", "gpt64-repl-accclip",
    "gpt64-part-act", "gpt64-part-resident", "gpt64-part-delayed", "gpt64-repl-delayed", "gpt16-ddp", "gpt16-part", "gpt16-repl", "gpt32-ddp", "gpt32-part", "gptbf16-ddp", "gptbf16-part",
    "llama64-ddp", "llama64-part", "llama64-repl",
    "gpt64-part-2ep", "gpt64-part-resumed", "gpt64-ddp-resumed",
    # the NVMe tier (both ranks under one nvme_path), each against the case above without it
    "gpt32-part-tier", "gptbf16-part-tier", "gpt16-part-tier", "gpt64-repl-tier", "gpt64-part-accclip-tier",
    "gpt64-part-resident-tier", "gpt64-part-tier", "gpt64-part-tier-resumed", "gpt32-part-budget", "llama64-part-block",
]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("l2l_ddp")
    result = run_user_script(WORKERS / "l2l_ddp_worker.py", [str(out), "2", ",".join(CASES)], 600, "2-process l2l_offload_ddp")
    assert result.returncode == 0, result.stdout[-4000:]
    return out


def _ranks(out: Path, case: str, world: int = 2) -> list[dict[str, Any]]:
    return [torch.load(out / f"{case}-rank{r}.pt", weights_only=False) for r in range(world)]


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], rtol: float, atol: float) -> None:
    assert got.keys() == want.keys()  # the user's names
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=name)


# fp32: the host parameters step on torch's fused CPU AdamW, DDP on its per-tensor loop (test_l2l_offload.py)
FP32_ATOL = 2e-5


@pytest.mark.slow
@pytest.mark.parametrize(("case", "reference", "atol"), [
    ("gpt64-part", "gpt64-ddp", 1e-12), ("gpt64-repl", "gpt64-ddp", 1e-12),
    ("gpt64-part-accclip", "gpt64-ddp-accclip", 1e-12), ("gpt64-repl-accclip", "gpt64-ddp-accclip", 1e-12),
    ("gpt64-part-act", "gpt64-ddp", 1e-12), ("gpt64-part-resident", "gpt64-ddp", 1e-12),
    ("gpt32-part", "gpt32-ddp", FP32_ATOL),
    ("gptbf16-part", "gptbf16-ddp", 2e-2), ("gpt16-part", "gpt16-ddp", 2e-2), ("gpt16-repl", "gpt16-ddp", 2e-2),
    ("llama64-part", "llama64-ddp", 1e-12), ("llama64-repl", "llama64-ddp", 1e-12),
])
def test_trains_to_the_weights_of_plain_ddp(two_ranks: Path, case: str, reference: str, atol: float) -> None:
    ranks, ddp = _ranks(two_ranks, case), _ranks(two_ranks, reference)
    initial = (gpt_task() if case.startswith("gpt") else None)
    for rank, ddp_rank in zip(ranks, ddp):  # every rank ends with the same, trained weights; its losses are its shard's
        _assert_close(rank["weights"], ddp[0]["weights"], rtol=0, atol=atol)
        assert rank["losses"] == pytest.approx(ddp_rank["losses"], rel=1e-6 if atol > 1e-12 else 1e-12, abs=atol)
        assert rank["scale"] == ddp_rank["scale"]  # fp16: the same steps skipped for an overflow, the same scale
    if initial is not None:  # guard against an offload that silently does not train
        moved = [n for n, w in initial.state_dict().items() if not torch.equal(w.to(ranks[0]["weights"][n].dtype), ranks[0]["weights"][n])]
        assert len(moved) == len(ranks[0]["weights"])
    # the gradients were averaged in the last step, every block's launched while the backward of the blocks before it
    # still ran, and with the partitioned step the weights went back out
    assert all(r["reduced_bytes"] > 0 for r in ranks)
    assert all(r["reduced_in_backward"] == (3 if case.startswith("llama") else 4) for r in ranks)
    assert all((r["gathered_bytes"] > 0) == ("-part" in case) for r in ranks)


@pytest.mark.slow
@pytest.mark.slow
@pytest.mark.parametrize("how", ["part", "repl"])
def test_the_whole_models_gradient_norm_equals_ddps(two_ranks: Path, how: str) -> None:
    """strategy.grad_norm(2) in on_before_optimizer_step, on every rank, equals Lightning's grad_norm total under plain
    DDP, although with the host step partitioned each rank holds only its own blocks' gradients there (a rank's own
    grad_norm said 1.70 vs 1.86 in the issue)."""
    ddp = _ranks(two_ranks, "gpt64-ddp")[0]["norms"]
    assert len(ddp) > 1
    for rank in _ranks(two_ranks, f"gpt64-{how}"):
        torch.testing.assert_close(rank["norms"], ddp, rtol=1e-10, atol=0)


def test_accumulation_and_clipping_act(two_ranks: Path) -> None:
    """The accumulate-and-clip comparison is not the plain one again: those settings move DDP's weights elsewhere."""
    plain, accclip = _ranks(two_ranks, "gpt64-ddp")[0], _ranks(two_ranks, "gpt64-ddp-accclip")[0]
    assert len(accclip["losses"]) == len(plain["losses"]) == 4  # 4 batches per rank: 4 optimizer steps, or 2
    assert max((plain["weights"][k] - accclip["weights"][k]).abs().max() for k in plain["weights"]) > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt64", "llama64"])
def test_each_rank_holds_the_optimizer_state_of_its_share_only(two_ranks: Path, model: str) -> None:
    part, repl = _ranks(two_ranks, f"{model}-part"), _ranks(two_ranks, f"{model}-repl")
    full = repl[0]["host_optimizer_bytes"]
    assert repl[1]["host_optimizer_bytes"] == full  # replicated: every rank holds all of it
    held = [r["host_optimizer_bytes"] for r in part]
    assert sum(held) == full and 0 < min(held)  # partitioned: once over the ranks
    if model == "gpt64":  # 4 equal blocks over 2 ranks: exactly half each
        assert held == [full // 2, full // 2]
    else:  # 3 equal blocks: block-granular, 2 and 1
        assert sorted(held) == [full // 3, 2 * full // 3]
    assert set(part[0]["owned"]).isdisjoint(part[1]["owned"])
    assert sorted(part[0]["owned"] + part[1]["owned"]) == repl[0]["owned"]


@pytest.mark.slow
def test_checkpoint_holds_plain_state_and_resumes_exactly_here_in_ddp_and_on_one_device(two_ranks: Path) -> None:
    ckpt = torch.load(two_ranks / "gpt64-part.ckpt", weights_only=False)
    task = gpt_task()
    assert set(ckpt["state_dict"]) == set(task.state_dict())
    # one optimizer state over every parameter, under plain indices, gathered from both ranks' shards
    state = ckpt["optimizer_states"][0]["state"]
    assert sorted(state) == list(range(len(list(task.parameters()))))
    assert all(int(s["step"]) == 4 for s in state.values())
    straight = _ranks(two_ranks, "gpt64-part-2ep")[0]["weights"]
    # this strategy resuming from its checkpoint, and Lightning's DDP resuming from it
    _assert_close(_ranks(two_ranks, "gpt64-part-resumed")[0]["weights"], straight, rtol=0, atol=0)
    _assert_close(_ranks(two_ranks, "gpt64-ddp-resumed")[0]["weights"], straight, rtol=0, atol=1e-12)
    # one process on the same global batches resuming from it
    single = gpt_task()
    batches = DataLoader(gpt_data(), batch_sampler=GlobalBatches(len(gpt_data()), 2))
    _trainer("auto", devices=1, max_epochs=2).fit(single, batches, ckpt_path=two_ranks / "gpt64-part.ckpt")
    _assert_close({k: v.detach() for k, v in single.state_dict().items()}, straight, rtol=0, atol=1e-12)


@pytest.mark.slow
def test_a_plain_one_process_run_on_the_global_batches_is_the_same_reference(two_ranks: Path) -> None:
    """The DDP reference is itself one process on the global batch: AdamW on the mean gradient of 8 sequences."""
    single = gpt_task()
    batches = DataLoader(gpt_data(), batch_sampler=GlobalBatches(len(gpt_data()), 2))
    _trainer("auto", devices=1, max_epochs=1).fit(single, batches)
    _assert_close({k: v.detach() for k, v in single.state_dict().items()}, _ranks(two_ranks, "gpt64-part")[0]["weights"], rtol=0, atol=1e-12)


# -- 4 gloo ranks ---------------------------------------------------------------------------------------

FOUR = ["gpt64-ddp", "gpt64-part", "gpt64-repl", "gpt64-ddp-accclip", "gpt64-part-accclip"]


@pytest.mark.slow
def test_four_ranks_train_to_the_weights_of_plain_ddp_with_a_quarter_of_the_state_each(tmp_path: Path) -> None:
    result = run_user_script(WORKERS / "l2l_ddp_worker.py", [str(tmp_path), "4", ",".join(FOUR)], 600, "4-process l2l_offload_ddp")
    assert result.returncode == 0, result.stdout[-4000:]
    for case, reference in (("gpt64-part", "gpt64-ddp"), ("gpt64-repl", "gpt64-ddp"), ("gpt64-part-accclip", "gpt64-ddp-accclip")):
        ddp = _ranks(tmp_path, reference, 4)
        for rank, ddp_rank in zip(_ranks(tmp_path, case, 4), ddp):
            _assert_close(rank["weights"], ddp[0]["weights"], rtol=0, atol=1e-12)
            assert rank["losses"] == pytest.approx(ddp_rank["losses"], rel=1e-12)
    full = _ranks(tmp_path, "gpt64-repl", 4)[0]["host_optimizer_bytes"]
    assert [r["host_optimizer_bytes"] for r in _ranks(tmp_path, "gpt64-part", 4)] == [full // 4] * 4


@pytest.mark.slow
def test_fp16_overflow_skips_the_same_steps_on_every_rank_as_ddp(two_ranks: Path) -> None:
    """The first step's scaled gradients overflow: every rank skips it and halves the scale, as DDP's ranks do."""
    for case in ("gpt16-ddp", "gpt16-part", "gpt16-repl"):
        assert [r["scale"] for r in _ranks(two_ranks, case)] == [FP16_SCALE / 2] * 2, case


@pytest.mark.slow
@pytest.mark.parametrize("how", ["part", "repl"])
def test_delayed_update_equals_one_device_delayed_on_the_global_batches(two_ranks: Path, how: str) -> None:
    """One step late, data parallel: the same weights as the one-device delayed update (itself tested against a
    hand-written delayed loop) on the batches the ranks see together; every rank ends with every update landed."""
    single = gpt_task()
    batches = DataLoader(gpt_data(), batch_sampler=GlobalBatches(len(gpt_data()), 2))
    trainer = _trainer(L2LOffloadStrategy(delayed_update=True, delayed_update_warmup=1), devices=1, max_epochs=1)
    trainer.fit(single, batches)
    assert trainer.strategy.offload_stats.delayed_steps == 3
    want = {k: v.detach() for k, v in single.state_dict().items()}
    for rank in _ranks(two_ranks, f"gpt64-{how}-delayed"):
        _assert_close(rank["weights"], want, rtol=0, atol=1e-12)
    # and it is not the undelayed run
    undelayed = _ranks(two_ranks, "gpt64-part")[0]["weights"]
    assert max((undelayed[k] - want[k]).abs().max() for k in want) > 1e-4


# -- the NVMe tier on each rank ---------------------------------------------------------------------------


TIERED = [("gpt32-part", "gpt32-part-tier"), ("gptbf16-part", "gptbf16-part-tier"), ("gpt16-part", "gpt16-part-tier"),
          ("gpt64-repl", "gpt64-repl-tier"), ("gpt64-part-accclip", "gpt64-part-accclip-tier"),
          ("gpt64-part-resident", "gpt64-part-resident-tier"), ("gpt64-part", "gpt64-part-tier"),
          ("gpt64-part-resumed", "gpt64-part-tier-resumed"), ("gpt32-part", "gpt32-part-budget"),
          ("llama64-part", "llama64-part-block")]  # a checkpoint built on meta and loaded by block into each rank's tier


@pytest.mark.parametrize(("in_memory", "tiered"), TIERED, ids=[t for _, t in TIERED])
def test_a_run_with_the_tier_equals_the_run_in_memory_bit_for_bit(two_ranks: Path, in_memory: str, tiered: str) -> None:
    """Each rank's weights and optimizer state (its shard, partitioned), the losses, the fp16 scale and rank 0's
    checkpoint (every rank's state gathered) equal the same 2-rank run in memory's; resumed from the tiered run's
    checkpoint, the same as resumed from the in-memory one's."""
    for want, got in zip(_ranks(two_ranks, in_memory), _ranks(two_ranks, tiered)):
        _assert_close(got["weights"], want["weights"], rtol=0, atol=0)
        assert got["optimizer_state"].keys() == want["optimizer_state"].keys()
        for index, state in want["optimizer_state"].items():
            for key, value in state.items():
                assert torch.equal(torch.as_tensor(got["optimizer_state"][index][key]), torch.as_tensor(value)), (index, key)
        assert got["losses"] == want["losses"] and got["scale"] == want["scale"] and got["owned"] == want["owned"]
    saved = {c: torch.load(two_ranks / f"{c}.ckpt", weights_only=False) for c in (in_memory, tiered)}
    for key in ("state_dict", "optimizer_states"):
        torch.testing.assert_close(saved[tiered][key], saved[in_memory][key], rtol=0, atol=0)


def test_each_rank_keeps_its_own_files_with_the_state_of_its_own_units(two_ranks: Path) -> None:
    """Both ranks under one nvme_path: each its own scratch directory (a file per block), gone after fit. Partitioned, a
    rank's files hold its own blocks' optimizer state and every block's masters; replicated, every block's state."""
    part, repl = _ranks(two_ranks, "gpt64-part-tier"), _ranks(two_ranks, "gpt64-repl-tier")
    directories = [Path(r["tier_directory"]) for r in part]
    assert directories[0] != directories[1] and all(d.parent == two_ranks / "nvme" for d in directories)
    assert all(r["tier_files"] == ["owner.json", *(f"unit-{i:05d}.bin" for i in range(4))] for r in part)
    assert not list((two_ranks / "nvme").iterdir())
    assert all("optimizer state of 2/2 units, fp32 masters of 4/4)" in r["tier_plan"] for r in part)
    assert all("optimizer state of 4/4 units, fp32 masters of 4/4)" in r["tier_plan"] for r in repl)
    # 4 equal blocks, AdamW (two moments: twice the masters' bytes): a rank's disk holds every master and half the state
    masters = repl[0]["nvme_bytes"] // 3
    assert [r["nvme_bytes"] for r in repl] == [3 * masters] * 2 and [r["nvme_bytes"] for r in part] == [2 * masters] * 2


def test_the_host_budget_is_per_rank_and_counts_the_ranks_own_state(two_ranks: Path, tmp_path: Path) -> None:
    """gpt32 on 2 ranks, partitioned: a rank keeps its own half of the blocks' AdamW state (393.22 kB in all) and the
    resident unit kept on the CPU device with its state (10.75 kB): 456.45 kB, within a 500 kB budget per rank, nothing
    on disk. One process under that budget cannot keep the model even with everything on disk (653.06 kB: the tier's
    buffers), and is refused before the first step."""
    for rank in _ranks(two_ranks, "gpt32-part-budget"):
        assert rank["tier_plan"] == f"host 456.45 kB, disk 0 B (host_budget {TIER_BUDGET[:-2]}.00 kB)"
    with pytest.raises(ValueError, match=r"^L2LOffloadStrategy: strategy.host_budget=500.00 kB is less than the 653.06 kB"):
        _trainer(L2LOffloadStrategy(nvme_path=str(tmp_path), host_budget=TIER_BUDGET), devices=1,
                 max_steps=1).fit(gpt_task(torch.float32), _gpt_loader())
