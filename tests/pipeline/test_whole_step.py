"""The pieces of a training step run once per batch around a micro-batched model call (lightning_accel.pipeline.whole_step),
in one process: which module is the entry, gradients equal to the whole batch's, and the output's trip to the other
ranks (lightning_accel.pipeline.call_output)."""

from __future__ import annotations

import pickle
from collections import namedtuple
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lightning_accel.pipeline.call_output import CallOutput, flatten, unflatten
from lightning_accel.pipeline.microbatch import scatter_call
from lightning_accel.pipeline.whole_step import WholeOutputs, _Call, as_leaves, entry_module


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


Pair = namedtuple("Pair", "a b")


@dataclass
class Out(dict):
    """A dataclass that is a dict, as transformers' ModelOutput."""

    logits: torch.Tensor
    extra: Any = None

    def __post_init__(self) -> None:
        self.update({k: v for k, v in vars(self).items() if v is not None})


def test_the_entry_is_the_blocks_nearest_callable_ancestor_below_the_module() -> None:
    task = Task()
    assert entry_module(task, list(task.net.blocks)) == ("net", task.net)
    assert entry_module(task.net, list(task.net.blocks)) is None  # the module itself: its step calls the blocks
    seq = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    holder = nn.Module()
    holder.body = seq
    assert entry_module(holder, list(seq)) == ("body", seq)
    assert entry_module(holder, [seq[0]]) == ("body", seq)  # one block: its parent


def test_gradients_from_the_joined_output_equal_the_whole_batchs() -> None:
    """Each micro-batch's backward starts from the gradient the whole batch's loss gave its output (a nonlinear loss
    over the joined batch), and the code before the call is backpropagated once: every gradient equals one whole-batch
    backward, in float64 (what ModelCalls does around the schedule, in one process)."""
    torch.manual_seed(0)
    task = Task().double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)

    def loss_of(out: torch.Tensor) -> torch.Tensor:
        return ((out - y) ** 2).mean() ** 2  # not a mean of per-sample terms: the micro-batches' mean would differ

    loss_of(task.net(task.embed(x))).backward()
    expected = {n: p.grad.clone() for n, p in task.named_parameters()}
    task.zero_grad()

    parts, sizes = scatter_call((task.embed(x),), {}, 3)
    call = _Call(None)
    leaves = []
    for part in parts:
        part_leaves, pairs = as_leaves(part)
        leaves.append(part_leaves)
        call.before += pairs
    whole = WholeOutputs(3)
    stand_ins = [whole.keep(i, task.net(*leaves[i][0], **leaves[i][1]), torch.device("cpu")) for i in range(3)]
    loss_of(whole.joined(sizes)).backward()
    for stand_in in stand_ins:  # what the schedule does, one micro-batch after the other
        stand_in.sum().backward()
    call.backward_before()
    for name, p in task.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-12, atol=1e-14, msg=name)


def test_an_output_crosses_in_its_structure_and_types() -> None:
    """What the last rank's call returned, rebuilt on the others: containers, named tuples, dataclass outputs (as
    transformers' ModelOutput), values that are not tensors, each tensor's dtype and shape."""
    value = {"out": Out(torch.randn(2, 3), "tag"), "pair": Pair(torch.tensor([1, 2]), [torch.ones(1, dtype=torch.bool), 7])}
    structure, tensors = flatten(value)
    assert pickle.loads(pickle.dumps(structure)) == structure  # what crosses once, while the structure holds
    rebuilt = unflatten(structure, [t.clone() for t in tensors])
    assert type(rebuilt["out"]) is Out and rebuilt["out"]["extra"] == "tag"
    assert torch.equal(rebuilt["out"]["logits"], value["out"].logits)
    assert type(rebuilt["pair"]) is Pair and rebuilt["pair"].b[1] == 7 and rebuilt["pair"].b[0].dtype == torch.bool


def test_a_one_rank_delivery_returns_the_value_itself(one_rank_group) -> None:
    """On the rank that computed it (here the only one), the output is returned as it is (its gradients kept)."""
    leaf = torch.randn(3, requires_grad=True)
    out = CallOutput(0, None, torch.device("cpu"))
    assert out.deliver({"y": leaf * 2})["y"].requires_grad
    assert out.deliver((leaf, None))[0] is leaf  # a second call, another structure
