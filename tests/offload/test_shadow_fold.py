"""The host step writing the low-precision shadows in its own pass: bit for bit what torch's fused
kernel followed by a cast gives (masters, shadows, optimizer state), or that path itself."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from lightning_accel.offload import fused_names, shadow_fold, shadow_kernel
from lightning_accel.offload.host_step import host_update
from lightning_accel.offload.partition import partition_units
from lightning_accel.offload.shadow_fold import ShadowFold, fold_report

Make = Callable[[list[nn.Parameter]], torch.optim.Optimizer]

# shapes folded (at least FOLD_MIN_NUMEL = 256 x 256 elements; 300 x 257 with a remainder past the last
# multiple of 64), a small matrix folded only by the C kernel (a whole number of 64-element units), one
# that takes torch's kernel and a cast (a remainder, too small to pay a call of its own), a vector (no shadow)
_SHAPES = [(300, 257), (256, 256), (2, 64), (5,), (3, 200)]


def _twins(dtype: torch.dtype) -> tuple[list[nn.Parameter], list[nn.Parameter], dict[Tensor, Tensor], dict[Tensor, Tensor]]:
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(s)) for s in _SHAPES]
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    return (params, twins, {p: p.detach().to(dtype) for p in params if p.ndim >= 2},
            {p: p.detach().to(dtype) for p in twins if p.ndim >= 2})


def _assert_bit_equal(params: list[Tensor], twins: list[Tensor], shadows: dict[Tensor, Tensor], ref_shadows: dict[Tensor, Tensor],
                      opt: torch.optim.Optimizer, ref: torch.optim.Optimizer) -> None:
    """Each parameter, its shadow and its optimizer state equal its twin's, bit for bit."""
    for p, t in zip(params, twins):
        assert torch.equal(p, t)
        if p in shadows:
            assert torch.equal(shadows[p], ref_shadows[t])
        for key, value in ref.state[t].items():
            assert torch.equal(opt.state[p][key], value), key


def _step_both(make: Make, dtype: torch.dtype, steps: int = 3, low: torch.dtype | None = None) -> tuple[list[list[Tensor]], dict[Tensor, Tensor]]:
    """``steps`` updates in the fold and, on twins, by torch's fused kernel then a cast; asserts every bit
    agrees and every shadow was written; returns what the fold wrote and its shadows. ``low``: the
    gradients are the widening of tensors of that dtype, which the fold is given too."""
    params, twins, shadows, ref_shadows = _twins(dtype)
    opt, ref = make(params), make(twins)
    written = []
    for _ in range(steps):
        low_grads = {}
        for p, t in zip(params, twins):
            p.grad = torch.randn_like(p)
            if low is not None:
                p.grad[(0,) * p.ndim] = 1e-40  # a denormal
                low_grads[p] = p.grad.to(low)
                p.grad = low_grads[p].float()
            t.grad = p.grad.clone()
        with ShadowFold(shadows, low_grads) as fold:
            opt.step()
        written.append(fold.written)
        ref.step()
        for t, ref_shadow in ref_shadows.items():
            ref_shadow.copy_(t)
        _assert_bit_equal(params, twins, shadows, ref_shadows, opt, ref)
    return written, shadows


def _folded(kind: str) -> None:
    """The one-pass update was used for ``kind`` (reading fp32 gradients): the C kernel where it builds
    here, else the compiled update (skips where this machine can build neither)."""
    report = {k: v for k, v in fold_report().items() if k.startswith(kind + ",") and not k.endswith("grad=bfloat16")}
    if any(v.startswith("torch.compile failed") for v in report.values()):
        pytest.skip(f"neither the C kernel nor torch.compile can build kernels here: {report}")
    expected = "folded (C kernel)" if shadow_kernel.kernel() is not None else "folded (torch.compile; C kernel not built"
    assert report and all(v.startswith(expected) for v in report.values()), report


