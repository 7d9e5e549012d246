"""L2L execution without Lightning: same gradients as plain autograd, bounded residency."""

from __future__ import annotations


import pytest
import torch
from torch import nn

from lightning_accel.models import GPT
from lightning_accel.offload import L2LExecutor, make_plan
from tests.support.offload_nets import Net


def _grads(model: nn.Module, x: torch.Tensor, executor: L2LExecutor | None = None) -> dict[str, torch.Tensor]:
    if executor is not None:
        executor.begin_step()
    loss = model(x).square().mean()
    if executor is not None:
        executor.begin_backward()
    loss.backward()
    if executor is not None:
        executor.end_backward()
        executor.install_grads()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("alias", [True, False], ids=["aliased", "copied"])
@pytest.mark.parametrize("checkpoint_blocks", [True, False])
@pytest.mark.parametrize("offload_resident", [False, True])
def test_gradients_equal_plain_autograd(alias: bool, checkpoint_blocks: bool, offload_resident: bool) -> None:
    torch.manual_seed(0)
    reference = Net(depth=5).double()
    model = Net(depth=5).double()
    model.load_state_dict(reference.state_dict())
    x = torch.randn(8, 4, dtype=torch.float64)
    expected = _grads(reference, x)
    plan = make_plan(model, "auto", prefetch_blocks=1, offload_resident=offload_resident)
    executor = L2LExecutor(model, plan, torch.device("cpu"), checkpoint_blocks=checkpoint_blocks, alias=alias)
    executor.attach()
    got = _grads(model, x, executor)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-12, msg=name)
    if not alias:
        # every block crossed "the bus" twice (forward, recompute) when checkpointed, except the
        # last, whose backward follows its forward at once (not checkpointed, kept on the device);
        # once each without checkpointing
        block_bytes = sum(u.nbytes(8) for u in plan.blocks)
        last = plan.blocks[-1].nbytes(8)
        resident = plan.resident.nbytes(8) if offload_resident else 0
        expected = 2 * block_bytes - last if checkpoint_blocks else block_bytes
        assert executor.stats.h2d_bytes - resident == expected
        assert executor.stats.d2h_bytes >= block_bytes


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_peak_resident_blocks_is_one_plus_prefetch_at_any_depth(prefetch: int) -> None:
    peaks = []
    for depth in (4, 16):
        model = Net(depth)
        executor = L2LExecutor(model, make_plan(model, "auto", prefetch_blocks=prefetch), torch.device("cpu"), alias=False)
        executor.attach()
        _grads(model, torch.randn(2, 4), executor)
        peaks.append(executor.stats.peak_resident_blocks)
    assert peaks == [1 + prefetch, 1 + prefetch]


def test_weights_live_on_the_host_between_steps_and_detach_restores_forward() -> None:
    torch.manual_seed(0)
    model = GPT("tiny", n_layer=3, block_size=16)
    x = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        expected = model(x)
    executor = L2LExecutor(model, make_plan(model, ["GPTBlock"]), torch.device("cpu"), alias=False)
    executor.attach()
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected)
    executor.end_eval()
    assert not executor.streamer.on_device  # nothing left "on the device"
    assert all(p.data_ptr() == executor.store.master[p].data_ptr() for p in executor.store.master)
    executor.detach()
    assert "forward" not in vars(model.blocks[0])


def test_detach_puts_back_a_forward_the_users_instance_already_had() -> None:
    model = GPT("tiny", n_layer=2, block_size=16)
    own = model.blocks[1].forward
    model.blocks[1].forward = own  # type: ignore[method-assign]  # as accelerate's hooks do
    executor = L2LExecutor(model, make_plan(model, ["GPTBlock"]), torch.device("cpu"), alias=False)
    executor.attach()
    assert vars(model.blocks[1])["forward"] is not own
    executor.detach()
    assert vars(model.blocks[1])["forward"] is own and "forward" not in vars(model.blocks[0])


def test_bf16_copies_halve_the_bytes() -> None:
    model = Net(depth=3)
    plan = make_plan(model)
    executor = L2LExecutor(model, plan, torch.device("cpu"), compute_dtype=torch.bfloat16)
    executor.attach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        executor.begin_step()
        loss = model(torch.randn(2, 4)).float().square().mean()
    executor.begin_backward()
    loss.backward()
    executor.end_backward()
    def nbytes(units) -> int:  # matrices as bf16, biases and norm scales as fp32
        params = [p for u in units for _, p in u.params]
        return sum((2 if p.ndim >= 2 else 4) * p.numel() for p in params)

    # two passes (forward + recompute), except the last block: one (it stays for its backward)
    assert executor.stats.h2d_bytes == 2 * nbytes(plan.blocks) - nbytes(plan.blocks[-1:])
    assert all(g.dtype == torch.float32 for g in executor.store.grads.values())  # fp32 on the host


def test_plan_errors() -> None:
    with pytest.raises(ValueError, match=r"prefetch_blocks must be >= 0, got -1"):
        make_plan(Net(2), prefetch_blocks=-1)
    with pytest.raises(ValueError, match=r"no blocks found in Linear"):
        make_plan(nn.Linear(2, 2))


class Normed(nn.Module):
    """A block with buffers (BatchNorm running statistics) updated in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.fc(x)))


def test_buffers_updated_on_the_device_come_back_to_the_host() -> None:
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(3, 6), nn.Sequential(Normed(), Normed()), nn.Linear(6, 1))
    model = nn.Sequential(nn.Linear(3, 6), nn.Sequential(Normed(), Normed()), nn.Linear(6, 1))
    model.load_state_dict(reference.state_dict())
    executor = L2LExecutor(model, make_plan(model, [Normed]), torch.device("cpu"), checkpoint_blocks=False, alias=False)
    executor.attach()
    x = torch.randn(16, 3)
    with torch.no_grad():
        reference(x)
        executor.begin_step()
        model(x)
        executor.end_eval()
    for name, buf in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], buf, msg=name)
    assert model[1][0].bn.running_mean.abs().sum() > 0  # the statistics did move
