"""Layers and Trainer flags whose result depends on the whole batch, under ``gpipe`` and ``gpipe_distributed`` with
micro-batches: each is honoured or refused before any work in one line (lightning_accel.pipeline.batch_layers).

The members are enumerated from torch and Lightning, and each one's dependence on the batch is measured, not listed by
hand: every ``torch.nn`` normalization layer (the subclasses of ``_NormBase`` torch exports, with and without running
statistics), every reparametrization ``torch.nn.utils`` ships, each run on a batch of 8 and on its two halves, its
outputs and buffers compared (a layer whose two differ trains otherwise with micro-batches); every boolean Trainer flag,
set, and whether Lightning then converts layers (``_layer_sync``). Before: a BatchNorm trained with micro-batch
statistics by default (weights other than plain Lightning's, nothing said), an instance norm with running statistics
updated them once per micro-batch, spectral normalization ran one power iteration per micro-batch."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.utils.parametrizations as parametrizations
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from lightning_accel import DistributedGPipeStrategy, GPipeStrategy

NORMS = sorted({c for c in vars(nn).values() if inspect.isclass(c) and issubclass(c, _NormBase)}, key=lambda c: c.__name__)
REPARAMETRIZATIONS = {
    **{f"parametrizations.{n}": getattr(parametrizations, n) for n in parametrizations.__all__},
    "spectral_norm": nn.utils.spectral_norm, "weight_norm": nn.utils.weight_norm,
}
STRATEGIES = {
    "gpipe": lambda chunks, **kw: GPipeStrategy(chunks=chunks, devices=2, **kw),
    "gpipe_distributed": lambda chunks, **kw: DistributedGPipeStrategy(chunks=chunks, **kw),
}


def _norms() -> list:
    """Each normalization layer with and without running statistics."""
    return [pytest.param(cls, {"track_running_stats": running}, id=f"{cls.__name__}-{'running' if running else 'no-running'}")
            for cls in NORMS for running in (False, True)]


def _layer(cls: type, kwargs: dict) -> nn.Module:
    if not cls.__name__.startswith("Lazy"):
        return cls(4, **kwargs)
    layer = cls(**kwargs).eval()
    with torch.no_grad():
        layer(_input(cls))  # its shapes, from a first call (in eval mode: no statistics moved)
    return layer


def _input(cls: type) -> torch.Tensor:
    dims = {"1d": (5,), "2d": (3, 3), "3d": (2, 2, 2)}.get(cls.__name__[-2:], (5,))
    return torch.randn(8, 4, *dims, generator=torch.Generator().manual_seed(0))


def depends_on_the_batch(make: Callable[[], nn.Module], x: torch.Tensor) -> bool:
    """Whether a layer ``make()`` builds (the same each time) in training gives other outputs or ends with other buffers
    on ``x`` than on its two halves, one after the other (what two micro-batches are)."""
    whole, halves = make().train(), make().train()
    with torch.no_grad():
        y = whole(x)
        ys = torch.cat([halves(part) for part in x.chunk(2)])
    buffers = [(a, b) for a, b in zip(whole.buffers(), halves.buffers()) if not isinstance(a, nn.parameter.UninitializedBuffer)]
    return not torch.allclose(y, ys, atol=1e-6) or any(not torch.allclose(a.float(), b.float()) for a, b in buffers)


class Holder(pl.LightningModule):
    """A LightningModule holding ``layer`` among two linear blocks."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 4), layer, nn.Linear(4, 4))


def _refusal(strategy: str, module: pl.LightningModule, chunks: int, **kwargs) -> str | None:
    """What ``strategy``'s check before a fit says of ``module``: None, or its one line."""
    built = STRATEGIES[strategy](chunks, **kwargs)
    try:
        built.check_fit(module, False) if strategy == "gpipe_distributed" else built.check_fit(module)
    except ValueError as err:
        assert len(str(err).splitlines()) == 1, str(err)
        return str(err)
    return None


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(("cls", "kwargs"), _norms())
def test_a_norm_that_depends_on_the_batch_is_refused_with_micro_batches_and_runs_without(strategy, cls, kwargs) -> None:
    layer = _layer(cls, kwargs)
    module = Holder(layer)
    name = type(layer).__name__
    refused = _refusal(strategy, module, 2)
    if depends_on_the_batch(lambda: copy.deepcopy(layer), _input(cls)):
        assert refused is not None and refused.startswith(f"{type(STRATEGIES[strategy](2)).__name__}(chunks=2): net.1 ({name}) ")
    else:
        assert refused is None, refused
    assert _refusal(strategy, module, 1) is None  # one micro-batch: the whole batch, as plain training


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_batch_norm_is_trained_with_micro_batch_statistics_only_when_asked(strategy) -> None:
    module = Holder(nn.BatchNorm1d(4))
    said = _refusal(strategy, module, 4)
    assert said is not None and "set chunks=1, use a norm of each sample (GroupNorm, LayerNorm), or accept micro-batch " \
        "statistics with deferred_batch_norm=True (running statistics over the whole batch, as torchgpipe) or False" in said
    for deferred in (True, False):  # the user's explicit choice (tests/strategies/test_gpipe.py and the semantics tests)
        assert _refusal(strategy, module, 4, deferred_batch_norm=deferred) is None


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", sorted(REPARAMETRIZATIONS))
def test_a_reparametrization_that_depends_on_the_batch_is_refused_with_micro_batches(strategy, name) -> None:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return REPARAMETRIZATIONS[name](nn.Linear(4, 4))

    refused = _refusal(strategy, Holder(make()), 2)
    if depends_on_the_batch(make, torch.randn(8, 4, generator=torch.Generator().manual_seed(1))):
        assert refused is not None and "spectral normalization, which runs one power iteration per forward call" in refused
    else:
        assert refused is None, refused


def _flags_that_convert_layers() -> list[str]:
    """The boolean Trainer flags with which Lightning converts the model's layers (its layer sync) under DDP."""
    found = []
    for name, parameter in inspect.signature(pl.Trainer.__init__).parameters.items():
        if isinstance(parameter.default, bool) and not parameter.default:
            trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False, **{name: True})
            if getattr(trainer.strategy, "_layer_sync", None) is not None:
                found.append(name)
    return found


def test_trainer_flags_that_convert_layers_are_refused_by_the_pipeline_and_plain_on_one_device_ignores_them() -> None:
    flags = _flags_that_convert_layers()
    assert flags == ["sync_batchnorm"]  # what Lightning 2.6 has; a new one shows up here
    for flag in flags:
        with pytest.raises(ValueError, match=rf"^DistributedGPipeStrategy does not convert BatchNorm layers \(Trainer\({flag}=True\)\); "):
            DistributedGPipeStrategy(chunks=2).check_fit(Holder(nn.BatchNorm1d(4)), True)
        # one process, as plain Lightning on one device: Lightning converts layers only under a parallel strategy
        trainer = pl.Trainer(accelerator="cpu", strategy=GPipeStrategy(chunks=2, devices=2), logger=False, **{flag: True})
        assert getattr(trainer.strategy, "_layer_sync", None) is None