@pytest.mark.parametrize("c_kernel", [True, False], ids=["C-kernel", "torch.compile"])
@pytest.mark.parametrize(("make", "kind", "dtype"), [
    (functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3, fused=True), "sgd", torch.bfloat16),
    (functools.partial(torch.optim.Adam, lr=3e-3, weight_decay=0.01, fused=True), "adam", torch.float16),
    (functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.1, fused=True), "adamw", torch.bfloat16),
    (functools.partial(torch.optim.Adagrad, lr=0.05, lr_decay=0.01, weight_decay=0.01, fused=True), "adagrad", torch.bfloat16),
], ids=["SGD-nesterov", "Adam-fp16", "AdamW", "Adagrad"])
def test_one_pass_equals_the_fused_kernel_then_a_cast(make: Make, kind: str, dtype: torch.dtype, c_kernel: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # the C kernel where it builds, and the compiled update that stands in where it does not
    monkeypatch.setattr(shadow_fold, "_FOLDS", shadow_fold._Folds())
    if not c_kernel:
        monkeypatch.setattr(shadow_kernel, "kernel", lambda: None)
    written, shadows = _step_both(make, dtype)
    assert all(set(w) == set(shadows) for w in written)
    _folded(kind)


@pytest.mark.parametrize("c_kernel", [True, False], ids=["C-kernel", "torch.compile"])
@pytest.mark.parametrize(("make", "kind"), [
    (functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.1, fused=True), "adamw"),
    (functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, weight_decay=1e-3, fused=True), "sgd"),
    (functools.partial(torch.optim.Adagrad, lr=0.05, fused=True), "adagrad"),
], ids=["AdamW", "SGD", "Adagrad"])
def test_given_the_bf16_gradients_the_fold_is_still_the_fused_kernel_then_a_cast(make: Make, kind: str, c_kernel: bool,
                                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    # the C kernel reads them (its own check on a probe, reported apart); the compiled update reads the fp32 ones
    monkeypatch.setattr(shadow_fold, "_FOLDS", shadow_fold._Folds())
    if not c_kernel:
        monkeypatch.setattr(shadow_kernel, "kernel", lambda: None)
    written, shadows = _step_both(make, torch.bfloat16, low=torch.bfloat16)
    assert all(set(w) == set(shadows) for w in written)
    read_low = {k: v for k, v in fold_report().items() if k.endswith("grad=bfloat16")}
    if c_kernel and shadow_kernel.kernel() is not None:
        assert read_low and set(read_low.values()) == {"folded (C kernel)"}, read_low
    else:
        _folded(kind)
        assert read_low and not any(v.startswith("folded") for v in read_low.values()), read_low


def test_the_c_kernel_reads_the_bf16_gradient_it_is_given() -> None:
    # not the widening of the fp32 gradient (a caller's broken promise): the step is the bf16 one's, so it was read
    if shadow_kernel.kernel() is None:
        pytest.skip(f"no C kernel here: {shadow_kernel.why_not()}")
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(256, 256))
    twin = nn.Parameter(p.detach().clone())
    low = torch.randn(256, 256).to(torch.bfloat16)
    p.grad, twin.grad = torch.randn(256, 256), low.float()
    shadow = torch.empty(256, 256, dtype=torch.bfloat16)
    opt, ref = torch.optim.AdamW([p], lr=3e-3, fused=True), torch.optim.AdamW([twin], lr=3e-3, fused=True)
    with ShadowFold({p: shadow}, {p: low}):
        opt.step()
    ref.step()
    assert torch.equal(p, twin) and torch.equal(shadow, twin.detach().to(torch.bfloat16))
    # one of another shape, dtype or layout is not read
    for wrong in (low[:128], low.float(), low.t()):
        q = nn.Parameter(torch.randn(256, 256))
        q.grad = torch.randn(256, 256)
        q_twin = nn.Parameter(q.detach().clone())
        q_twin.grad = q.grad.clone()
        opt, ref = torch.optim.AdamW([q], lr=3e-3, fused=True), torch.optim.AdamW([q_twin], lr=3e-3, fused=True)
        with ShadowFold({q: torch.empty(256, 256, dtype=torch.bfloat16)}, {q: wrong}):
            opt.step()
        ref.step()
        assert torch.equal(q, q_twin)


def test_what_the_fold_does_not_cover_goes_through_torchs_kernel_and_a_cast() -> None:
    # amsgrad has no compiled update: the kernel, then the cast, for every shadow all the same
    written, shadows = _step_both(functools.partial(torch.optim.Adam, lr=3e-3, amsgrad=True, fused=True), torch.bfloat16, steps=2)
    assert all(set(w) == set(shadows) for w in written)
    assert not any(k.startswith("adam,") and "amsgrad" in k for k in fold_report())


def _no_update(update: object, **options: object) -> Callable[..., object]:
    return lambda stepped, shadow, sc, **flags: shadow.copy_(stepped[0])  # casts, updates nothing


def _no_compiler(update: object, **options: object) -> Callable[..., object]:
    raise RuntimeError("no C++ compiler")


@pytest.mark.parametrize(("compiled", "says"), [
    (_no_update, "the compiled adamw update differs from torch"),
    (_no_compiler, "torch.compile failed here (RuntimeError: no C++ compiler)"),
], ids=["differs", "cannot-compile"])
def test_a_fold_that_is_not_torchs_kernel_bit_for_bit_is_not_used(compiled: Callable[..., object], says: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shadow_fold, "_FOLDS", shadow_fold._Folds())
    monkeypatch.setattr(shadow_kernel, "kernel", lambda: None)  # no C kernel either
    monkeypatch.setattr(torch, "compile", compiled)
    _step_both(functools.partial(torch.optim.AdamW, lr=3e-3, fused=True), torch.bfloat16, steps=2)
    (why,) = fold_report().values()
    assert why.startswith(says) and why.endswith("two passes")


