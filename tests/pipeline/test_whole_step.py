"""The pieces of a training step run once per batch around a micro-batched model call (lightning_accel.pipeline.whole_step),
in one process: which module is the entry, the call's capture and split, and gradients equal to the whole batch's."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_accel.pipeline.whole_step import Captured, EntryCall, WholeOutputs, entry_module


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = torch.tanh(block(h))
        return self.head(h) * scale


class Task(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 3)  # used before the entry's call, with gradients
        self.net = Net()


def test_the_entry_is_the_blocks_nearest_callable_ancestor_below_the_module() -> None:
    task = Task()
    assert entry_module(task, list(task.net.blocks)) == ("net", task.net)
    assert entry_module(task.net, list(task.net.blocks)) is None  # the module itself: its step calls the blocks
    seq = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    holder = nn.Module()
    holder.body = seq
    assert entry_module(holder, list(seq)) == ("body", seq)
    assert entry_module(holder, [seq[0]]) == ("body", seq)  # one block: its parent


def test_a_captured_call_is_split_and_a_second_call_is_refused() -> None:
    task = Task()
    call = EntryCall("net", task.net)
    x = torch.randn(6, 3)
    with call.capturing(), pytest.raises(Captured) as captured:
        task.net(x, scale=2.0)
    assert call.split(captured.value.call_args, captured.value.call_kwargs, lambda n: 3) == 3
    assert call.sizes == [2, 2, 2]
    assert torch.equal(torch.cat([call.micro(i) for i in range(3)]), task.net(x, scale=2.0))
    with call.capturing():
        with pytest.raises(Captured):
            task.net(x)
        with pytest.raises(ValueError, match="called net .* 2 times in one step"):
            task.net(x)


def test_gradients_from_the_joined_output_equal_the_whole_batchs() -> None:
    """Each micro-batch's backward starts from the gradient the whole batch's loss gave its output (a nonlinear loss
    over the joined batch), and the code before the call is backpropagated once: every gradient equals one whole-batch
    backward, in float64."""
    torch.manual_seed(0)
    task = Task().double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)

    def loss_of(out: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).mean() ** 2  # not a mean of per-sample terms: the micro-batches' mean would differ

    loss_of(task.net(task.embed(x))).backward()
    expected = {n: p.grad.clone() for n, p in task.named_parameters()}
    task.zero_grad()

    call = EntryCall("net", task.net)
    with call.capturing(), pytest.raises(Captured) as captured:
        task.net(task.embed(x))
    chunks = call.split(captured.value.call_args, captured.value.call_kwargs, lambda n: 3)
    whole = WholeOutputs(chunks)
    stand_ins = [whole.keep(i, call.micro(i), torch.device("cpu")) for i in range(chunks)]
    loss_of(whole.joined(call.sizes)).backward()
    for stand_in in stand_ins:  # what the schedule does, one micro-batch after the other
        stand_in.sum().backward()
    call.backward_before()
    for name, p in task.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-12, atol=1e-14, msg=name)


def test_capture_says_what_failed_instead_of_a_call_it_can_split() -> None:
    """A rank's step run up to the model's call: the step's own error before the call, a step that never makes the call,
    a call without a batched tensor, each returned (every rank then ends the step with it), in one line."""
    task = Task()
    call = EntryCall("net", task.net)
    x = torch.randn(4, 3)
    assert call.capture(lambda b: task.net(b), x, lambda n: 2, "training_step") is None
    assert call.sizes == [2, 2]

    def raises(_: torch.Tensor) -> None:
        raise KeyError("input_ids")

    assert isinstance(call.capture(raises, x, lambda n: 2, "training_step"), KeyError)
    never = call.capture(lambda b: b.sum(), x, lambda n: 2, "validation_step")
    assert isinstance(never, ValueError)
    assert str(never) == ("validation_step returned without calling net (the module that runs the pipelined blocks); the "
                          "pipeline runs the blocks inside that call: call the model in validation_step")
    unbatched = call.capture(lambda b: task.net(scale=1.0), x, lambda n: 2, "training_step")
    assert isinstance(unbatched, ValueError)
    assert str(unbatched).startswith("net was called without a batched tensor argument; the pipeline splits the call")
    assert task.net.forward.__func__ is Net.forward  # the module's own forward again after each capture
