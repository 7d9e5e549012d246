"""``Fabric(strategy="l2l_offload_ddp", devices=2)``: litgpt's loops on 2 gloo ranks give the weights of the same loops
under Fabric's own DDP in float64 (accumulation under ``no_backward_sync``, clipping by norm across ranks and by
value, ``bf16-mixed`` paired with the offload precision), ``fabric.save`` / ``fabric.load`` resume exactly (and Fabric's
DDP resumes from the same checkpoint), a model built on meta is materialized, the module infers after the loop,
Fabric's collectives answer as under DDP; what it cannot honour is refused when
the ``Fabric`` is built. One 2-process launch (:mod:`tests.support.workers.fabric_ddp_worker`) holds every run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

import lightning_accel  # noqa: F401  (registers the names with Fabric)
from lightning_accel.fabric import L2LOffloadDDPStrategy
from tests.support.fabric_loops import gpt, max_difference, weights
from tests.support.user_script import run_user_script
from tests.support.workers import WORKERS
from tests.support.workers.fabric_ddp_worker import FP16_SCALE


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    pytest.importorskip("litgpt")
    out = tmp_path_factory.mktemp("fabric_ddp")
    result = run_user_script(WORKERS / "fabric_ddp_worker.py", [str(out)], 600, "2-process Fabric l2l_offload_ddp")
    assert result.returncode == 0, result.stdout[-4000:]
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


# litgpt's finetune/full.py loop (accumulation 2, partitioned host step), its pretrain.py loop (clipping by norm across
# the ranks' parts, the learning rate set each iteration), and by value with the replicated host step
@pytest.mark.parametrize("case", ["finetune", "pretrain", "value"])
def test_litgpt_loops_equal_fabrics_ddp_on_every_rank(ranks: tuple[Path, list[dict[str, Any]]], case: str) -> None:
    _, results = ranks
    reference = results[0][f"{case}-ddp"]
    assert max_difference(reference, results[1][f"{case}-ddp"]) == 0  # DDP's ranks agree
    for rank in results:
        assert max_difference(reference, rank[case]) < 1e-10  # float64 rounding (fused AdamW), amplified by Adam
    assert max_difference(weights(gpt()), reference) > 1e-3  # it trained


def test_a_model_built_on_meta_given_raw_weights_trains_alike_and_infers_after_the_loop(
        ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    """fabric.init_module(empty_init=True), fabric.load_raw, fabric.backward(loss, model=model): the fine-tuning loop's
    weights again; and the module after the loop computes DDP's outputs without grad."""
    _, results = ranks
    for rank in results:
        assert rank["built_on_meta"]
        assert max_difference(rank["finetune"], rank["again"]) < 1e-12
        torch.testing.assert_close(rank["output"], rank["output-ddp"], rtol=0, atol=1e-10)
        assert torch.equal(rank["output-torn-down"], rank["output"])  # and after the strategy's teardown


