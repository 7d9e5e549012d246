"""HostStore's gradient buffers: the bf16 gradients kept beside the fp32 buffers widened from them, handed
to the update only while the buffer is still exactly their widening."""

from __future__ import annotations

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
