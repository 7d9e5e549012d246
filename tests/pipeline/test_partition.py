import copy
import itertools

import pytest
import torch
from torch import nn

from lightning_accel.pipeline.partition import (
    balance_by_cost,
    block_bytes,
    check_balance,
    profile_block_times,
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


def test_stage_of_block():
    assert stage_of_block([2, 1, 3]) == [0, 0, 1, 2, 2, 2]


class Work(nn.Module):
    """tanh(lin(x)) computed ``repeat`` times and averaged: equal bytes and value, ``repeat`` times the cost."""

    def __init__(self, width: int, repeat: int) -> None:
        super().__init__()
        self.lin, self.repeat = nn.Linear(width, width), repeat

    def forward(self, x):
        return sum(torch.tanh(self.lin(x)) for _ in range(self.repeat)) / self.repeat


class Sampled(nn.Module):
    """Embedding (so the blocks' input is not the batch), four blocks, and a head that must not run."""

    def __init__(self, repeats=(1, 64, 1, 1)) -> None:
        super().__init__()
        self.pre = nn.Sequential(nn.Embedding(10, 32), nn.BatchNorm1d(6), nn.Dropout(0.5))
        self.blocks = nn.ModuleList(Work(32, r) for r in repeats)
        self.post = nn.Linear(32, 2)
        self.post_calls = 0

    def forward(self, idx):
        x = self.pre(idx)  # (B, 6, 32)
        for block in self.blocks:
            x = block(x)
        self.post_calls += 1
        return self.post(x)


@pytest.mark.parametrize("device", [None, "cpu"])  # "cpu": each block moved to the device for its timing, and back
def test_profile_block_times_measures_each_block_on_its_own_input(device):
    torch.manual_seed(0)
    net = Sampled()
    idx = torch.randint(0, 10, (16, 6))
    times = profile_block_times(net, list(net.blocks), lambda: net(idx), device=device)
    assert len(times) == 4 and min(times) > 0
    assert times[1] > 4 * max(times[0], times[2], times[3])  # 64 passes against 1: a wide margin for noisy machines
    assert net.post_calls == 0  # stopped before the last block: no head, no loss


@pytest.mark.parametrize("device", [None, "cpu"])
def test_profile_block_times_leaves_grads_buffers_and_rng_as_they_were(device):
    torch.manual_seed(0)
    net = Sampled()
    idx = torch.randint(0, 10, (16, 6))
    net(idx).sum().backward()  # gradients of an earlier micro-batch, as under gradient accumulation
    grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    objects = {n: p.grad for n, p in net.named_parameters()}
    state = copy.deepcopy(net.state_dict())
    rng = torch.get_rng_state()
    profile_block_times(net, list(net.blocks), lambda: net(idx), device=device)
    assert torch.equal(torch.get_rng_state(), rng)
    for name, value in net.state_dict().items():
        assert torch.equal(value, state[name]), name  # BatchNorm statistics and num_batches_tracked included
    for name, p in net.named_parameters():
        assert p.grad is objects[name] and torch.equal(p.grad, grads[name]), name


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_profile_block_times_on_a_gpu_leaves_a_cpu_model_on_the_cpu():
    """A pipeline stage's device, timed before the split: each block visits the GPU alone and comes back."""
    torch.manual_seed(0)
    net = Sampled()
    idx = torch.randint(0, 10, (16, 6))
    state = copy.deepcopy(net.state_dict())
    times = profile_block_times(net, list(net.blocks), lambda: net(idx), device="cuda")
    assert times[1] > 4 * max(times[0], times[2], times[3])
    assert all(t.device.type == "cpu" for t in [*net.parameters(), *net.buffers()])
    for name, value in net.state_dict().items():
        assert torch.equal(value, state[name]), name


def test_profile_block_times_names_blocks_the_sample_never_reached():
    net = Sampled()
    with pytest.raises(ValueError, match=r"block\(s\) \[2, 3\] of 4 were never called.*; pass an explicit balance"):
        profile_block_times(net, list(net.blocks), lambda: net.blocks[1](net.blocks[0](torch.randn(2, 32))))
