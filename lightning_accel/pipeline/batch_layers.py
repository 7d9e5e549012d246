"""Layers whose training result depends on the whole batch, which micro-batching changes: found, then honoured or refused.

A pipeline runs each batch as ``chunks`` micro-batches, and a layer sees one micro-batch per call. For most layers that
is the same computation (a linear layer, attention, GroupNorm and LayerNorm: each sample on its own). Not for these,
found by their class in ``torch.nn`` (every subclass of ``torch.nn.modules.batchnorm._NormBase`` and the spectral
normalization torch ships, :func:`batch_layers`):

- BatchNorm (``BatchNorm1d/2d/3d``, their lazy forms, ``SyncBatchNorm``): in training it normalizes with the statistics
  of the batch it sees, so each micro-batch is normalized on its own: outputs, gradients and weights differ from plain
  training's. Deferred statistics (:class:`~lightning_accel.pipeline.batchnorm.DeferredBatchNorm`) make the running
  statistics the whole batch's, not the normalization; so it is refused unless the user asks for that
  (``deferred_batch_norm=True``, torchgpipe's semantics, or ``False``: per micro-batch throughout);
- InstanceNorm with ``track_running_stats=True``: each sample normalized on its own, but the running statistics move
  once per call, ``chunks`` times a batch: refused;
- spectral normalization (``torch.nn.utils.spectral_norm`` and ``torch.nn.utils.parametrizations.spectral_norm``): one
  power iteration per forward call in training, ``chunks`` per batch: refused.

With one micro-batch (``chunks=1``) nothing changes, and nothing is refused. No Lightning here.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
from torch.nn.modules.instancenorm import _InstanceNorm

__all__ = ["batch_layers", "check_batch_layers"]


def _spectral(module: nn.Module) -> bool:
    """Whether ``module`` has spectral normalization, either of torch's two forms."""
    if any(type(hook).__name__ == "SpectralNorm" for hook in module._forward_pre_hooks.values()):
        return True
    parametrizations = getattr(module, "parametrizations", None)
    return isinstance(parametrizations, nn.ModuleDict) and any(
        type(p).__name__ == "_SpectralNorm" for plist in parametrizations.values() for p in plist
    )


def batch_layers(net: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    """Each layer of ``net`` whose training result depends on how many samples a call sees: ``(name, module, kind)``,
    ``kind`` one of ``"batch_norm"``, ``"running_stats"`` (an instance norm's), ``"spectral_norm"``, ``"norm"`` (another
    ``_NormBase`` torch may add: refused alike)."""
    for name, module in net.named_modules():
        if isinstance(module, _BatchNorm):
            yield name, module, "batch_norm"
        elif isinstance(module, _InstanceNorm):
            if module.track_running_stats:
                yield name, module, "running_stats"
        elif isinstance(module, _NormBase):
            yield name, module, "norm"
        if _spectral(module):
            yield name, module, "spectral_norm"


def check_batch_layers(net: nn.Module, chunks: int, deferred_batch_norm: bool | None, owner: str) -> None:
    """Refuse, in one line, the first layer of ``net`` that ``chunks`` micro-batches would train otherwise than plain
    training (see the module docstring); BatchNorm only where ``deferred_batch_norm`` was not given (None)."""
    if chunks == 1:
        return
    where = f"{owner}(chunks={chunks})"
    for name, module, kind in batch_layers(net):
        label = f"{name or 'the model'} ({type(module).__name__})"
        if kind == "batch_norm" and deferred_batch_norm is None:
            raise ValueError(
                f"{where}: {label} normalizes each of the {chunks} micro-batches with its own statistics in training, so "
                "outputs, gradients and weights differ from plain Lightning's; set chunks=1, use a norm of each sample "
                "(GroupNorm, LayerNorm), or accept micro-batch statistics with deferred_batch_norm=True (running "
                "statistics over the whole batch, as torchgpipe) or False"
            )
        if kind in ("running_stats", "norm"):
            raise ValueError(
                f"{where}: {label} updates its running statistics once per call, {chunks} times a batch, not once as in "
                "plain Lightning; set track_running_stats=False, or chunks=1"
            )
        if kind == "spectral_norm":
            raise ValueError(
                f"{where}: {label} has spectral normalization, which runs one power iteration per forward call, "
                f"{chunks} per batch, not one as in plain Lightning; set chunks=1, or remove spectral_norm"
            )
