import copy

import pytest
import torch
from torch import nn

from lightning_accel.models import GPT
from lightning_accel.models.block_policy import find_blocks
from lightning_accel.pipeline.local import LocalPipeline, checkpoint_stop
from lightning_accel.pipeline.microbatch import scatter
from lightning_accel.pipeline.reduction import reduce_outputs
from tests.support.stage_nets import Net


def test_checkpoint_stop_policy():
    assert [checkpoint_stop(m, 4) for m in ("always", "except_last", "never")] == [4, 3, 0]
    with pytest.raises(ValueError, match="checkpoint must be one of always, except_last, never, got 'sometimes'"):
        checkpoint_stop("sometimes", 4)


@pytest.mark.parametrize(("mode", "recomputed"), [("always", 4), ("except_last", 3), ("never", 0)])
def test_rematerialization_and_exact_gradients(mode, recomputed):
    torch.manual_seed(0)
    net = Net().double()
    ref = copy.deepcopy(net)
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    nn.functional.mse_loss(ref(x), y).backward()

    chunks = 4
    pipe = LocalPipeline(net, find_blocks(net), [1, 3], ["cpu", "cpu"], checkpoint_stop(mode, chunks))
    pipe.place()
    losses, sizes = [], []
    for i, (xb, yb) in enumerate(scatter((x, y), chunks)):
        with pipe.microbatch(i):
            losses.append(nn.functional.mse_loss(net(xb), yb))
        sizes.append(xb.size(0))
    reduce_outputs(losses, sizes).backward()
    # every block ran once per micro-batch forward, plus once per re-materialized micro-batch
    assert [layer.calls for layer in net.layers] == [chunks + recomputed] * 4
    for (name, p), (ref_name, q) in zip(net.named_parameters(), ref.named_parameters()):
        assert name == ref_name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)


def test_assignment_attaches_outside_modules_to_first_and_last_stage():
    net = Net()
    pipe = LocalPipeline(net, find_blocks(net), [2, 1, 1], ["cpu"] * 3)
    assert pipe.assignment() == {
        "stem": 0, "layers.0": 0, "layers.1": 0, "layers.2": 1, "layers.3": 2, "head": 2,
    }


def test_restore_leaves_a_plain_model_with_the_same_names():
    net = Net()
    names = [n for n, _ in net.state_dict().items()]
    pipe = LocalPipeline(net, find_blocks(net), [2, 2], ["cpu", "cpu"], checkpoint_stop("always", 2))
    pipe.place()
    assert list(net.state_dict()) == names
    assert "forward" in net.layers[0].__dict__
    pipe.restore()
    assert "forward" not in net.layers[0].__dict__
    assert not net._forward_hooks and not net.stem._forward_pre_hooks


def test_restore_puts_back_a_forward_the_users_instance_already_had():
    # accelerate's hooks (and users) set module.forward on the instance; restore() must not delete it
    net = Net()
    own = net.layers[1].forward
    net.layers[1].forward = own  # type: ignore[method-assign]
    pipe = LocalPipeline(net, find_blocks(net), [2, 2], ["cpu", "cpu"])
    pipe.place()
    assert net.layers[1].__dict__["forward"] is not own
    pipe.restore()
    assert net.layers[1].__dict__["forward"] is own and "forward" not in net.layers[0].__dict__


def test_tied_weights_across_devices_are_refused_before_moving():
    net = GPT("tiny", n_layer=2, n_embd=16, n_head=2, block_size=8, vocab_size=32)
    pipe = LocalPipeline(net, find_blocks(net), [1, 1], ["cpu", "meta"])
    with pytest.raises(ValueError, match=r"shared by pre.wte \(stage 0, cpu\) and post.lm_head \(stage 1, meta\).*; untie"):
        pipe.place()
    assert all(p.device.type == "cpu" for p in net.parameters())


class Between(Net):
    """Does something between blocks (from ``between`` on): the blocks do not chain, so no stage may be run whole."""

    def __init__(self, between: bool = True) -> None:
        super().__init__()
        self.between = between

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
            if self.between:
                x = x * 1.0  # a new tensor: the next block's input is not the previous block's output
        return self.head(x)


def _step(pipe, net, x, y, chunks):
    """One pipelined step; returns the bytes its forward saved for backward."""
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    net.zero_grad(set_to_none=True)
    losses, sizes = [], []
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for i, (xb, yb) in enumerate(scatter((x, y), chunks)):
            with pipe.microbatch(i):
                losses.append(nn.functional.mse_loss(net(xb), yb))
            sizes.append(xb.size(0))
    reduce_outputs(losses, sizes).backward()
    return saved[0]


@pytest.mark.parametrize("balance", [[4], [2, 2], [1, 3]])
def test_a_stage_whose_blocks_chain_keeps_only_its_input_per_micro_batch(balance):
    torch.manual_seed(0)
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    chained, per_block = Net().double(), Between().double()
    per_block.load_state_dict(chained.state_dict())
    ref = copy.deepcopy(chained)
    nn.functional.mse_loss(ref(x), y).backward()
    saved = {}
    for name, net in (("chained", chained), ("per_block", per_block)):
        pipe = LocalPipeline(net, find_blocks(net), balance, ["cpu"] * len(balance), checkpoint_stop("always", 4))
        pipe.place()
        _step(pipe, net, x, y, 4)  # the first micro-batch shows whether the blocks chain
        saved[name] = _step(pipe, net, x, y, 4)
        several = [s for s, n in enumerate(balance) if n > 1]  # a one-block stage is one checkpoint either way
        assert [pipe.stage_chained(s) for s in several] == [name == "chained"] * len(several)
        for p, q in zip(net.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
    # block by block every block boundary of the whole batch is kept (8 rows x 8 floats); as stages, one per stage
    assert saved["per_block"] - saved["chained"] == (4 - len(balance)) * 8 * 8 * 8
    assert [layer.calls for layer in chained.layers] == [2 * (4 + 4)] * 4  # forward + recomputation, twice


def test_blocks_that_stop_chaining_fall_back_block_by_block_with_a_warning_and_exact_gradients():
    torch.manual_seed(0)
    net = Between(between=False).double()
    ref = copy.deepcopy(net)  # no optimizer step below: the weights stay these
    x, y = torch.randn(8, 3, dtype=torch.float64), torch.randn(8, 2, dtype=torch.float64)
    pipe = LocalPipeline(net, find_blocks(net), [4], ["cpu"], checkpoint_stop("always", 2))
    pipe.place()
    _step(pipe, net, x, y, 2)
    assert pipe.stage_chained(0)
    net.between = ref.between = True
    nn.functional.mse_loss(ref(x), y).backward()
    with pytest.warns(RuntimeWarning, match=r"block 'layers.1' was called with something other than the previous block"):
        _step(pipe, net, x, y, 2)
    assert not pipe.stage_chained(0)
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12)
