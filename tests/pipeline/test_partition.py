import itertools

import pytest
import torch
from torch import nn

from lightning_accel.pipeline.partition import (
    balance_by_cost,
    block_bytes,
    check_balance,
    profile_times,
    stage_of_block,
)


def _brute_force(costs, stages):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), stages - 1):
        bounds = (0, *cuts, n)
        load = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
        if best is None or load < best:
            best = load
    return best


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_balance_by_cost_is_optimal(seed, stages):
    g = torch.Generator().manual_seed(seed)
    costs = torch.randint(1, 20, (7,), generator=g).tolist()
    balance = balance_by_cost(costs, stages)
    assert len(balance) == stages and sum(balance) == 7 and min(balance) >= 1
    bounds = [0, *itertools.accumulate(balance)]
    load = max(sum(costs[a:b]) for a, b in zip(bounds, bounds[1:]))
    assert load == _brute_force(costs, stages)


def test_balance_by_cost_equal_blocks_split_evenly():
    assert balance_by_cost([1] * 8, 4) == [2, 2, 2, 2]
    assert balance_by_cost([4, 1, 1, 1, 1], 2) == [1, 4]


def test_more_stages_than_blocks_is_an_error():
    with pytest.raises(ValueError, match="cannot split 3 blocks into 4 stages"):
        balance_by_cost([1, 1, 1], 4)


def test_check_balance_errors_name_values_and_fix():
    assert check_balance((2, 2), 4, 2) == [2, 2]
    with pytest.raises(ValueError, match=r"blocks: 4, sum of balance \[2, 1\]: 3\); give a balance that sums to 4"):
        check_balance([2, 1], 4, 2)
    with pytest.raises(ValueError, match="3 stages but only 2 devices"):
        check_balance([1, 1, 2], 4, 2)
    with pytest.raises(ValueError, match="positive ints"):
        check_balance([2, 0, 2], 4, 3)


def test_block_bytes_counts_parameters_and_buffers():
    blocks = [nn.Linear(4, 4), nn.BatchNorm1d(4)]
    # Linear: 16 + 4 floats; BatchNorm1d: weight, bias, running mean/var (4 each) + num_batches_tracked (int64)
    assert block_bytes(blocks) == [20 * 4, 16 * 4 + 8]


def test_profile_times_measures_each_block_and_leaves_no_grads():
    blocks = [nn.Linear(8, 8), nn.Sequential(*[nn.Linear(8, 8) for _ in range(20)])]
    times = profile_times(blocks, torch.randn(16, 8))
    assert len(times) == 2 and times[1] > times[0] > 0
    assert all(p.grad is None for b in blocks for p in b.parameters())


def test_stage_of_block():
    assert stage_of_block([2, 1, 3]) == [0, 0, 1, 2, 2, 2]
