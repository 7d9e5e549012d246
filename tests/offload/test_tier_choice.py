"""What the tier's plan chooses to keep host_budget (when the blocks step, where the resident unit lives, the chunk), and
the settings that keep a budget from being met refused in one line naming them and the fix."""

from __future__ import annotations

import pytest

from lightning_accel.offload.tier_choice import TierChoice, TierOptions, choose_tier
from lightning_accel.offload.tier_plan import MIN_CHUNK, BudgetRefused, UnitBytes, parse_chunk, plan_tier

MB = 10**6
# 8 blocks of 1M fp32 parameters trained with AdamW (4 MB masters, 8 MB state, 4 MB gradients each; the compute runs on
# the masters twice a step) and a resident unit of 2M (embedding and head): 32 MB kept on a CPU device, or streamed
BLOCK = UnitBytes("block", state=8 * MB, masters=4 * MB, weights=0, grads=4 * MB, compute_reads=2, compute_masters=4 * MB)
RESIDENT = UnitBytes("resident", state=16 * MB, masters=8 * MB, weights=0, grads=8 * MB, compute_reads=1, compute_masters=8 * MB)
KEPT = 32 * MB


def sizes(stream: bool) -> tuple[list[UnitBytes], int]:
    return [BLOCK] * 8 + ([RESIDENT] if stream else []), KEPT


def _options(**given: object) -> TierOptions:
    return TierOptions(**{"overlap": None, "overlap_default": False, "resident": None, "cpu": True, "nvme": False, **given})  # type: ignore[arg-type]


def test_without_a_disk_the_blocks_step_during_the_backward_where_the_budget_needs_it() -> None:
    # in memory: 8 x 12 MB + the resident 32 MB + gradients (8 blocks' 32 MB after the backward, 4 blocks' 16 MB during it)
    after, choice = choose_tier(_options(), sizes, 160 * MB)
    assert choice == TierChoice(in_backward=False, stream_resident=False) and after.host_bytes == 160 * MB and not after.chosen
    during, choice = choose_tier(_options(), sizes, 150 * MB)
    assert choice.in_backward and during.host_bytes == 144 * MB and during.grad_bytes == 16 * MB
    assert "the plan chose: the blocks step during the backward (4 blocks' gradients at once)" in during.describe()


def test_a_setting_that_keeps_the_budget_from_being_met_is_refused_naming_it_and_the_fix() -> None:
    with pytest.raises(BudgetRefused, match=r"^strategy.host_budget=150.00 MB cannot be met as configured: overlap_step=False "
                                            r"holds every block's gradients until the step \(the least it keeps: 160.00 MB\); left to "
                                            r"the plan it keeps 144.00 MB: leave overlap_step unset, or raise host_budget to at least "
                                            r"160.00 MB$"):
        choose_tier(_options(overlap=False), sizes, 150 * MB)
    clipping = ("gradient_clip_val=1.0 needs every gradient before any block steps", "drop gradient_clip_val")
    with pytest.raises(BudgetRefused, match=r"as configured: gradient_clip_val=1.0 needs every gradient before any block steps .*: "
                                            r"drop gradient_clip_val, or raise host_budget"):
        choose_tier(_options(cannot_overlap=clipping), sizes, 150 * MB)
    ddp = ("l2l_offload_ddp steps a block once its gradients are averaged over the ranks, after the backward", None)
    with pytest.raises(BudgetRefused, match=r"^strategy.host_budget=150.00 MB is less than the 160.00 MB the offload keeps"):
        choose_tier(_options(cannot_overlap=ddp), sizes, 150 * MB)  # nothing the user could leave open: the figures alone


def test_with_a_disk_the_resident_unit_is_streamed_where_the_budget_needs_it() -> None:
    # the blocks step during the backward (with a disk, by default): 16 MB of gradients; step buffers of 1 MiB (a small
    # budget's chunk); 100 MB kept with 6 blocks' state on disk (144 + 3.15 - 6 x 8)
    kept, choice = choose_tier(_options(nvme=True), sizes, 100 * MB, weight_buffers=3)
    assert choice == TierChoice(True, False) and kept.resident_kept == KEPT and kept.host_bytes == 99_145_728
    # everything on disk, the resident unit kept: 16 MB + 3 x 1 MiB + 3 weight buffers of a block's masters + 32 MB =
    # 63.15 MB; streamed, it keeps its gradients (8 MB), a step buffer of its own (its parameters step out of the
    # blocks' order) and what the plan did not need to spill: every unit's state and 7 blocks' masters on disk, the last
    # block's and the resident's masters (4 + 8 MB) in memory
    streamed, choice = choose_tier(_options(nvme=True), sizes, 55 * MB, weight_buffers=3)
    assert choice == TierChoice(True, True) and streamed.held == 1 and streamed.resident_kept == 0
    assert streamed.host_bytes == (16 + 8) * MB + 4 * MIN_CHUNK + 3 * 4 * MB + (4 + 8) * MB
    assert streamed.masters_on_disk == (True,) * 7 + (False, False) and all(streamed.state_on_disk)
    assert "the resident unit streamed through the tier" in streamed.describe()
    with pytest.raises(BudgetRefused, match=r"offload_resident=False keeps the resident unit .* in host memory on the CPU device "
                                            r".*: leave offload_resident unset, or raise host_budget to at least 63.15 MB"):
        choose_tier(_options(nvme=True, resident=False), sizes, 55 * MB, weight_buffers=3)
    # under bf16 a streamed resident unit would compute on bf16 shadows: not the run in RAM, so never chosen
    with pytest.raises(BudgetRefused, match=r"raise host_budget to at least 63.15 MB$"):
        choose_tier(_options(nvme=True, resident_alike=False), sizes, 55 * MB, weight_buffers=3)


