"""The NVMe tier's plan: what leaves host memory first, and the refusals with their figures."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_accel.offload.tier_plan import (COPY_SLOTS, DEFAULT_CHUNK, GRAD_SLOTS, MIN_CHUNK, UnitBytes, human, parse_bytes,
                                               plan_tier)


def _units(n: int = 4) -> list[UnitBytes]:
    # a 1,000-parameter block trained with AdamW: state 8 kB, masters 4 kB, bf16 shadows 2 kB, gradients 4 kB
    return [UnitBytes(f"layers.{i}", state=8000, masters=4000, weights=2000, grads=4000) for i in range(n)]


def test_everything_stays_in_memory_without_a_budget_or_a_path() -> None:
    plan = plan_tier(_units(), None, nvme=False)
    assert not plan.spills and plan.host_bytes == 4 * 18000 and plan.disk_bytes == 0


def test_optimizer_state_leaves_first_unit_by_unit_then_the_masters() -> None:
    units = _units()
    # all in memory: 72 kB. Each unit's state on disk saves 8 kB, but the first one costs 3 x 8 kB of buffers: the
    # plan goes on unit by unit until the budget is met, the state of every unit before any master
    plan = plan_tier(units, 64_000, nvme=True)
    assert plan.host_bytes == 64_000
    assert plan.state_on_disk == (True, True, True, True) and plan.masters_on_disk == (False, False, False, False)
    assert plan.buffer_bytes == 3 * 8000
    ten = plan_tier(_units(10), 164_000, nvme=True)  # 180 kB in memory: met at the fifth unit's state (180 - 5 x 8 + 24)
    assert ten.state_on_disk == (True,) * 5 + (False,) * 5 and ten.host_bytes == 164_000 and not any(ten.masters_on_disk)
    plan = plan_tier(units, 63_999, nvme=True)  # then the masters, whose buffers grow to 3 x 12 kB
    assert plan.masters_on_disk == (True, True, True, True) and plan.host_bytes == 4 * 6000 + 36_000
    assert plan.disk_bytes == 4 * 12_000
    assert plan.step_read_bytes == plan.step_write_bytes == plan.disk_bytes
    everything = plan_tier(units, None, nvme=True)
    assert all(everything.state_on_disk) and all(everything.masters_on_disk)
    assert everything.host_bytes == 4 * (2000 + 4000) + 3 * 12_000


def test_a_budget_met_in_memory_puts_nothing_on_disk() -> None:
    plan = plan_tier(_units(), 72_000, nvme=True)
    assert not plan.spills and "disk 0 B (host_budget 72.00 kB)" in plan.describe()


def test_over_budget_without_a_path_is_refused_with_the_figures_and_the_fix() -> None:
    with pytest.raises(ValueError, match=r"^strategy.host_budget=50.00 kB is less than the 72.00 kB the offload keeps on the host "
                                         r"\(optimizer state 32.00 kB, fp32 masters 16.00 kB, weights 8.00 kB, gradient buffers "
                                         r"16.00 kB\); set strategy.nvme_path=DIR to put up to 48.00 kB .* raise host_budget to at "
                                         r"least 72.00 kB$"):
        plan_tier(_units(), 50_000, nvme=False)


def test_a_budget_that_even_the_disk_cannot_meet_is_refused() -> None:
    # (these units' weights cannot go to disk: disk_weights 0, as for a quantized base)
    with pytest.raises(ValueError, match=r"less than the 60.00 kB that stays on the host with every unit's optimizer state, "
                                         r"fp32 masters and weights on disk \(weights that cannot go to disk 8.00 kB, gradient "
                                         r"buffers 16.00 kB, I/O buffers 36.00 kB\); raise host_budget to at least 60.00 kB$"):
        plan_tier(_units(), 20_000, nvme=True)


def test_the_weights_leave_last_and_the_compute_reads_them_from_disk() -> None:
    # bf16 shadows (2 kB a unit) the compute runs on twice a step; 3 weight buffers of a unit's shadows
    units = [UnitBytes(f"layers.{i}", state=8000, masters=4000, weights=2000, grads=4000, compute_reads=2, disk_weights=2000,
                       step_weights=2000)
             for i in range(10)]
    masters = plan_tier(units, 96_000, nvme=True, weight_buffers=3)  # 10 x (2 + 4) kB + 3 x 12 kB: state and masters suffice
    assert all(masters.masters_on_disk) and not any(masters.weights_on_disk) and masters.compute_read_bytes == 0
    # the first unit's weights cost 3 x 2 kB of weight buffers and 3 x 2 kB more of step buffers: 108 - 2 kB a unit after
    plan = plan_tier(units, 90_000, nvme=True, weight_buffers=3)
    assert plan.weights_on_disk == (True,) * 9 + (False,) and plan.host_bytes == 90_000
    assert plan.disk_bytes == 10 * 12_000 + 9 * 2000 and plan.compute_read_bytes == 9 * 2 * 2000
    assert plan.step_read_bytes == plan.disk_bytes + plan.compute_read_bytes and plan.step_write_bytes == plan.disk_bytes
    assert "fp32 masters of 10/10, weights of 9/10), 174.00 kB read (of which 36.00 kB by the compute)" in plan.describe()
    with pytest.raises(ValueError, match=r"raise host_budget to at least 88.00 kB$"):  # every unit's weights on disk: 88 kB
        plan_tier(units, 87_999, nvme=True, weight_buffers=3)


def test_fixed_host_bytes_count_against_the_budget() -> None:
    assert plan_tier(_units(), None, nvme=False, fixed=5000).host_bytes == 4 * 18000 + 5000
    assert not plan_tier(_units(), 72_000, nvme=True).spills
    assert plan_tier(_units(), 72_000, nvme=True, fixed=1).spills


@pytest.mark.parametrize(("value", "expected"), [("8GB", 8 * 10**9), ("512MiB", 512 * 2**20), ("1.5e3", 1500), (4096, 4096),
                                                 (" 2 kB ", 2000), ("1TiB", 2**40)])
def test_sizes_parse(value: object, expected: int) -> None:
    assert parse_bytes(value) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("value", ["8 apples", "GB", "-1GB", 0, "", "0.0001"])
def test_a_size_that_is_not_one_is_refused_naming_the_key(value: object) -> None:
    with pytest.raises(ValueError, match=r"^strategy.host_budget=.* (is not a size|must be more than 0 bytes)"):
        parse_bytes(value)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [True, [8], None])
def test_a_size_of_another_type_is_a_type_error(value: object) -> None:
    with pytest.raises(TypeError, match=r"^strategy.host_budget=.* is not a size"):
        parse_bytes(value)  # type: ignore[arg-type]


def test_human() -> None:
    assert [human(n) for n in (999, 1000, 2_500_000, 3 * 10**9, 10**13)] == ["999 B", "1.00 kB", "2.50 MB", "3.00 GB", "10.00 TB"]


def test_gradients_held_at_once_count_once_blocks_step_as_they_land() -> None:
    units = _units() + [UnitBytes("resident", state=80_000, masters=40_000, weights=0, grads=40_000)]
    after = plan_tier(units, None, nvme=False)
    during = plan_tier(units, None, nvme=False, grads_in_flight=2)
    assert after.grad_bytes == 4 * 4000 + 40_000 and during.grad_bytes == 40_000 + 4000
    held = plan_tier(units[::-1], None, nvme=False, grads_in_flight=2, held=1)  # a small resident unit last
    assert held.grad_bytes == 40_000 + 4000 + 4000
    with pytest.raises(ValueError, match=r"gradient buffers 44.00 kB \(2 units' at once\)"):
        plan_tier(units, 1000, nvme=False, grads_in_flight=2)


def test_a_streamed_resident_unit_in_the_tier_holds_one_parameter_s_gradient_at_a_time() -> None:
    # its parameters step as their gradients land (the head's at the start of the backward, the embedding's at its end):
    # each is one more gradient in flight among the blocks', not the whole unit's held to the step
    resident = UnitBytes("resident", state=80_000, masters=40_000, weights=0, grads=40_000, param_grads=(30_000, 10_000))
    units = _units() + [resident]
    in_memory = plan_tier(units, None, nvme=False, grads_in_flight=3, held=1)
    on_disk = plan_tier(units, None, nvme=True, grads_in_flight=3, held=1)
    assert in_memory.grad_bytes == 3 * 4000 + 40_000 and on_disk.grad_bytes == 30_000 + 10_000 + 4000


def test_the_pinned_rings_are_six_slots_of_the_chunk_or_of_the_largest_crossing_parameter() -> None:
    # 100 blocks of 40 MB of state each, on a GPU whose largest parameter crosses the bus in 8 MiB: the rings pin six
    # slots of it whatever the depth; a larger parameter is cut to the chunk
    units = [UnitBytes(f"layers.{i}", state=40 << 20, masters=20 << 20, weights=10 << 20, grads=20 << 20) for i in range(100)]
    small = plan_tier(units, None, nvme=True, staged=8 << 20)
    assert small.staging_slot == 8 << 20 and small.staging_bytes == (GRAD_SLOTS + COPY_SLOTS) * (8 << 20) == 6 * (8 << 20)
    assert plan_tier(units[:50], None, nvme=True, staged=8 << 20).staging_bytes == small.staging_bytes
    large = plan_tier(units, None, nvme=True, staged=1 << 30)
    assert large.staging_slot == DEFAULT_CHUNK and large.host_bytes - small.host_bytes == 6 * (DEFAULT_CHUNK - (8 << 20))
    assert "pinned staging" in large.describe() and plan_tier(units, None, nvme=True).staging_bytes == 0  # (a CPU device)
    # a budget that only a smaller chunk meets: the plan shrinks the step buffers and the slots together, and keeps it
    least = dataclasses.replace(large, chunk=MIN_CHUNK).host_bytes
    tight = plan_tier(units, least + 10 * MIN_CHUNK, nvme=True, staged=1 << 30)
    assert MIN_CHUNK < tight.chunk < DEFAULT_CHUNK and tight.host_bytes <= least + 10 * MIN_CHUNK
    assert dataclasses.replace(tight, chunk=tight.chunk + 8192).host_bytes > least + 10 * MIN_CHUNK  # the largest that fits
