"""The per-strategy arithmetic against closed forms worked out by hand."""

from __future__ import annotations

import pytest

from lightning_accel.estimate.activations import StepActivations
from lightning_accel.estimate.components import Plan, estimate_ranks
from lightning_accel.estimate.params import Inventory, Tensors
from lightning_accel.estimate.report import Estimate, device_size, named_device, parse_size

N = 1_000_000  # elements of one block's matrices
V = 1_000  # elements of one block's vectors (norm scales, biases)


def _inventory(blocks: int = 4, rest: int = 2 * N) -> Inventory:
    block = Tensors(trainable=N + V, matrices=N, optimizer_bytes=8 * (N + V))  # AdamW: two fp32 moments
    return Inventory([block] * blocks, Tensors(rest, rest, optimizer_bytes=8 * rest), Tensors())


def _acts(blocks: int = 4, kept: int = 100, inputs: int = 10, backward: int = 50, before: int = 7, after: int = 30, head: int = 200) -> StepActivations:
    return StepActivations(peak=999, kept=[kept] * blocks, inputs=[inputs] * blocks, backward=[backward] * blocks, before=before, after=after, head_backward=head)


def test_l2l_bf16_on_cuda_host_is_18_bytes_a_matrix_element_and_16_a_vector_and_six_pinned_slots() -> None:
    # masters 4 + bf16 shadow 2 + fp32 grads 4 + AdamW 8 = 18 (vectors: no shadow, 16); the copies cross 6 pinned slots of
    # a unit's crossing bytes at most (offload/staging.py), not a staging buffer per parameter (2 B more a matrix element)
    plan = Plan("l2l_offload", compute_size=2, pin=True, prefetch_blocks=1)
    (rank,) = estimate_ranks(_inventory(), _acts(), plan)
    per_block = 18 * N + (4 + 4 + 8) * V
    assert rank.host["pinned staging (copy rings)"] == 6 * (2 * N + 4 * V)
    assert rank.host_bytes == 4 * per_block + 6 * (2 * N + 4 * V)
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
    # stage 1: 4 x (its input of 10 and the head's 30, outside the checkpoint), one micro-batch's 2 blocks of 100
    # recomputed, the loss's backward
    assert ranks[1].device[key] == 4 * (10 + 30) + 200 + 200
    assert ranks[0].device[key] == 4 * 7 + 200 + 50  # the embedding's output is the stage's input
    assert ranks[1].device["parameters"] == 4 * 2 * (N + V)
    assert "loader batches (workers x prefetch)" not in ranks[1].host  # one process: counted once


def test_gpipe_distributed_recomputes_block_by_block_and_keeps_every_block_input() -> None:
    plan = Plan("gpipe_distributed", world=2, chunks=4, schedule="gpipe", checkpoint="always", balance=(2, 2))
    ranks = estimate_ranks(_inventory(), _acts(), plan)
    key = "activations (4 micro-batches, gpipe, checkpoint always)"
    assert ranks[0].device[key] == 4 * (7 + 10) + 100 + 50  # the embedding's output and block 1's input; one block recomputed
    assert ranks[1].device[key] == 4 * (10 + 10 + 30) + 100 + 200


def test_gpipe_distributed_ranks_keep_outside_weights_receive_buffers_and_last_gradients() -> None:
    inv = Inventory([Tensors(trainable=N, matrices=N, optimizer_bytes=8 * N)] * 4, Tensors(3 * V, 3 * V, optimizer_bytes=24 * V),
                    Tensors(5 * V, 5 * V, optimizer_bytes=40 * V))
    plan = Plan("gpipe_distributed", world=2, chunks=4, schedule="1f1b", balance=(2, 2))
    first, last = estimate_ranks(inv, _acts(), plan)
    # the head (5V) unused on the first rank, the embedding (3V) on the last: weights only, no gradient or state
    assert first.device["weights outside the blocks, unused here"] == 4 * 5 * V
    assert last.device["weights outside the blocks, unused here"] == 4 * 3 * V
    assert first.device["gradients"] == 4 * (2 * N + 3 * V) and last.device["optimizer state"] == 8 * 2 * N + 40 * V
    # the schedule's backward runs inside training_step, before Lightning zeroes the last step's gradients
    assert first.device["last step's gradients (zeroed after training_step)"] == first.device["gradients"]
    # per micro-batch: the first rank receives its output's gradient, the last its input (block 2's input: 10)
    assert first.device["receive buffers (4 micro-batches)"] == last.device["receive buffers (4 micro-batches)"] == 4 * 10


