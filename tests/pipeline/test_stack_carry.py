"""Stack ends carried between pipeline stages: which stages carry what (pure), and in one process, stage by stage as
torch's stages exchange them (outputs detached into the next stage's inputs, gradients handed back), an
encoder-decoder's loss and every gradient equal to the model's own forward and backward."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from lightning_accel.pipeline.boundaries import StageBoundaries
from lightning_accel.pipeline.stack_carry import carried_into, carried_out_of, stack_ends


def test_stack_ends_are_the_last_block_of_each_stack_but_the_last():
    names = ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"]
    assert stack_ends(names) == (1,)
    assert stack_ends(["model.layers.0", "model.layers.1"]) == ()
    assert stack_ends(["0", "1", "2"]) == ()  # a mixed nn.Sequential: one stack


@pytest.mark.parametrize(
    ("starts", "into", "out"),
    [
        ([0, 2], [(), ()], [(), ()]),  # the stage boundary at the stack's end: the output itself hands it over
        ([0, 3], [(), (1,)], [(1,), ()]),  # stage 0 ends inside the decoder: it sends the encoder's output on
        ([0, 2, 3, 4], [(), (), (1,), (1,)], [(), (1,), (1,), ()]),  # stage 1 gets it handed, 2 receives and sends it on
    ],
)
def test_which_stages_receive_and_send_a_stack_end(starts, into, out):
    assert [carried_into((1,), starts, s) for s in range(len(starts))] == into
    assert [carried_out_of((1,), starts, s) for s in range(len(starts))] == out


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, h: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
        bias = h.mean(-1, keepdim=True) if bias is None else bias  # computed once, by the first block, then handed on
        return torch.tanh(self.linear(h) + bias), bias


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.cross = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, y: Tensor, memory: Tensor) -> Tensor:
        return torch.tanh(self.linear(y) + self.cross(memory).mean(1, keepdim=True))


class EncoderDecoder(nn.Module):
    """Two stacks; the decoder's blocks each read the encoder's output (after a norm outside the blocks)."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.ModuleList([Encoder() for _ in range(2)])
        self.norm = nn.LayerNorm(4)
        self.decoder = nn.ModuleList([Decoder() for _ in range(3)])

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        h, bias = src, None
        for block in self.encoder:
            h, bias = block(h, bias)
        memory = self.norm(h)
        y = tgt
        for block in self.decoder:
            y = block(y, memory)
        return (y ** 2).mean()


def _pipelined(net: EncoderDecoder, balance: list[int], src: Tensor, tgt: Tensor) -> Tensor:
    """The loss of ``net`` run as stages of ``balance``, each stage's inputs detached copies of the previous one's
    outputs; backward stage by stage, the gradients of each stage's inputs handed to the previous stage's outputs."""
    names = [f"encoder.{k}" for k in range(2)] + [f"decoder.{k}" for k in range(3)]
    bounds = StageBoundaries([*net.encoder, *net.decoder], balance, names)
    try:
        received: tuple[Tensor, ...] | None = None
        sent: list[tuple[Tensor, ...]] = []
        inputs: list[tuple[Tensor, ...]] = []
        for s in range(len(balance)):
            arg = None if received is None else received[0] if len(received) == 1 else received
            out = bounds.run(s, arg, lambda: net(src, tgt))
            if s == len(balance) - 1:
                loss = out
                break
            out = (out,) if isinstance(out, Tensor) else tuple(out)
            sent.append(out)
            received = tuple(t.detach().requires_grad_(t.requires_grad) for t in out)
            inputs.append(received)
        loss.backward()
        for s in reversed(range(len(sent))):
            pairs = [(o, i.grad) for o, i in zip(sent[s], inputs[s]) if o.requires_grad]
            torch.autograd.backward([o for o, _ in pairs], [torch.zeros_like(o) if g is None else g for o, g in pairs])
        return loss.detach()
    finally:
        bounds.restore()


@pytest.mark.parametrize("balance", [[3, 2], [2, 1, 1, 1], [1, 1, 1, 1, 1], [1, 3, 1]])
def test_every_decoder_stage_gets_the_encoders_output_and_its_gradient_sums(balance):
    torch.manual_seed(0)
    net = EncoderDecoder().double()
    src, tgt = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 5, 4, dtype=torch.float64)
    expected = net(src, tgt)
    expected.backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad()
    assert torch.equal(_pipelined(net, balance, src, tgt), expected.detach())
    for n, p in net.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-12, atol=1e-14, msg=n)


def test_a_stack_end_whose_output_cannot_cross_ranks_is_refused_naming_it():
    net = EncoderDecoder()
    original = Encoder.forward

    def unsendable(self: Encoder, h: Tensor, bias: Tensor | None) -> tuple:
        out = original(self, h, bias)
        return (out[0], out[1], lambda: None)  # something no rank can be sent

    net.encoder[1].forward = unsendable.__get__(net.encoder[1])
    bounds = StageBoundaries([*net.encoder, *net.decoder], [3, 2], [f"encoder.{k}" for k in range(2)] + [f"decoder.{k}" for k in range(3)])
    try:
        with pytest.raises(ValueError, match=r"^block 'encoder\.1' ends a stack whose output later pipeline stages need"):
            bounds.run(0, None, lambda: net(torch.randn(1, 3, 4), torch.randn(1, 2, 4)))
    finally:
        bounds.restore()
