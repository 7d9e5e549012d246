"""The C kernel of the shadow fold: torch's fused CPU update and the shadow cast, bit for bit, in one
pass; built once per machine (cached), and the fold's compiled update where it cannot be built."""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

from lightning_accel.offload import shadow_fold, shadow_kernel
from lightning_accel.offload.shadow_fold import ShadowFold, fold_report

_FUSED = {"adam": torch._fused_adam_, "adamw": torch._fused_adamw_, "sgd": torch._fused_sgd_, "adagrad": torch._fused_adagrad_}
_N_STATE = {"adam": 2, "adamw": 2, "sgd": 1, "adagrad": 1}
_ADAM = dict(lr=3e-3, beta1=0.9, beta2=0.999, weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False)
_SGD = dict(lr=0.05, momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.0, maximize=False, is_first_step=False)
_ADAGRAD = dict(lr=0.05, lr_decay=0.0, weight_decay=0.0, eps=1e-10, maximize=False)

# every flag the kernel has, each optimizer: (kind, hyper-parameters of torch's kernel)
CASES = [
    ("adamw", {**_ADAM, "weight_decay": 0.1}),
    ("adamw", {**_ADAM, "maximize": True}),
    ("adamw", {**_ADAM, "weight_decay": 0.1, "maximize": True}),
    ("adam", {**_ADAM, "weight_decay": 0.01, "maximize": True}),
    ("adam", {**_ADAM, "beta1": 0.3}),  # 1 - beta1 >= 0.5: lerp's other form
    ("sgd", {**_SGD, "nesterov": True, "weight_decay": 1e-3}),
    ("sgd", {**_SGD, "dampening": 0.1, "maximize": True}),
    ("sgd", {**_SGD, "momentum": 0.0, "weight_decay": 1e-3}),
    ("sgd", {**_SGD, "nesterov": True, "weight_decay": 1e-3, "maximize": True}),
    ("adagrad", {**_ADAGRAD, "lr_decay": 0.01, "weight_decay": 0.01}),
    ("adagrad", {**_ADAGRAD, "maximize": True}),
    ("adagrad", {**_ADAGRAD, "weight_decay": 0.01, "maximize": True}),
]
_IDS = [f"{k}-" + "-".join(f"{n}={v}" for n, v in kw.items() if v != {"adam": _ADAM, "adamw": _ADAM, "sgd": _SGD,
        "adagrad": _ADAGRAD}[k][n]) for k, kw in CASES]


@pytest.fixture(scope="module")
def native() -> Callable[..., None]:
    kernel = shadow_kernel.kernel()
    if kernel is None:
        pytest.skip(f"no C kernel here: {shadow_kernel.why_not()}")
    return kernel


def _bits(t: Tensor) -> Tensor:
    return t.view({4: torch.int32, 2: torch.int16}[t.element_size()])


def _tensors(kind: str, kw: dict[str, object], n: int) -> list[Tensor]:
    gen = torch.Generator().manual_seed(n)
    n_state = _N_STATE[kind] if kind != "sgd" or kw["momentum"] else 0
    out = [torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2]
    out[0][:7] = torch.tensor([math.nan, math.inf, -math.inf, 3.4e38, 1e-40, -1e-39, -0.0])[: min(n, 7)]
    # a NaN and a huge gradient; no NaN under maximize, where torch's kernel gives its NaNs one sign on one thread,
    # the other on two (its build folds -grad differently into the two loops)
    out[1][7:9] = torch.tensor([1.0 if kw.get("maximize") else math.nan, 1e30])[: max(0, min(n, 9) - 7)]
    return out + [torch.rand(n, generator=gen) * 1e-3 for _ in range(n_state)]


