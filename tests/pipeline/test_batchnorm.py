import copy

import pytest
import torch
from torch import nn

from lightning_accel.models.block_policy import find_blocks
from lightning_accel.pipeline.local import LocalPipeline, checkpoint_stop
from lightning_accel.pipeline.microbatch import scatter


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.bn = nn.Linear(6, 6), nn.BatchNorm1d(6, momentum=None)  # cumulative average: every batch counts

    def forward(self, x):
        return torch.relu(self.bn(self.lin(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 6)
        self.blocks = nn.ModuleList(Block() for _ in range(2))

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return x


def _pipelined_batches(net, batches, chunks, deferred, mode="always"):
    pipe = LocalPipeline(net, find_blocks(net), [1, 1], ["cpu", "cpu"], checkpoint_stop(mode, chunks), deferred)
    pipe.place()
    for x in batches:
        outs = []
        for i, xb in enumerate(scatter(x, chunks)):
            with pipe.microbatch(i):
                outs.append(net(xb))
        pipe.finish_batch()
        torch.cat(outs).sum().backward()  # recomputes every micro-batch: must not count twice
    pipe.restore()


@pytest.mark.parametrize("mode", ["always", "never"])
def test_deferred_running_stats_equal_plain_training_over_the_whole_batch(mode):
    torch.manual_seed(0)
    net = Net().double()
    plain, per_micro = copy.deepcopy(net), copy.deepcopy(net)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(16, 4, generator=g, dtype=torch.float64) * 3 + 1 for _ in range(3)]
    for x in batches:
        plain(x)
    _pipelined_batches(net, batches, chunks=4, deferred=True, mode=mode)
    _pipelined_batches(per_micro, batches, chunks=4, deferred=False, mode=mode)
    bn, ref, naive = net.blocks[0].bn, plain.blocks[0].bn, per_micro.blocks[0].bn
    # the first BatchNorm sees the same inputs as in plain training (stem is not normalized): exact equality
    torch.testing.assert_close(bn.running_mean, ref.running_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(bn.running_var, ref.running_var, rtol=1e-12, atol=1e-12)
    assert int(bn.num_batches_tracked) == 3
    # without deferral the statistics are per micro-batch: the variance of a quarter batch, counted 12 times
    assert int(naive.num_batches_tracked) == 12
    assert not torch.allclose(naive.running_var, ref.running_var, rtol=1e-3)
    assert "forward" not in net.blocks[0].bn.__dict__  # restored


def test_eval_mode_uses_running_statistics():
    net = Net()
    for b in net.blocks:
        b.bn.running_mean.fill_(0.5)
        b.bn.running_var.fill_(2.0)
    plain = copy.deepcopy(net).eval()
    pipe = LocalPipeline(net, find_blocks(net), [2], ["cpu"], 0, deferred_batch_norm=True)
    pipe.place()
    net.eval()
    x = torch.randn(5, 4)
    torch.testing.assert_close(net(x), plain(x))