def test_gpipe_distributed_counts_the_encoders_output_carried_beside_the_activations() -> None:
    """An encoder-decoder split 3 + 1, the encoder's last block (1) inside stage 0: stage 0 sends its output on beside
    its own (pipeline/stack_carry), so both ranks keep a receive buffer of it per micro-batch too (block 1's input: 6)."""
    acts = StepActivations(peak=999, kept=[100] * 4, inputs=[10, 6, 10, 10], backward=[50] * 4, before=7, after=30, head_backward=200)
    plan = Plan("gpipe_distributed", world=2, chunks=4, schedule="1f1b", balance=(3, 1), stack_ends=(1,))
    first, last = estimate_ranks(_inventory(), acts, plan)
    assert first.device["receive buffers (4 micro-batches)"] == last.device["receive buffers (4 micro-batches)"] == 4 * (10 + 6)
    at_the_boundary = estimate_ranks(_inventory(), acts, Plan("gpipe_distributed", world=2, chunks=4, schedule="1f1b", balance=(2, 2), stack_ends=(1,)))
    assert at_the_boundary[1].device["receive buffers (4 micro-batches)"] == 4 * 10  # the output itself hands it over


def test_gpipe_on_the_cpu_is_one_process_running_one_backward_at_a_time() -> None:
    plan = Plan("gpipe", on_cpu=True, chunks=4, checkpoint="always", balance=(2, 2))
    (process,) = estimate_ranks(_inventory(), _acts(), plan)
    assert process.kind == "process (stages 0-1)" and process.device == {}
    key = "activations (4 micro-batches, gpipe, checkpoint always)"
    # both stages' kept micro-batches, and the larger of their recompute + backward (stage 1: the loss's 200)
    assert process.host[key] == 4 * 7 + 4 * (10 + 30) + 200 + 200
    assert process.host["parameters"] == 4 * (4 * (N + V) + 2 * N)


def test_pipeline_except_last_keeps_the_last_micro_batch_whole() -> None:
    plan = Plan("gpipe_distributed", world=2, chunks=4, schedule="gpipe", checkpoint="except_last", balance=(2, 2))
    ranks = estimate_ranks(_inventory(), _acts(), plan)
    key = "activations (4 micro-batches, gpipe, checkpoint except_last)"
    # three light micro-batches and the whole last one (2 blocks + head), or four light ones and a recompute: the larger
    assert ranks[1].device[key] == max(3 * 50 + 230 + 200, 4 * 50 + 100 + 200)


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


@pytest.mark.parametrize(("text", "nbytes"), [("H100", 80 * 2**30), ("l4", 24 * 2**30), ("TPU v4", 32 * 2**30), ("A100-40GB", 40 * 10**9), ("24GB", 24 * 10**9)])
def test_device_sizes_by_size_or_accelerator(text: str, nbytes: int) -> None:
    assert device_size(text) == nbytes


def test_an_a100_without_its_size_is_refused() -> None:
    with pytest.raises(ValueError, match="A100-40GB"):
        device_size("A100")


@pytest.mark.parametrize(("purpose", "name"), [("all 4 chips of a TPU v4-8", "TPU v4"), ("one L4 GPU", "L4"), ("an L40S card", "L40S"), ("GPT on one GPU", None)])
def test_an_accelerator_named_in_a_purpose(purpose: str, name: str | None) -> None:
    named = named_device(purpose)
    assert (named[0] if named else None) == name


def test_xla_spmd_devices_each_hold_the_model_and_one_process_loads() -> None:
    device, host = estimate_ranks(_inventory(), _acts(), Plan("xla_spmd", world=4, loader_bytes=123))
    assert (device.kind, device.count, host.kind, host.count) == ("xla device", 4, "host process", 1)
    assert device.device["parameters"] == 4 * (4 * (N + V) + 2 * N) and "DDP gradient buckets" not in device.device
    assert device.host == {} and host.host == {"loader batches (workers x prefetch)": 123}