def _torch_step(kind: str, kw: dict[str, object], tensors: list[Tensor], step: float) -> None:
    args: list[list[Tensor]] = [[t] for t in tensors]
    if kind in ("adam", "adamw") or len(tensors) == 2:
        args.append([])
    if kind != "sgd":
        args.append([torch.tensor(step)])
    _FUSED[kind](*args, **kw)


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(("kind", "kw"), CASES, ids=_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("grad", [torch.float32, torch.bfloat16], ids=["fp32-grad", "bf16-grad"])
def test_the_kernel_is_torchs_fused_step_then_a_cast(native: Callable[..., None], kind: str, kw: dict[str, object],
                                                     dtype: torch.dtype, grad: torch.dtype) -> None:
    # 24, 64, 17 x 64 + 8 and 17 x 64 + 24 elements (the kernel steps 16 at a time, then 8), NaN/inf/
    # denormal masters and gradients, two steps; torch's kernel on one thread, where its vector loop covers any
    # multiple of 8. A bf16 gradient: torch's kernel steps its fp32 widening (a denormal among them)
    for n in (24, 64, 17 * 64 + 8, 17 * 64 + 24):
        ours = _tensors(kind, kw, n)
        if grad != torch.float32:
            ours[1][10:11] = 1e-40
            ours[1] = ours[1].to(grad).float()
        ref = [t.clone() for t in ours]
        read = ours if grad == torch.float32 else [ours[0], ours[1].to(grad), *ours[2:]]
        shadow = torch.empty(n, dtype=dtype)
        for step in (1.0, 2.0):
            with _one_thread():
                _torch_step(kind, kw, ref, step)
            _, sc, flags = shadow_fold._plan(kind, kw, step)
            native(kind, flags, sc, read, shadow)
            for a, b in zip(ours, ref):
                assert torch.equal(_bits(a), _bits(b)), (n, step)
            assert torch.equal(_bits(shadow), _bits(ref[0].to(dtype))), (n, step)


def test_two_threads_and_an_unaligned_shadow_change_no_bit(native: Callable[..., None]) -> None:
    # 2**16 + 3 x 64 elements: past the kernel's serial threshold, split between two threads at a
    # 64-element boundary; the shadow a view one element into its buffer (ordinary, not streaming, stores)
    kind, kw, n = "adamw", {**_ADAM, "weight_decay": 0.1}, 2**16 + 192
    ours = _tensors(kind, kw, n)
    ref = [t.clone() for t in ours]
    buffer = torch.empty(n + 1, dtype=torch.bfloat16)
    _torch_step(kind, kw, ref, 1.0)
    _, sc, flags = shadow_fold._plan(kind, kw, 1.0)
    native(kind, flags, sc, ours, buffer[1:], threads=2)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(ours, ref))
    assert torch.equal(_bits(buffer[1:]), _bits(ref[0].to(torch.bfloat16)))


def test_the_kernel_refuses_a_length_it_cannot_step(native: Callable[..., None]) -> None:
    t = [torch.zeros(12) for _ in range(4)]
    _, sc, flags = shadow_fold._plan("adamw", _ADAM, 1.0)
    with pytest.raises(ValueError, match=r"la_step refused adamw over 12 elements \(a multiple of 8 is needed\)"):
        native("adamw", flags, sc, t, torch.empty(12, dtype=torch.bfloat16))


def test_numel_steps_only_the_leading_elements_of_a_tensor_of_any_shape(native: Callable[..., None]) -> None:
    # the fold passes each parameter's own tensors (no flattened slices) and the length its kernel covers
    kind, kw = "adamw", {**_ADAM, "weight_decay": 0.1}
    ours = [t.view(3, 64) for t in _tensors(kind, kw, 192)]
    ref = [t.clone() for t in ours]
    _torch_step(kind, kw, [t.view(-1)[:128] for t in ref], 1.0)
    shadow = torch.zeros(3, 64, dtype=torch.bfloat16)
    _, sc, flags = shadow_fold._plan(kind, kw, 1.0)
    native(kind, flags, sc, ours, shadow, numel=128)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(ours, ref))  # the last 64 untouched
    assert torch.equal(_bits(shadow[:2]), _bits(ref[0][:2].to(torch.bfloat16))) and not shadow[2].any()
    with pytest.raises(ValueError, match="numel=256 is outside the tensors' 192 elements"):
        native(kind, flags, sc, ours, shadow, numel=256)


# odd sizes through the fold: 65 and 3 x 64 + 7 (a remainder: torch's kernel and a cast), 2 x 64 and 1088
# (the C kernel alone), 300 x 257 (the C kernel, then torch's kernel over the last 28 elements)
_ODD = [(65,), (199,), (2, 64), (1088,), (300, 257)]


