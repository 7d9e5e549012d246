"""Element ranges of parameters stepped as parameters of their own (the NVMe tier's chunks) equal the whole step bit for
bit: every per-parameter optimizer the tier takes, torch's fused kernel and its own loops, the shadow written in the same
pass, a first step that makes the state, the scalars (``step``) counted once."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from lightning_accel.offload.host_optimizer import PER_PARAMETER
from lightning_accel.offload.host_step import FUSED_CPU, step_params
from lightning_accel.offload.slice_step import Slice, SlicedStep
from lightning_accel.offload.state_keys import per_element_state
from lightning_accel.offload.tier_chunks import GRAIN

HYPER = {torch.optim.SGD: {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01}, torch.optim.Adam: {"lr": 1e-2, "amsgrad": True},
         torch.optim.AdamW: {"lr": 1e-2, "weight_decay": 0.1}, torch.optim.RMSprop: {"lr": 1e-2, "momentum": 0.5, "centered": True},
         torch.optim.Adagrad: {"lr": 1e-2}, torch.optim.Adamax: {"lr": 1e-2}, torch.optim.NAdam: {"lr": 1e-2},
         torch.optim.RAdam: {"lr": 1e-2}, torch.optim.Adadelta: {"lr": 0.5}}
SHAPES = [(3 * GRAIN + 37,), (20, 1000), (77,)]  # a vector with a remainder, a matrix cut mid-row, a small vector


def _params() -> list[nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [nn.Parameter(torch.randn(shape, generator=g)) for shape in SHAPES]


def _grads(params: list[nn.Parameter], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _ranges(numel: int, grain: int) -> list[tuple[int, int]]:
    return [(start, min(start + grain, numel)) for start in range(0, numel, grain)]


# torch's fused CPU kernels (and the shadow fold over them), each with and without; the other rules on torch's own loops
CASES = [(cls, fuse, shadowed) for cls in PER_PARAMETER for fuse in ((True, False) if cls in FUSED_CPU else (False,))
         for shadowed in ((False, True) if cls in FUSED_CPU else (False,))]


@pytest.mark.parametrize(("cls", "fuse", "shadowed"), CASES,
                         ids=[f"{c.__name__}-{'fused' if f else 'torch'}{'-bf16' if s else ''}" for c, f, s in CASES])
def test_ranges_stepped_apart_equal_the_whole_step(cls: type[torch.optim.Optimizer], fuse: bool, shadowed: bool) -> None:
    whole, sliced = _params(), _params()
    ref, opt = cls(whole, **HYPER[cls]), cls(sliced, **HYPER[cls])
    # the per-element state as the tier keeps it (its file's regions): whole tensors, each range stepped in a view of it
    keys = per_element_state(opt, sliced, {p: p.dtype for p in sliced})
    files = {(p, k): torch.zeros(p.shape, dtype=d) for p in sliced for k, d in keys[p]}
    low = {p: p.detach().to(torch.bfloat16) for p in whole} if shadowed else {}
    shadows = {p: p.detach().to(torch.bfloat16) for p in sliced} if shadowed else {}
    step = functools.partial(step_params, opt, fuse=fuse)
    for n in range(3):
        _grads(whole, n)
        written = set(step_params(ref, whole, low, fuse=fuse))
        for p in whole:  # the in-memory run's refresh of the shadows the fold did not write
            if shadowed and p not in written:
                low[p].copy_(p.detach())
        _grads(sliced, n)
        stepping = SlicedStep(opt, step)
        # chunks of two grains (a chunk may hold ranges of several parameters: the last range of one, the next's first)
        pieces = [(p, a, b) for p in sliced for a, b in _ranges(p.numel(), 2 * GRAIN)]
        for first in range(0, len(pieces), 2):
            stepping.run([Slice(p, a, b, p.data.view(-1)[a:b], {k: files[(p, k)].view(-1)[a:b] for k, _ in keys[p]},
                                shadows[p].view(-1)[a:b] if shadowed else None) for p, a, b in pieces[first:first + 2]], {})
        stepping.finish(lambda p, k: files[(p, k)])
    for a, b in zip(whole, sliced):
        assert torch.equal(a, b)
        assert ref.state[a].keys() == opt.state[b].keys()
        for key, value in ref.state[a].items():
            assert torch.equal(value, opt.state[b][key]), key
        if shadowed:
            assert torch.equal(low[a], shadows[b])
    assert not any(isinstance(p, nn.Parameter) and all(p is not q for q in sliced) for p in opt.state)  # no slice left behind


def test_a_parameter_without_state_keeps_none() -> None:
    # SGD without momentum makes no state: a stepped parameter gets no entry, as under torch
    params = _params()
    opt = torch.optim.SGD(params, lr=0.1)
    _grads(params, 0)
    stepping = SlicedStep(opt, functools.partial(step_params, opt, fuse=True))
    stepping.run([Slice(p, 0, p.numel(), p.data.view(-1), {}) for p in params], {})
    stepping.finish(lambda p, k: torch.empty(0))
    assert len(opt.state) == 0
