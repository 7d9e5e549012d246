"""The per-strategy arithmetic against closed forms worked out by hand."""

from __future__ import annotations

import pytest

from lightning_accel.estimate.activations import StepActivations
from lightning_accel.estimate.components import Plan, estimate_ranks
from lightning_accel.estimate.params import Inventory, Tensors
from lightning_accel.estimate.report import Estimate, parse_size

N = 1_000_000  # elements of one block's matrices
V = 1_000  # elements of one block's vectors (norm scales, biases)


def _inventory(blocks: int = 4, rest: int = 2 * N) -> Inventory:
    block = Tensors(trainable=N + V, matrices=N, optimizer_bytes=8 * (N + V))  # AdamW: two fp32 moments
    return Inventory([block] * blocks, Tensors(rest, rest, optimizer_bytes=8 * rest), Tensors())


def _acts(blocks: int = 4, kept: int = 100, inputs: int = 10, backward: int = 50, before: int = 7, after: int = 30, head: int = 200) -> StepActivations:
    return StepActivations(peak=999, kept=[kept] * blocks, inputs=[inputs] * blocks, backward=[backward] * blocks, before=before, after=after, head_backward=head)


def test_l2l_bf16_on_cuda_host_is_20_bytes_a_matrix_element_and_18_a_vector() -> None:
    # masters 4 + bf16 shadow 2 + fp32 grads 4 + pinned bf16 staging 2 + AdamW 8 = 20 (vectors: no shadow, fp32 staging: 20)
    plan = Plan("l2l_offload", compute_size=2, pin=True, prefetch_blocks=1)
    (rank,) = estimate_ranks(_inventory(), _acts(), plan)
    per_block = 20 * N + (4 + 4 + 4 + 8) * V
    assert rank.host_bytes == 4 * per_block
    assert rank.host["low-precision shadows"] == 4 * 2 * N
    # two bf16 blocks (prefetch 1), the fp32 resident unit with its grads and AdamW state, the measured peak
    assert rank.device["blocks in flight (2)"] == 2 * (2 * N + 4 * V)
    assert rank.device["resident parameters"] + rank.device["resident gradients"] + rank.device["resident optimizer state"] == 16 * 2 * N
    assert rank.device["activations (incl. one block's gradients)"] == 999


def test_l2l_offload_resident_streams_the_rest_and_keeps_its_state_on_the_host() -> None:
    plan = Plan("l2l_offload", compute_size=2, pin=True, offload_resident=True)
    (rank,) = estimate_ranks(_inventory(), _acts(), plan)
    assert rank.host["masters (fp32)"] == 4 * (4 * (N + V) + 2 * N)
    assert rank.device["resident unit streamed in"] == 2 * 2 * N
    assert "resident optimizer state" not in rank.device


def test_l2l_ddp_partitions_the_optimizer_state_by_block() -> None:
    inv = _inventory(blocks=4)
    one = estimate_ranks(inv, _acts(), Plan("l2l_offload_ddp", world=2, partitioned=False))[0]
    split = estimate_ranks(inv, _acts(), Plan("l2l_offload_ddp", world=2, partitioned=True))[0]
    assert one.count == split.count == 2
    assert one.host["optimizer state"] == 4 * 8 * (N + V)
    assert split.host["optimizer state"] == 2 * 8 * (N + V)  # two equal blocks each


def test_l2l_on_the_cpu_in_fp32_makes_no_copies() -> None:
    (rank,) = estimate_ranks(_inventory(), _acts(), Plan("l2l_offload", on_cpu=True))
    assert rank.device == {}
    assert "blocks in flight (2)" not in rank.host and "low-precision shadows" not in rank.host


@pytest.mark.parametrize(("schedule", "in_flight"), [("1f1b", [4, 3, 2, 1]), ("gpipe", [8, 8, 8, 8])])
def test_pipeline_stage_keeps_its_micro_batches_in_flight(schedule: str, in_flight: list[int]) -> None:
    plan = Plan("gpipe_distributed", world=8, chunks=8, schedule=schedule, checkpoint="never", balance=(1, 1, 1, 1))
    ranks = estimate_ranks(_inventory(), _acts(), plan)
    assert [r.count for r in ranks] == [2, 2, 2, 2]  # 8 processes: 2 replicas of a 4-stage pipeline
    key = f"activations (8 micro-batches, {schedule}, checkpoint never)"
    # per micro-batch: the stage's block (+ the embedding's 7 on stage 0, the head's 30 on stage 3)
    per_mb = [100 + 7, 100, 100, 100 + 30]
    transient = [50, 50, 50, 200]  # a block's backward; the last stage: the loss's
    assert [r.device[key] for r in ranks] == [m * k + t for m, k, t in zip(in_flight, per_mb, transient)]


def test_pipeline_checkpoint_always_keeps_stage_inputs() -> None:
    plan = Plan("gpipe", chunks=4, checkpoint="always", balance=(2, 2))
    ranks = estimate_ranks(_inventory(), _acts(), plan)
    key = "activations (4 micro-batches, gpipe, checkpoint always)"
    # stage 1: 4 inputs of 10, one micro-batch recomputed (2 blocks of 100 and the head's 30), the loss's backward
    assert ranks[1].device[key] == 4 * 10 + (200 + 30) + 200
    assert ranks[1].device["parameters"] == 4 * 2 * (N + V)
    assert "loader batches (workers x prefetch)" not in ranks[1].host  # one process: counted once


def test_verdict_counts_every_rank_of_the_host() -> None:
    ranks = estimate_ranks(_inventory(), _acts(), Plan("l2l_offload_ddp", world=2, compute_size=2, pin=True))
    estimate = Estimate("r", "l2l_offload_ddp", ranks, device_memory=10**9, host_memory=2 * ranks[0].host_bytes - 1, on_cpu=False)
    assert estimate.device_fits and estimate.host_fits is False and not estimate.fits
    assert estimate.as_json()["ranks"][0]["count"] == 2
    assert "DOES NOT FIT" in estimate.verdict()


@pytest.mark.parametrize(("text", "nbytes"), [("24GB", 24 * 10**9), ("80GiB", 80 * 2**30), ("1.5TB", 1_500 * 10**9), ("512", 512)])
def test_parse_size(text: str, nbytes: int) -> None:
    assert parse_size(text) == nbytes


def test_parse_size_refuses_an_unknown_unit() -> None:
    with pytest.raises(ValueError, match="write e.g. 24GB"):
        parse_size("24 gigs")


@pytest.mark.parametrize(("scratch", "extra"), [(500, 0), (1_500, 501)])
def test_optimizer_step_scratch_counts_only_beyond_the_freed_activations(scratch: int, extra: int) -> None:
    (rank,) = estimate_ranks(_inventory(), _acts(), Plan("plain", step_scratch=scratch))  # activations peak: 999
    assert rank.device.get("optimizer step scratch (beyond the activations)", 0) == extra