def test_a_wrong_reference_is_told_apart(ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    """The comparison above can fail: clipping by value instead of by norm moves the weights far beyond its tolerance."""
    _, results = ranks
    assert max_difference(results[0]["pretrain-ddp"], results[0]["value"]) > 1e-4


def test_accumulation_averages_once_per_step_and_the_state_is_partitioned(ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    out, results = ranks
    # 4 backwards, 2 of them under no_backward_sync: averaged twice, as Fabric's DDP all-reduces twice
    assert [r["averaged"] for r in results] == [2, 2]
    # 3 equal blocks over 2 ranks: rank 0 steps 2 of them, rank 1 one; each sent its updated weights
    held = [r["host_optimizer_bytes"] for r in results]
    assert held[0] == 2 * held[1] > 0
    assert all(r["gathered_bytes"] > 0 for r in results)
    # fabric.save wrote one plain optimizer state over every parameter (gathered from both ranks' shards)
    saved = torch.load(out / "finetune.ckpt", weights_only=True)
    assert set(saved["model"]) == set(gpt().state_dict())
    state = saved["optimizer"]["state"]
    assert sorted(state) == list(range(len(list(gpt().parameters()))))
    assert all(int(s["step"]) == 2 for s in state.values())
    assert saved["iter_num"] == 4 and saved["step_count"] == 2


def test_save_and_load_resume_exactly_here_and_under_fabrics_ddp(ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = ranks
    for rank in results:
        assert max_difference(rank["finetune"], rank["resumed"]) == 0  # bit-equal to the uninterrupted run
        assert max_difference(rank["finetune-ddp"], rank["resumed-ddp"]) < 1e-10  # Fabric's DDP from our checkpoint


def test_bf16_mixed_pairs_with_the_offload_precision_and_tracks_fabrics_ddp(ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = ranks
    reference = results[0]["bf16-ddp"]
    moved = max_difference(reference, weights(gpt(torch.float32)))
    for rank in results:
        assert max_difference(reference, rank["bf16"]) < 0.05 * moved  # bf16 device copies: rounding only


def test_fp16_skips_the_same_steps_on_every_rank_as_fabrics_ddp(ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    """The first step's scaled gradients overflow: every rank skips it and halves the scale, as DDP's ranks do (each
    rank's scaler checked only the gradients it holds, the ranks agree); the rest tracks DDP's fp16 (rounding)."""
    _, results = ranks
    reference = results[0]["fp16-ddp"]
    moved = max_difference(reference, weights(gpt(torch.float32)))
    for rank in results:
        assert rank["fp16-scale"] == rank["fp16-ddp-scale"] == FP16_SCALE / 2
        assert max_difference(reference, rank["fp16"]) < 0.05 * moved


def test_the_nvme_tier_equals_the_run_in_memory_bit_for_bit(ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    out, results = ranks
    for rank in results:
        assert max_difference(rank["finetune"], rank["tier"]) == 0
        assert rank["tier_plan"].startswith("host ") and ", disk " in rank["tier_plan"]
    in_memory, tiered = (torch.load(out / f"{name}.ckpt", weights_only=True) for name in ("finetune", "tier"))
    torch.testing.assert_close(tiered, in_memory, rtol=0, atol=0)  # written by the atomic writer, every rank's state


def test_collectives_answer_as_under_ddp(ranks: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = ranks
    for rank in results:
        assert rank["all_reduce"].item() == 1.5  # the mean of 1 and 2
        assert rank["all_gather"].flatten().tolist() == [0, 1]
        assert rank["broadcast"] == "from rank 0"


@pytest.mark.parametrize(("build", "match"), [
    (lambda: L2LOffloadDDPStrategy(delayed_update=True),
     r"^Fabric\(strategy='l2l_offload_ddp'\): delayed_update=True .*use Trainer\(strategy=L2LOffloadDDPStrategy\(delayed_update=True\)\)"),
    (lambda: L.Fabric(accelerator="cpu", devices=2, strategy="l2l_offload_ddp", precision="bf16-true"),
     r"^precision='bf16-true' \(HalfPrecision\): strategy='l2l_offload_ddp' keeps fp32 masters"),
    (lambda: L2LOffloadDDPStrategy(overlap_step=True), r"^L2LOffloadDDPStrategy\(overlap_step=True\): .*; leave overlap_step unset"),
    (lambda: L2LOffloadDDPStrategy(find_unused_parameters=True),
     r"^L2LOffloadDDPStrategy does not wrap the model in DistributedDataParallel, so find_unused_parameters=\.\.\. would be ignored"),
    (lambda: L2LOffloadDDPStrategy(host_step="sharded"), r"host_step='sharded' is not one of 'partitioned', 'replicated'"),
])
def test_what_cannot_be_honoured_is_refused_when_fabric_is_built(build: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build()


def test_the_name_builds_the_data_parallel_strategy_on_every_device() -> None:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="l2l_offload_ddp")
    assert isinstance(fabric.strategy, L2LOffloadDDPStrategy) and fabric.world_size == 2
    assert fabric.strategy.host_step == "partitioned"
