"""Copies between stages: a plain ``.to()`` without CUDA, copy streams with it (the CUDA tests need a GPU)."""

import copy

import pytest
import torch
from torch import nn

from lightning_accel.models.block_policy import find_blocks
from lightning_accel.pipeline.local import LocalPipeline, checkpoint_stop
from lightning_accel.pipeline.microbatch import scatter
from lightning_accel.pipeline.reduction import reduce_outputs
from lightning_accel.pipeline.streams import StageCopier
from tests.support.stage_nets import Net


def test_without_cuda_a_copy_is_a_plain_move_of_nested_values():
    copier = StageCopier([torch.device("cpu"), torch.device("cpu")])
    assert not copier.enabled
    x = torch.randn(2, 3, requires_grad=True)
    batch = {"x": x, "pair": (x, 3), "name": "a"}
    moved = copier(batch, torch.device("cpu"))
    assert moved["x"] is x and moved["pair"][0] is x and moved["pair"][1] == 3 and moved["name"] == "a"
    assert copier.streams == {}


def _grads_match_plain_training(devices: list[str], chunks: int = 4) -> LocalPipeline:
    torch.manual_seed(0)
    net = Net().double()
    ref = copy.deepcopy(net)
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    nn.functional.mse_loss(ref(x), y).backward()
    pipe = LocalPipeline(net, find_blocks(net), [2, 2], [torch.device(d) for d in devices], checkpoint_stop("except_last", chunks))
    pipe.place()
    first = torch.device(devices[0])
    for _ in range(2):  # the second step runs the stages as whole checkpoints
        net.zero_grad(set_to_none=True)
        losses, sizes = [], []
        for i, (xb, yb) in enumerate(scatter((x.to(first), y.to(first)), chunks)):
            with pipe.microbatch(i):
                out = net(xb)
                assert out.device == first
                losses.append(nn.functional.mse_loss(out, yb))
            sizes.append(xb.size(0))
        reduce_outputs(losses, sizes).backward()
        for (name, p), q in zip(net.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=1e-10, atol=1e-12, msg=name)
    return pipe


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize(
    "devices",
    [
        ["cuda:0", "cuda:0"],  # two stages sharing one GPU: nothing to copy between them
        ["cpu", "cuda:0"],  # host to device on the copy stream, and the output and gradients back
        pytest.param(["cuda:0", "cuda:1"], marks=pytest.mark.skipif(
            torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")),
    ],
)
def test_cuda_stages_copy_on_copy_streams_and_match_plain_training(devices):
    pipe = _grads_match_plain_training(devices)
    assert pipe.copy.enabled
    crossing = {torch.device(d) for d in devices if torch.device(d).type == "cuda"} if len(set(devices)) > 1 else set()
    assert set(pipe.copy.streams) == crossing  # a copy stream on every CUDA device a tensor crossed to or from


def test_cpu_stages_match_plain_training_through_the_same_check():
    pipe = _grads_match_plain_training(["cpu", "cpu"])  # the CUDA test's check, on the path every CPU run takes
    assert not pipe.copy.enabled and pipe.copy.streams == {}


def test_the_cuda_copy_is_differentiable_and_sends_the_gradient_back_the_same_way():
    """The autograd plumbing of the CUDA path, with the stream work itself (which needs a GPU) replaced by ``.to()``."""
    from lightning_accel.pipeline.streams import _Copy

    class Recording(StageCopier):
        def __init__(self) -> None:
            super().__init__([torch.device("cpu")])
            self.copies: list[tuple[torch.dtype, str]] = []

        def _copy(self, tensor, device):
            self.copies.append((tensor.dtype, str(device)))
            return tensor.to(device) * 1  # a new tensor, as a copy across devices makes

    copier = Recording()
    x = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    y = _Copy.apply(copier, torch.device("cpu"), x)
    (y * torch.arange(6.0, dtype=torch.float64).view(3, 2)).sum().backward()
    torch.testing.assert_close(x.grad, torch.arange(6.0, dtype=torch.float64).view(3, 2))
    assert copier.copies == [(torch.float64, "cpu"), (torch.float64, "cpu")]  # forward, then the gradient back
