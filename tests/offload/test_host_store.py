"""HostStore's gradient buffers: the bf16 gradients kept beside the fp32 buffers widened from them, handed
to the update only while the buffer is still exactly their widening. And what the store holds for a parameter that
starts or stops training after planning, or whose data the user's code replaced: what planning would have given it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_accel.offload.host_store import HostStore
from lightning_accel.offload.plan import Unit


def _store(keep: bool = True) -> tuple[HostStore, nn.Parameter, nn.Parameter]:
    torch.manual_seed(0)
    layer = nn.Linear(64, 32)
    store = HostStore([Unit("layer", layer, [("weight", layer.weight), ("bias", layer.bias)])], torch.bfloat16, pin=False)
    store.keep_low(keep)
    return store, layer.weight, layer.bias


def _grads(store: HostStore, *params: nn.Parameter, owned: bool = True) -> dict[nn.Parameter, torch.Tensor]:
    low = {p: torch.randn(p.shape).to(torch.bfloat16) for p in params}
    for p, g in low.items():
        store.add_grad(p, g, owned=owned)
    store.install_grads()
    return low


def test_the_bf16_gradient_is_handed_over_while_the_buffer_is_its_widening() -> None:
    store, weight, bias = _store()
    low = _grads(store, weight, bias)
    kept = store.exact_low_grads()
    assert list(kept) == [weight] and kept[weight] is low[weight]  # the bias has no bf16 shadow: not kept
    assert torch.equal(weight.grad, low[weight].float())
    store.clear_grads()
    assert store.exact_low_grads() == {} and weight.grad is None


def test_a_written_or_replaced_gradient_is_read_in_fp32() -> None:
    store, weight, _ = _store()
    _grads(store, weight)
    weight.grad.mul_(0.5)  # clipping
    assert store.exact_low_grads() == {}
    store.clear_grads()
    low = _grads(store, weight)
    low[weight].add_(1)  # the bf16 tensor itself
    assert store.exact_low_grads() == {}
    store.clear_grads()
    _grads(store, weight)
    weight.grad = weight.grad.clone()  # a user's hook
    assert store.exact_low_grads() == {}


def test_an_accumulated_gradient_is_no_widening() -> None:
    store, weight, _ = _store()
    _grads(store, weight)
    _grads(store, weight)
    assert store.exact_low_grads() == {} and weight not in store.low_grads


def test_nothing_is_kept_unless_asked_or_for_fp32_gradients() -> None:
    store, weight, _ = _store(keep=False)
    _grads(store, weight)
    assert store.low_grads == {}
    store.clear_grads()
    store.keep_low(True)
    store.add_grad(weight, torch.randn(32, 64), owned=True)
    assert store.low_grads == {}


def test_switching_off_releases_what_was_kept() -> None:
    # (the delayed update, from its warm-up's end on: its gradients are deferred as fp32)
    store, weight, _ = _store()
    _grads(store, weight)
    store.keep_low(False)
    assert store.low_grads == {} and store.exact_low_grads() == {}


def test_a_staging_buffer_is_kept_as_it_is() -> None:
    # on a GPU the gradients land in pinned staging buffers the streamer keeps anyway: the very tensor
    store, weight, _ = _store()
    low = _grads(store, weight, owned=False)
    assert store.exact_low_grads()[weight] is low[weight]
    store.drop_low_grads([weight])
    assert store.exact_low_grads() == {}


# -- parameters that start or stop training after planning (gradual unfreezing) ------------------------------------


def _planned(dtype: torch.dtype, compute: torch.dtype, trainable: bool, snapshot: bool = False) -> tuple[HostStore, nn.Linear]:
    torch.manual_seed(0)
    layer = nn.Linear(64, 32).to(dtype).requires_grad_(trainable)
    store = HostStore([Unit("layer", layer, [("weight", layer.weight), ("bias", layer.bias)])], compute, pin=False, snapshot=snapshot)
    return store, layer


KINDS = [(torch.bfloat16, torch.bfloat16, False), (torch.float64, torch.float32, False), (torch.float32, torch.float32, True)]


@pytest.mark.parametrize(("dtype", "compute", "snapshot"), KINDS, ids=["bf16-base", "float64", "snapshot"])
def test_a_thawed_parameter_holds_what_it_would_have_held_trainable_at_planning(dtype: torch.dtype, compute: torch.dtype,
                                                                                snapshot: bool) -> None:
    store, layer = _planned(dtype, compute, trainable=False, snapshot=snapshot)
    twin_store, twin = _planned(dtype, compute, trainable=True, snapshot=snapshot)
    layer.requires_grad_(True)
    for param in (layer.weight, layer.bias):
        store.thaw(param)
    assert not store.frozen and store.thawed == {layer.weight: dtype, layer.bias: dtype}
    for param, other in ((layer.weight, twin.weight), (layer.bias, twin.bias)):
        assert store.master[param].dtype == twin_store.master[other].dtype  # fp32, float64 for a float64 model
        assert torch.equal(store.master[param], twin_store.master[other]) and param.data.data_ptr() == store.master[param].data_ptr()
        assert (store.shadow[param] is store.master[param]) == (twin_store.shadow[other] is twin_store.master[other])
        assert store.shadow[param].dtype == twin_store.shadow[other].dtype
    assert store.host_bytes() == twin_store.host_bytes()
    if dtype == torch.bfloat16:  # the matrix travels in bf16, the bias in fp32
        assert store.shadow[layer.weight].dtype == torch.bfloat16 and store.shadow[layer.bias] is store.master[layer.bias]


@pytest.mark.parametrize(("dtype", "compute", "snapshot"), KINDS, ids=["bf16-base", "float64", "snapshot"])
def test_frozen_again_a_parameter_goes_back_to_its_stored_dtype_rounded_from_its_master(dtype: torch.dtype, compute: torch.dtype,
                                                                                        snapshot: bool) -> None:
    store, layer = _planned(dtype, compute, trainable=False, snapshot=snapshot)
    frozen_bytes = store.host_bytes()
    layer.requires_grad_(True)
    store.thaw(layer.weight)
    store.add_grad(layer.weight, torch.ones(32, 64), owned=True)
    store.master[layer.weight].add_(1e-3)  # trained
    trained = store.master[layer.weight].clone()
    layer.weight.requires_grad_(False)
    store.refreeze(layer.weight)
    assert layer.weight.dtype == dtype and torch.equal(layer.weight.data, trained.to(dtype))
    assert store.master[layer.weight] is store.shadow[layer.weight] and layer.weight in store.frozen
    assert layer.weight not in store.thawed and layer.weight not in store.grads
    assert store.host_bytes() == frozen_bytes


def test_replaced_data_is_adopted_as_the_master_and_the_shadow_follows() -> None:
    store, layer = _planned(torch.float32, torch.bfloat16, trainable=True)
    master = store.master[layer.weight]
    assert store.holds_data_of(layer.weight)
    layer.weight.data = torch.full((32, 64), 0.5)  # ModelPruning's lottery-ticket reset does this
    assert not store.holds_data_of(layer.weight)
    store.adopt(layer.weight)
    assert store.master[layer.weight] is master and store.holds_data_of(layer.weight)
    assert torch.equal(master, torch.full((32, 64), 0.5)) and torch.equal(store.shadow[layer.weight], master.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"replaced by a tensor of shape \(3,\), not \(32,\); replace the parameter"):
        layer.bias.data = torch.zeros(3)
        store.adopt(layer.bias)


def test_a_frozen_parameters_replaced_data_becomes_its_stored_tensor() -> None:
    store, layer = _planned(torch.bfloat16, torch.bfloat16, trainable=False)
    new = torch.zeros(32, 64, dtype=torch.float16)
    layer.weight.data = new
    store.adopt(layer.weight)
    assert store.master[layer.weight].data_ptr() == new.data_ptr() and store.holds_data_of(layer.weight)
    assert layer.weight in store.frozen


def test_a_parameter_added_or_removed_after_planning() -> None:
    store, layer = _planned(torch.float32, torch.bfloat16, trainable=True)
    before = store.host_bytes()
    store.remove(layer.weight)
    assert layer.weight not in store.master and layer.weight not in store.shadow
    store.add("layer.weight", layer.weight)
    assert store.host_bytes() == before and store.shadow[layer.weight].dtype == torch.bfloat16


def test_a_quantized_weight_cannot_be_thawed_nor_planned_trainable() -> None:
    from tests.support.finetune_models import to_nf4

    layer = nn.Linear(256, 64, bias=False)
    layer.weight = nn.Parameter(to_nf4(layer.weight.data.bfloat16()), requires_grad=False)
    store = HostStore([Unit("layer", layer, [("layer.weight", layer.weight)])], torch.bfloat16, pin=False)
    with pytest.raises(ValueError, match=r"^the parameter is stored as NF4Tensor \(quantized\), which cannot train; keep it frozen "
                                         r"\(requires_grad=False\) and train an adapter on it \(peft LoRA\)"):
        store.thaw(layer.weight)
    assert layer.weight in store.frozen
    layer.weight.requires_grad_(True)
    with pytest.raises(ValueError, match=r"^parameter layer.weight is stored as NF4Tensor \(quantized\), which cannot train; keep it frozen"):
        HostStore([Unit("layer", layer, [("layer.weight", layer.weight)])], torch.bfloat16, pin=False)
