"""Delayed update and activation offload in the executor, without Lightning."""

from __future__ import annotations


import threading

import pytest
import torch

from lightning_accel.offload import L2LExecutor, OffloadStats, make_plan
from lightning_accel.offload.delayed import DelayedUpdate
from lightning_accel.offload.host_store import HostStore
from tests.support.offload_nets import Net


def _pair() -> tuple[Net, Net]:
    torch.manual_seed(0)
    reference, model = Net(width=8).double(), Net(width=8).double()
    model.load_state_dict(reference.state_dict())
    return reference, model


def _batches(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(6, 4, generator=g, dtype=torch.float64) for _ in range(n)]


def _delayed_reference(model: Net, batches: list[torch.Tensor]) -> None:
    """ZeRO-Offload's DPU written out: each step's gradient is taken at the current weights,
    then the blocks receive the *previous* step's update and the rest this step's."""
    late = list(model.layers.parameters())
    now = [p for n, p in model.named_parameters() if not n.startswith("layers.")]
    opt_late, opt_now = torch.optim.Adam(late, lr=0.01), torch.optim.Adam(now, lr=0.01)
    pending: list[torch.Tensor] | None = None
    for x in batches:
        grads = torch.autograd.grad(model(x).square().mean(), late + now)
        if pending is not None:
            for p, g in zip(late, pending):
                p.grad = g
            opt_late.step()
        for p, g in zip(now, grads[len(late):]):
            p.grad = g
        opt_now.step()
        pending = list(grads[: len(late)])
    assert pending is not None
    for p, g in zip(late, pending):
        p.grad = g
    opt_late.step()


@pytest.mark.parametrize("alias", [True, False], ids=["aliased", "copied"])
def test_host_update_lands_mid_forward_without_touching_the_compute(alias: bool) -> None:
    reference, model = _pair()
    batches = _batches(4)
    _delayed_reference(reference, batches)

    executor = L2LExecutor(model, make_plan(model, "auto"), torch.device("cpu"), alias=alias, delayed_update=True)
    executor.attach()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    assert executor.delayed is not None
    # Force the worst case: the pending update runs to completion between block 1 and
    # block 2 of the next forward. Were the compute reading the masters, blocks 2-3 would
    # see update t-1 in forward (and all blocks in the recompute) and the gradients differ.
    go, landed = threading.Event(), threading.Event()
    apply = executor.delayed._apply

    def apply_when_told() -> None:
        assert go.wait(10)
        apply()
        landed.set()

    executor.delayed._apply = apply_when_told  # type: ignore[method-assign]

    def between_blocks(*_: object) -> None:
        if executor.delayed is not None and executor.delayed._future is not None and not landed.is_set():
            go.set()
            assert landed.wait(10)

    model.layers[2].register_forward_pre_hook(between_blocks)
    for x in batches:
        go.clear()
        landed.clear()
        executor.begin_step()
        executor.start_delayed_update()
        loss = model(x).square().mean()
        executor.begin_backward()
        loss.backward()
        executor.end_backward()
        executor.finish_delayed_update()
        executor.defer_update(optimizer)  # block gradients wait; the head and embedding step now
        optimizer.step()
        optimizer.zero_grad()
        executor.after_step(masters_changed=False)
    executor.finish_delayed_update()
    assert executor.stats.delayed_steps == len(batches)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, rtol=0, atol=1e-12, msg=name)
    # between steps every block parameter is back on its master, and the snapshots agree
    for param, master in executor.store.master.items():
        assert param.data_ptr() == master.data_ptr()
        torch.testing.assert_close(executor.store.shadow[param], master, rtol=0, atol=0)
    executor.detach()


def test_delayed_update_needs_a_snapshot_store() -> None:
    model = Net(width=8)
    store = HostStore(make_plan(model).blocks, torch.float32, pin=False)
    with pytest.raises(ValueError, match=r"DelayedUpdate needs HostStore\(snapshot=True\)"):
        DelayedUpdate(store, OffloadStats())


@pytest.mark.parametrize("prefetch", [0, 1])
def test_activation_offload_moves_exactly_the_block_inputs(prefetch: int) -> None:
    reference, model = _pair()
    x = _batches(1)[0]
    reference(x).square().mean().backward()
    expected = {n: p.grad.clone() for n, p in reference.named_parameters()}

    executor = L2LExecutor(model, make_plan(model, "auto", prefetch_blocks=prefetch), torch.device("cpu"), offload_activations=True)
    executor.attach()
    parked: list[tuple[int, int]] = []  # (device tensor, host copy) storage addresses
    pack = executor.activations._pack  # type: ignore[union-attr]

    def spy(tensor: torch.Tensor) -> object:
        packed = pack(tensor)
        parked.append((tensor.data_ptr(), packed[1].data_ptr()))
        return packed

    executor.activations._pack = spy  # type: ignore[method-assign, union-attr]
    executor.begin_step()
    loss = model(x).square().mean()
    executor.begin_backward()
    loss.backward()
    executor.end_backward()
    executor.install_grads()
    for name, grad in expected.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, rtol=0, atol=1e-12, msg=name)
    # one (batch, width) float64 input per block, out and back; each a separate host copy
    boundary = len(model.layers) * x.shape[0] * 8 * 8
    assert executor.stats.activation_d2h_bytes == boundary
    assert executor.stats.activation_h2d_bytes == boundary
    assert len(parked) == len(model.layers) and all(dev != host for dev, host in parked)


def test_activation_offload_needs_checkpointed_blocks() -> None:
    model = Net(width=8)
    with pytest.raises(ValueError, match=r"offload_activations=True needs checkpoint_blocks=True"):
        L2LExecutor(model, make_plan(model), torch.device("cpu"), checkpoint_blocks=False, offload_activations=True)
