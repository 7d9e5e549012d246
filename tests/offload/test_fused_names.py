"""The fused kernels' names hand their calls to this thread's innermost open interceptor, and only while one is open."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from lightning_accel.offload import fused_names


class Counting:
    """Takes every call of one kind (and does nothing with it), or declines them all."""

    def __init__(self, take: bool) -> None:
        self.take = take
        self.calls: list[str] = []

    def intercept(self, kind: str, kernel: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> bool:
        assert kernel is fused_names.REAL[kind]  # torch's own kernel, whatever stands on the name
        self.calls.append(kind)
        return self.take


def _sgd() -> tuple[torch.optim.Optimizer, nn.Parameter]:
    p = nn.Parameter(torch.ones(8))
    p.grad = torch.ones(8)
    return torch.optim.SGD([p], lr=0.5, fused=True), p


def test_the_innermost_interceptor_gets_the_call_and_the_names_come_back() -> None:
    names = {name: getattr(torch, name) for name in fused_names.NAMES.values()}
    opt, p = _sgd()
    outer, inner = Counting(take=True), Counting(take=False)
    fused_names.push(outer)
    fused_names.push(inner)
    try:
        opt.step()  # the inner one declines: torch's kernel runs
        assert inner.calls == ["sgd"] and outer.calls == [] and torch.equal(p.detach(), torch.full((8,), 0.5))
        fused_names.pop(inner)
        opt.step()  # the outer one takes it: nothing moves
        assert outer.calls == ["sgd"] and torch.equal(p.detach(), torch.full((8,), 0.5))
    finally:
        fused_names.pop(outer)
    assert {name: getattr(torch, name) for name in fused_names.NAMES.values()} == names
    opt.step()  # none open: torch's kernel, nobody asked
    assert outer.calls == ["sgd"] and torch.equal(p.detach(), torch.zeros(8))


def test_a_wrapper_already_on_a_name_still_runs_and_its_kernel_call_is_offered(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []
    real = torch._fused_sgd_

    def counting(*args: Any, **kwargs: Any) -> Any:
        seen.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "_fused_sgd_", counting)
    opt, p = _sgd()
    taker = Counting(take=True)
    fused_names.push(taker)
    try:
        opt.step()
    finally:
        fused_names.pop(taker)
    assert seen == [1] and taker.calls == ["sgd"] and torch.equal(p.detach(), torch.ones(8))
    assert torch._fused_sgd_ is counting
