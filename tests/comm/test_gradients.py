"""A gradient split across ranks: its whole norm, clipping by it and the found-inf verdict, against torch on a gloo
group of one (the 2-rank behaviour runs in tests/strategies/test_l2l_offload_ddp.py and the pipeline's tests)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_accel.comm.gradients import agree_found_inf, clip_grad_norm_over, grad_norm_over

CPU = torch.device("cpu")


def test_clip_across_ranks_counts_each_gradient_once_like_torch(group_of_one: dist.ProcessGroup) -> None:
    torch.manual_seed(0)
    grads = [torch.randn(5, dtype=torch.float64) for _ in range(3)]
    expected = [g.clone() for g in grads]
    params = [nn.Parameter(torch.zeros(5, dtype=torch.float64)) for _ in range(3)]
    for p, g in zip(params, expected):
        p.grad = g
    want = torch.nn.utils.clip_grad_norm_(params, 0.5)
    norm = clip_grad_norm_over(grads, [True, True, True], 0.5, group_of_one, CPU)
    assert float(norm) == pytest.approx(float(want), rel=1e-12)
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=1e-12, atol=0)
    # a gradient counted on another rank (not here) is scaled but not summed
    grads = [torch.ones(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)]
    assert float(clip_grad_norm_over(grads, [True, False], 1.0, group_of_one, CPU)) == pytest.approx(2.0)
    torch.testing.assert_close(grads[1], torch.full((4,), 1.0 / (2.0 + 1e-6), dtype=torch.float64))


def test_a_norm_below_the_limit_leaves_the_gradients_as_they_are(group_of_one: dist.ProcessGroup) -> None:
    grads = [torch.full((3,), 0.1), torch.full((2,), 0.2, dtype=torch.bfloat16)]
    before = [g.clone() for g in grads]
    clip_grad_norm_over(grads, [True, True], 10.0, group_of_one, CPU)
    assert all(torch.equal(g, b) and g.dtype == b.dtype for g, b in zip(grads, before))


@pytest.mark.parametrize("norm_type", [1.0, 2.0, 3.0, float("inf")])
def test_the_whole_norm_is_torchs_total_norm(group_of_one: dist.ProcessGroup, norm_type: float) -> None:
    torch.manual_seed(1)
    grads = [torch.randn(7), torch.randn(2, 3), torch.randn(5)]
    want = torch.nn.utils.get_total_norm(grads, norm_type)
    got = grad_norm_over(grads, [True, True, True], norm_type, group_of_one, CPU)
    assert got.dtype == torch.float64 and float(got) == pytest.approx(float(want), rel=1e-6)
    # the uncounted gradient (held alike by another rank, counted there) is left out
    assert float(grad_norm_over(grads, [True, True, False], norm_type, group_of_one, CPU)) == pytest.approx(
        float(torch.nn.utils.get_total_norm(grads[:2], norm_type)), rel=1e-6)


def test_one_overflow_flag_sets_every_flag(group_of_one: dist.ProcessGroup) -> None:
    flags = [torch.zeros(()), torch.ones(())]  # (per device, as a GradScaler keeps them)
    assert bool(agree_found_inf(flags, group_of_one, CPU)) is True and [float(f) for f in flags] == [1.0, 1.0]
    flags = [torch.zeros(())]
    assert bool(agree_found_inf(flags, group_of_one, CPU)) is False and float(flags[0]) == 0.0
    assert bool(agree_found_inf([], group_of_one, CPU)) is False  # a rank without flags still takes part
    found = {CPU: torch.ones(())}  # a GradScaler's found_inf_per_device: its values
    assert bool(agree_found_inf(found.values(), None, CPU)) is True and float(found[CPU]) == 1.0  # None: every rank
