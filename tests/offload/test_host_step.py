"""The host step mechanism: which kernel, which groups, one update writing the shadows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_accel.offload.host_step import choose_host_kernel, host_update, step_params, update_groups


@pytest.mark.parametrize(("make", "fused", "says"), [
    (lambda p: torch.optim.AdamW(p), True, "AdamW: host parameters step on torch's fused CPU kernel"),
    (lambda p: torch.optim.SGD(p, lr=0.1, fused=False), False, "SGD(fused=False) as configured"),
    (lambda p: torch.optim.Adam(p, foreach=True), False, "Adam(foreach=True) as configured"),
    (lambda p: torch.optim.Adagrad(p, fused=True), False, "Adagrad(fused=True) as configured"),
    (lambda p: torch.optim.RMSprop(p), False, "RMSprop has no fused CPU kernel"),
    (lambda p: type("MyAdam", (torch.optim.Adam,), {})(p), False, "MyAdam has no fused CPU kernel"),
], ids=["AdamW", "SGD-fused-False", "Adam-foreach", "Adagrad-fused", "RMSprop", "Adam-subclass"])
def test_choose_host_kernel(make, fused: bool, says: str) -> None:  # type: ignore[no-untyped-def]
    kernel = choose_host_kernel(make([nn.Parameter(torch.zeros(2))]))
    assert kernel.fused is fused
    assert kernel.why.startswith(says)


def test_update_groups_split_off_the_host_parameters_and_leave_the_users_alone() -> None:
    host, other, sparse = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2, device="meta")), nn.Parameter(torch.zeros(3))
    sparse.grad = torch.zeros(3).to_sparse()
    opt = torch.optim.SGD([{"params": [host, other, sparse]}, {"params": [nn.Parameter(torch.zeros(1))], "lr": 0.5}], lr=0.1)
    groups = update_groups(opt, [host, other, sparse], fuse=True)
    assert [(g["params"], g["fused"], g["lr"]) for g in groups] == [([host], True, 0.1), ([other, sparse], None, 0.1)]
    assert opt.param_groups[0]["fused"] is None and len(opt.param_groups[0]["params"]) == 3  # untouched
    assert [g["fused"] for g in update_groups(opt, None, fuse=False)] == [None, None]


def test_sgd_momentum_with_a_parameter_that_has_no_buffer_yet() -> None:
    # torch's own fused SGD fails on a list where some momentum buffers exist and others not
    # (a parameter first getting a gradient mid-training); the update splits by "has state".
    a, b = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))
    ref_a, ref_b = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([a, b], lr=0.1, momentum=0.9)
    ref = torch.optim.SGD([ref_a, ref_b], lr=0.1, momentum=0.9, foreach=False)
    for step in range(3):
        for p in (a, ref_a) if step == 0 else (a, b, ref_a, ref_b):
            p.grad = torch.full((4,), 1.0 + step)
        step_params(opt, [a, b], fuse=True)
        ref.step()
    torch.testing.assert_close(a, ref_a, rtol=0, atol=1e-7)
    torch.testing.assert_close(b, ref_b, rtol=0, atol=1e-7)


def test_host_update_steps_everything_in_one_call_and_says_which_shadows_it_wrote(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(8, 16)) for _ in range(3)] + [nn.Parameter(torch.randn(8))]
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    for p, t in zip(params, twins):
        p.grad = t.grad = torch.randn_like(p)
    params[2].grad = twins[2].grad = None  # no gradient: not stepped, its shadow not written
    # (amsgrad: torch's kernel then the cast, tests/offload/test_shadow_fold.py has the one-pass updates)
    opt, ref = torch.optim.Adam(params, lr=0.1, amsgrad=True), torch.optim.Adam(twins, lr=0.1, amsgrad=True, fused=True)
    shadows = {p: p.detach().to(torch.bfloat16) for p in params[:3]}
    stale = shadows[params[2]].clone()
    sizes: list[int] = []
    real = torch._fused_adam_
    monkeypatch.setattr(torch, "_fused_adam_", lambda ps, *a, **k: (sizes.append(len(ps)), real(ps, *a, **k))[1])
    closure_ran: list[bool] = []
    written: list[list[torch.Tensor]] = []
    with host_update(opt, True, lambda: shadows, written.append):
        opt.step(lambda: closure_ran.append(torch.is_grad_enabled()))
    assert "step" not in vars(opt)  # the instance is as it was
    assert closure_ran == [True]
    assert sizes == [3]  # one kernel call for every stepped parameter
    assert [set(w) for w in written] == [{params[0], params[1]}]
    ref.step()
    for p, t in zip(params, twins):
        torch.testing.assert_close(p, t, rtol=0, atol=0)
    for p in params[:2]:
        assert torch.equal(shadows[p], p.detach().to(torch.bfloat16))
    assert torch.equal(shadows[params[2]], stale)