@pytest.mark.parametrize("make", [
    functools.partial(torch.optim.AdamW, lr=3e-3, weight_decay=0.1, maximize=True),
    functools.partial(torch.optim.Adam, lr=3e-3, weight_decay=0.01, betas=(0.3, 0.99)),
    functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3),
    functools.partial(torch.optim.Adagrad, lr=0.05, lr_decay=0.01, weight_decay=0.01, maximize=True),
], ids=["AdamW", "Adam", "SGD", "Adagrad"])
def test_the_fold_on_the_kernel_equals_two_passes_at_odd_sizes(native: Callable[..., None],
                                                               make: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shadow_fold, "_FOLDS", shadow_fold._Folds())
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(s)) for s in _ODD]
    twins = [nn.Parameter(p.detach().clone()) for p in params]
    shadows = {p: p.detach().to(torch.bfloat16) for p in params}
    ref_shadows = {p: p.detach().to(torch.bfloat16) for p in twins}
    opt, ref = make(params, fused=True), make(twins, fused=True)
    for _ in range(3):  # SGD's first step creates its buffers (two passes), the next two fold
        for p, t in zip(params, twins):
            p.grad = torch.randn_like(p)
            t.grad = p.grad.clone()
        with ShadowFold(shadows) as fold:
            opt.step()
        ref.step()
        assert set(fold.written) == set(shadows)
        for p, t in zip(params, twins):
            assert torch.equal(p, t) and torch.equal(_bits(shadows[p]), _bits(t.detach().to(torch.bfloat16)))
            assert all(torch.equal(v, ref.state[t][k]) for k, v in opt.state[p].items())
    assert list(fold_report().values()) == ["folded (C kernel)"], fold_report()


def test_the_build_is_cached_per_source_and_compiler(tmp_path: Path) -> None:
    first = shadow_kernel.build(directory=tmp_path)
    stamp = first.stat().st_mtime_ns
    assert shadow_kernel.build(directory=tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary file left behind


def test_without_a_compiler_the_fold_says_so_once_and_keeps_torch_compile(monkeypatch: pytest.MonkeyPatch,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CC", "no-such-cc")
    monkeypatch.setattr(shadow_kernel, "_loaded", None)
    monkeypatch.setattr(shadow_kernel, "_why_not", None)
    monkeypatch.setattr(shadow_fold, "_FOLDS", shadow_fold._Folds())
    with caplog.at_level(logging.WARNING, logger=shadow_kernel.__name__):
        assert shadow_kernel.kernel() is None and shadow_kernel.kernel() is None
    (record,) = caplog.records
    assert record.getMessage() == ("lightning_accel: the C shadow kernel is not used (no C compiler found (no-such-cc not "
                                   "on PATH)); the host step folds the bf16/fp16 shadow writes with torch.compile instead")
    # the compiled update folds, bit for bit (the fold's own tests: tests/offload/test_shadow_fold.py)
    param, twin = nn.Parameter(torch.randn(256, 256)), None
    twin = nn.Parameter(param.detach().clone())
    shadow = {param: param.detach().to(torch.bfloat16)}
    opt, ref = torch.optim.AdamW([param], lr=3e-3, fused=True), torch.optim.AdamW([twin], lr=3e-3, fused=True)
    param.grad = torch.randn_like(param)
    twin.grad = param.grad.clone()
    with ShadowFold(shadow):
        opt.step()
    ref.step()
    assert torch.equal(param, twin) and torch.equal(shadow[param], twin.detach().to(torch.bfloat16))
    (why,) = fold_report().values()
    if why.startswith("torch.compile failed"):
        pytest.skip(f"torch.compile cannot build kernels here either: {why}")
    assert why == "folded (torch.compile; C kernel not built: no C compiler found (no-such-cc not on PATH))"


def test_a_c_kernel_that_differs_from_torch_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    def casts_only(kind: str, flags: dict[str, bool], sc: Tensor, stepped: list[Tensor], shadow: Tensor) -> None:
        shadow.copy_(stepped[0])

    monkeypatch.setattr(shadow_kernel, "kernel", lambda: casts_only)
    monkeypatch.setattr(shadow_fold, "_FOLDS", shadow_fold._Folds())
    update = shadow_fold._FOLDS.usable("adamw", torch._fused_adamw_, _ADAM, 1.0, torch.bfloat16)
    (why,) = fold_report().values()
    if why.startswith("torch.compile failed"):
        pytest.skip(f"torch.compile cannot build kernels here either: {why}")
    assert update is not None and not update.native
    assert why.startswith("folded (torch.compile; the C kernel's adamw update differs from torch")


def test_the_kernel_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_ACCEL_NO_C_KERNEL", "1")
    monkeypatch.setattr(shadow_kernel, "_loaded", None)
    monkeypatch.setattr(shadow_kernel, "_why_not", None)
    assert shadow_kernel.kernel() is None and shadow_kernel.why_not() == "LIGHTNING_ACCEL_NO_C_KERNEL is set"
