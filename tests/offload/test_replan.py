"""The executor follows what the user's code changes in the planned parameters between steps (no Lightning): a
parameter that starts or stops training, a weight re-parametrized by torch's pruning, replaced data, parameters added
or replaced; the gradients landing on the host after each change are plain autograd's. A quantized weight set to
train and a replaced block are refused in one line."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.utils import prune

from lightning_accel.offload import L2LExecutor, make_plan
from tests.support.offload_nets import Net, Residual


def _offloaded(frozen: slice = slice(1, None), alias: bool = True) -> tuple[Net, L2LExecutor]:
    torch.manual_seed(0)
    model = Net().double()
    model.layers[frozen].requires_grad_(False)
    executor = L2LExecutor(model, make_plan(model), torch.device("cpu"), alias=alias)
    executor.attach()
    return model, executor


def _host_grads(model: Net, executor: L2LExecutor, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """One step's gradients as the host holds them after the backward (after the executor followed the changes)."""
    executor.begin_step()
    loss = model(x).square().mean()
    executor.begin_backward()
    loss.backward()
    executor.end_backward()
    executor.install_grads()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    executor.after_step()
    model.zero_grad(set_to_none=True)
    return grads


def _plain_grads(model: Net, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """The same model's gradients under plain autograd: a twin holding the same values, nothing offloaded."""
    twin = Net().double()
    twin.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()})
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    for name, param in twin.named_parameters():
        param.requires_grad_(name in trainable)
    twin(x).square().mean().backward()
    return {n: p.grad for n, p in twin.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("alias", [True, False], ids=["aliased", "copied"])
def test_a_parameter_thawed_and_frozen_again_lands_autogrades_gradients(alias: bool) -> None:
    model, executor = _offloaded(alias=alias)
    x = torch.randn(8, 4, dtype=torch.float64)
    assert not executor.find_changes()
    assert set(_host_grads(model, executor, x)) == set(_plain_grads(model, x))  # layers 1-3 frozen: none
    model.layers[2].requires_grad_(True)
    changes = executor.find_changes()
    assert changes.thaw == list(model.layers[2].parameters()) and changes.trainable_changed
    assert "4 parameters began training" in changes.describe() and "layers.2.norm.weight" in changes.describe()
    for _ in range(2):  # (a second step: the hook is registered once)
        got, want = _host_grads(model, executor, x), _plain_grads(model, x)
        assert got.keys() == want.keys() and "layers.2.fc.weight" in got
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-15, msg=name)
    model.layers[2].requires_grad_(False)
    assert executor.find_changes().refreeze == list(model.layers[2].parameters())
    assert "layers.2.fc.weight" not in _host_grads(model, executor, x)
    assert model.layers[2].fc.weight in executor.store.frozen and not executor.store.thawed


def test_pruning_renames_a_weight_and_adds_a_buffer_to_its_unit() -> None:
    model, executor = _offloaded(frozen=slice(0, 0))
    fc = model.layers[1].fc
    weight = fc.weight
    prune.l1_unstructured(fc, "weight", amount=0.3)  # weight -> weight_orig (the same parameter) * weight_mask
    changes = executor.find_changes()
    assert changes.units == [1] and not changes.adopt
    executor.begin_step()
    unit = executor.plan.blocks[1]
    assert ("layers.1.fc.weight_orig", weight) in unit.params
    assert "layers.1.fc.weight_mask" in [name for _, _, name in unit.buffers]
    assert weight in executor.store.master and not executor.find_changes()


def test_replaced_data_is_what_the_next_step_computes_on() -> None:
    model, executor = _offloaded(frozen=slice(0, 0), alias=False)
    x = torch.randn(8, 4, dtype=torch.float64)
    _host_grads(model, executor, x)
    model.layers[0].fc.weight.data = torch.zeros(16, 16, dtype=torch.float64)  # a lottery-ticket reset
    assert executor.find_changes().adopt == [model.layers[0].fc.weight]
    got, want = _host_grads(model, executor, x), _plain_grads(model, x)
    torch.testing.assert_close(got["layers.1.fc.weight"], want["layers.1.fc.weight"], rtol=0, atol=1e-15)
    assert torch.equal(executor.store.master[model.layers[0].fc.weight], torch.zeros(16, 16, dtype=torch.float64))


def test_a_parameter_added_or_replaced_in_a_block_is_planned_and_hooked() -> None:
    model, executor = _offloaded(frozen=slice(0, 0))
    old = model.layers[3].fc.bias
    model.layers[3].fc.bias = nn.Parameter(torch.ones(16, dtype=torch.float64))  # a new parameter object
    changes = executor.find_changes()
    assert changes.units == [3]
    executor.begin_step()
    executor.end_eval()
    assert old not in executor.store.master and model.layers[3].fc.bias in executor.store.master
    x = torch.randn(8, 4, dtype=torch.float64)
    assert "layers.3.fc.bias" in _host_grads(model, executor, x)  # its gradient went to the host


def test_a_replaced_block_is_refused() -> None:
    model, executor = _offloaded()
    model.layers[1] = Residual(16).double()
    with pytest.raises(RuntimeError, match=r"^L2LExecutor: block layers\.1 was replaced by a Residual after the offload was planned, "
                                           r"and the plan streams the Residual it wrapped; change the model's blocks before fit"):
        executor.find_changes()


def test_a_quantized_weight_set_to_train_is_refused_naming_it() -> None:
    from tests.support.finetune_models import to_nf4

    torch.manual_seed(0)
    model = Net(width=128)
    fc = model.layers[1].fc
    fc.weight = nn.Parameter(to_nf4(fc.weight.data.bfloat16()), requires_grad=False)
    executor = L2LExecutor(model, make_plan(model), torch.device("cpu"))
    executor.attach()
    assert not executor.find_changes()
    fc.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"^L2LExecutor: parameter layers\.1\.fc\.weight is stored as NF4Tensor \(quantized\), "
                                           r"which cannot train, and it was set to require grad after the offload was planned; "
                                           r"keep it frozen \(requires_grad=False\)"):
        executor.begin_step()
    assert fc.weight in executor.store.frozen  # nothing changed


def test_the_model_is_walked_only_when_something_may_have_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Between steps the executor compares flags and data pointers (~0.3 us a parameter); it walks the modules
    (~30 us a parameter) after a registration anywhere, a requires_grad flip or replaced data."""
    import lightning_accel.offload.executor as executor_module

    walks = []
    walk = executor_module.find_changes
    monkeypatch.setattr(executor_module, "find_changes", lambda *args: walks.append(1) or walk(*args))
    model, executor = _offloaded()
    x = torch.randn(8, 4, dtype=torch.float64)
    for _ in range(3):
        _host_grads(model, executor, x)
    assert len(walks) == 1  # the first step's (nothing settled yet)
    model.layers[2].fc.bias.requires_grad_(True)
    _host_grads(model, executor, x)
    nn.Linear(2, 2)  # a registration on any module
    _host_grads(model, executor, x)
    model.layers[0].fc.weight.data = model.layers[0].fc.weight.data.clone()
    _host_grads(model, executor, x)
    _host_grads(model, executor, x)
    assert len(walks) == 4