def test_the_chunk_is_a_share_of_the_budget_smaller_where_that_keeps_it_and_a_given_one_is_kept_or_refused() -> None:
    big = [UnitBytes(f"layers.{i}", state=800 * MB, masters=400 * MB, weights=0, grads=400 * MB) for i in range(4)]
    # a 32 GB budget: chunks of 256 MiB (the most); 4 GB: 1/64 of it; no budget: 64 MiB
    assert plan_tier(big, 32 * 10**9, nvme=True).chunk == 256 << 20
    assert plan_tier(big, 4 * 10**9, nvme=True).chunk == (4 * 10**9 // 64) >> 20 << 20
    assert plan_tier(big, None, nvme=True).step_buffer == 64 << 20
    # 1.7 GB: the gradients alone take 1.6 GB; 3 step buffers of 1/64 of it (26 MB each) do not fit, smaller ones do
    tight = plan_tier(big, 1_700 * MB, nvme=True)
    assert tight.host_bytes <= 1_700 * MB and MIN_CHUNK <= tight.step_buffer < 1_700 * MB // 64
    with pytest.raises(BudgetRefused, match=r"and strategy.nvme_chunk=268.44 MB \(3 step buffers of 268.44 MB\); set nvme_chunk "
                                            r"to at most 33.33 MB \(or leave it unset: the plan chooses\), or raise host_budget"):
        plan_tier(big, 1_700 * MB, nvme=True, chunk=256 << 20)


@pytest.mark.parametrize(("value", "says"), [
    ("512kB", r"strategy.nvme_chunk='512kB' is less than the least chunk, 1 MiB .*; give at least '1MiB', or leave it unset"),
    ("lots", r"strategy.nvme_chunk='lots' is not a size"),
])
def test_a_chunk_that_is_not_one_is_refused(value: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_chunk(value)
    assert parse_chunk("64MiB") == 64 << 20 and parse_chunk(None) is None


def test_without_a_disk_the_advice_names_the_budget_the_disk_needs_where_the_disk_alone_would_not_do() -> None:
    # 100 MB: the disk alone meets it (its state spilled), so the advice is the disk; 20 MB: even with everything on disk
    # and the resident unit streamed more stays, and the advice says how much, which then keeps the budget
    with pytest.raises(BudgetRefused, match=r"; set strategy.nvme_path=DIR to put up to .* or raise host_budget to at least "
                                            r"144.00 MB$"):
        choose_tier(_options(), sizes, 100 * MB, weight_buffers=3)
    with pytest.raises(BudgetRefused, match=r"; raise host_budget to at least 144.00 MB, or set strategy.nvme_path=DIR and "
                                            r"host_budget to at least ([\d.]+) MB \(what stays on the host with the disk: its "
                                            r"I/O buffers too\)$") as refused:
        choose_tier(_options(), sizes, 20 * MB, weight_buffers=3)
    floor = refused.value.args[0].split("host_budget to at least ")[-1].split(" ")[0]
    with_disk, choice = choose_tier(_options(nvme=True), sizes, int(float(floor) * MB), weight_buffers=3)
    assert choice.stream_resident and with_disk.host_bytes <= float(floor) * MB
    with pytest.raises(BudgetRefused, match=r"^strategy.host_budget=20.00 MB is less than the .* that stays on the host with "
                                            rf"every unit's .*raise host_budget to at least {floor} MB$"):
        choose_tier(_options(nvme=True), sizes, 20 * MB, weight_buffers=3)  # with the disk: the same floor


def test_a_resident_unit_that_would_not_fit_the_device_is_streamed_and_the_line_says_why() -> None:
    # a GPU (cpu=False) whose memory the strategy knows: the resident unit kept there holds 32 MB with its gradients and
    # AdamW state, the blocks in flight 8 MB; on a 64 MB device it stays, on a 32 MB one the plan streams it (the host's
    # plan alone would not: on a GPU streaming adds host bytes), and says why on the plan line
    gpu = dict(cpu=False, overlap_default=True, nvme=True, resident_device=KEPT, blocks_device=8 * MB)
    kept, choice = choose_tier(_options(**gpu, device_memory=64 * MB), sizes, None, weight_buffers=3)
    assert not choice.stream_resident and not kept.device_side
    streamed, choice = choose_tier(_options(**gpu, device_memory=32 * MB), sizes, None, weight_buffers=3)
    assert choice.stream_resident and streamed.held == 1 and not streamed.chosen
    assert streamed.device_side == ("the plan streamed the resident unit (32.00 MB with its gradients and optimizer state, "
                                    "beside 8.00 MB of blocks in flight, over the device's 32.00 MB)",)
    assert "; for the device: the plan streamed the resident unit (32.00 MB" in streamed.describe()
    # the user's offload_resident=False is theirs: refused, naming it and the fix
    with pytest.raises(BudgetRefused, match=r"^offload_resident=False keeps the resident unit on the device \(32.00 MB with its "
                                            r"gradients and optimizer state, beside 8.00 MB of blocks in flight\), over the "
                                            r"device's 32.00 MB; leave offload_resident unset \(the plan streams it\) or set it "
                                            r"to True$"):
        choose_tier(_options(**gpu, device_memory=32 * MB, resident=False), sizes, None, weight_buffers=3)
    # the device's size unknown (no CUDA device): nothing changes
    unknown, choice = choose_tier(_options(**gpu), sizes, None, weight_buffers=3)
    assert not choice.stream_resident
