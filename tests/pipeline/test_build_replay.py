"""The user's build run again (:mod:`lightning_accel.pipeline.build_replay`) and its values placed in a module built on
meta (:func:`~lightning_accel.pipeline.deferred_init.materialize_from`): equal to a plain seeded build, in one process."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch import nn

from lightning_accel.pipeline.build_replay import BuildReplay
from lightning_accel.pipeline.deferred_init import covers, materialize, materialize_from


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.blocks = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8))
        self.register_buffer("table", torch.randn(3), persistent=False)  # not in a state_dict, drawn all the same


class Lazy(nn.Module):
    """Builds its network in ``configure_model``, once (Lightning calls the hook again for every run)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(2, 2)  # built before the hook: kept as it is
        self.net: Net | None = None
        self.calls = 0

    def configure_model(self) -> None:
        self.calls += 1
        if self.net is None:
            self.net = Net().double()


def _values(module: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(module.named_parameters()), **dict(module.named_buffers())}


def test_the_build_run_again_from_its_starting_random_state_equals_a_plain_build():
    torch.manual_seed(3)
    plain = Lazy()
    plain.configure_model()
    torch.manual_seed(3)
    lazy = Lazy()
    replay = BuildReplay(lazy, "configure_model")
    with torch.device("meta"):
        lazy.configure_model()
    after = torch.get_rng_state()
    values = replay.values(nullcontext)
    assert torch.equal(torch.get_rng_state(), after)  # the generators are left as they were
    assert lazy.net is not None and lazy.net.inp.weight.is_meta and lazy.calls == 1  # the module itself is untouched
    assert set(values) == set(_values(plain)) and covers(lazy, values)
    for name, value in _values(plain).items():
        assert torch.equal(values[name], value), name
    assert values["head.weight"] is lazy.head.weight  # what existed before the hook is the module's own


def test_materialize_from_places_the_kept_tensors_values_and_leaves_the_rest_on_meta():
    torch.manual_seed(0)
    plain = Lazy()
    plain.configure_model()
    lazy = Lazy()
    with torch.device("meta"):
        lazy.configure_model()
    kept = {id(t) for n, t in _values(lazy).items() if not n.startswith("net.blocks.")}
    assert materialize_from(lazy, _values(plain), keep=lambda t: id(t) in kept) == 3  # inp's weight and bias, the table
    for name, value in _values(lazy).items():
        if name.startswith("net.blocks."):
            assert value.is_meta, name
        elif name.startswith("net."):
            assert torch.equal(value, _values(plain)[name]) and not value.is_meta, name
    assert isinstance(lazy.net.inp.weight, nn.Parameter) and lazy.net.inp.weight.requires_grad


def test_values_of_another_network_do_not_cover_it_another_dtype_does():
    lazy = Lazy()
    with torch.device("meta"):
        lazy.configure_model()
    other = Lazy()
    other.net = Net()  # float32, not float64: covered (converted as it is copied), the same shapes
    assert covers(lazy, _values(other))
    other.net.blocks[0] = nn.Linear(8, 9)
    assert not covers(lazy, _values(other))
    assert not covers(lazy, {})
    assert covers(Lazy(), {})  # nothing on meta: nothing to cover
    with pytest.raises(ValueError, match=r"cannot initialize 'net' \(Net\) .* no reset_parameters\(\) for \['table'\]"):
        materialize(lazy, 0)  # the per-module scheme cannot draw the table again; the user's build run again can