def test_partitioned_owners_write_the_shadows_of_the_units_they_step() -> None:
    # l2l_offload_ddp's partitioned step on two simulated ranks: each steps the units it owns (only
    # those have gradients), the masters go from owner to the other rank, which re-derives its shadows.
    # Every rank ends with what the two-pass path gives, and the fold wrote exactly the owners' shadows.
    torch.manual_seed(0)
    units = [[torch.randn(256, 260), torch.randn(256)] for _ in range(4)]
    grads = [[torch.randn_like(t) for t in unit] for unit in units]
    owners = partition_units([sum(t.numel() for t in u) for u in units], 2).owners
    make = functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.1)

    def rank(r: int, fold: bool) -> tuple[list[list[nn.Parameter]], dict[Tensor, Tensor], torch.optim.Optimizer, list[Tensor]]:
        params = [[nn.Parameter(t.clone()) for t in unit] for unit in units]
        shadows = {p: p.detach().to(torch.bfloat16) for unit in params for p in unit if p.ndim >= 2}
        opt = make([p for unit in params for p in unit], fused=None if fold else True)
        for i, unit in enumerate(params):
            for p, g in zip(unit, grads[i]):
                p.grad = g.clone() if owners[i] == r else None
        written: list[Tensor] = []
        if fold:
            with host_update(opt, True, lambda: shadows, written.extend):
                opt.step()
        else:
            opt.step()
        return params, shadows, opt, written

    for fold in (True, False):
        ranks = [rank(r, fold) for r in (0, 1)]
        for i in range(len(units)):  # the broadcast from each unit's owner, the receivers' shadow refresh
            for r, (params, shadows, _, _) in enumerate(ranks):
                for p, q in zip(params[i], ranks[owners[i]][0][i]):
                    p.data.copy_(q.data)
                    if p in shadows and (r != owners[i] or not fold):
                        shadows[p].copy_(p)
        if fold:
            folded = ranks
        else:
            plain = ranks
    for r in (0, 1):
        params, shadows, opt, written = folded[r]
        ref_params, ref_shadows, ref_opt, _ = plain[r]
        assert {id(p) for p in written} == {id(p) for i, u in enumerate(params) if owners[i] == r for p in u if p.ndim >= 2}
        for unit, ref_unit in zip(params, ref_params):
            _assert_bit_equal(unit, ref_unit, shadows, ref_shadows, opt, ref_opt)
    _folded("adamw")


def _adamw_and_shadows() -> tuple[torch.optim.Optimizer, list[nn.Parameter], dict[Tensor, Tensor]]:
    params = [nn.Parameter(torch.randn(256, 256))]
    params[0].grad = torch.randn_like(params[0])
    return torch.optim.AdamW(params, lr=3e-3, fused=True), params, {params[0]: params[0].detach().to(torch.bfloat16)}


def test_the_fold_stands_in_for_the_kernel_names_only_while_open_and_puts_them_back() -> None:
    # only the kernel call is intercepted: no torch function mode dispatches the step's other torch calls
    names = ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_")
    before = {name: getattr(torch, name) for name in names}
    opt, params, shadows = _adamw_and_shadows()
    modes: list[int] = []
    with ShadowFold(shadows) as outer:
        assert all(getattr(torch, name) is not before[name] for name in names)
        with ShadowFold({}):  # the innermost fold writes: this one has no shadows, so none are written
            opt.step()
        modes.append(torch._C._len_torch_function_stack())
        opt.step()
    assert modes == [0] and outer.written == params
    assert {name: getattr(torch, name) for name in names} == before
    with pytest.raises(RuntimeError, match="boom"), ShadowFold(shadows):
        raise RuntimeError("boom")
    assert {name: getattr(torch, name) for name in names} == before


def test_a_fold_is_its_own_threads_only() -> None:
    # a host-step thread folds its own step while the main thread steps on torch's kernel, and back
    opt, params, shadows = _adamw_and_shadows()
    other, other_params, other_shadows = _adamw_and_shadows()
    stale = other_shadows[other_params[0]].clone()
    inside, go_on = threading.Event(), threading.Event()
    folds: list[ShadowFold] = []

    def host_step() -> None:
        with ShadowFold(shadows) as fold:
            folds.append(fold)
            inside.set()
            go_on.wait(10)
            opt.step()

    worker = threading.Thread(target=host_step)
    worker.start()
    assert inside.wait(10)
    other.step()  # no fold on this thread: torch's kernel, no shadow written
    go_on.set()
    worker.join(10)
    assert torch.equal(other_shadows[other_params[0]], stale)
    assert folds[0].written == params and torch.equal(shadows[params[0]], params[0].detach().to(torch.bfloat16))
    assert torch._fused_adamw_ is fused_names.REAL["adamw"]
