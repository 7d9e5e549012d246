"""Deferred batch normalization: running statistics over the whole batch, not per micro-batch.

With micro-batches, each BatchNorm forward sees 1/M of the batch and would update its
running mean and variance M times per step, from M small samples. Deferred, it
normalizes each micro-batch with that micro-batch's statistics (which is all a
micro-batch can see) but only accumulates the sums; after the batch's last micro-batch
:meth:`DeferredBatchNorm.commit` updates the running statistics once, from the whole
batch, exactly as plain training would from the same inputs (torchgpipe's design).
Recomputation in backward (checkpointing) normalizes again without accumulating.

Without deferral (``defer=False``) each micro-batch updates the running statistics as
plain BatchNorm would on it, and only the recomputation is kept from updating them a
second time (``torch.utils.checkpoint`` alone would count every micro-batch twice).

The modules are patched in place (an instance ``forward``), so names and state_dict
keys do not change, and :meth:`detach` leaves plain BatchNorm modules behind.
"""

from __future__ import annotations

from collections.abc import Callable
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_accel.patching import patch, remove_all

__all__ = ["DeferredBatchNorm"]


class _Sums:
    def __init__(self) -> None:
        self.sum: Tensor | None = None
        self.sumsq: Tensor | None = None
        self.count = 0


class DeferredBatchNorm:
    """Defers the running-statistics update of every BatchNorm in ``net`` to :meth:`commit`.

    ``accumulating()`` says whether a forward call belongs to a micro-batch of the
    current batch (True) or is a recomputation / evaluation (False).
    """

    def __init__(self, net: nn.Module, accumulating: Callable[[], bool], defer: bool = True) -> None:
        self.accumulating, self.defer = accumulating, defer
        self.modules = [m for m in net.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]
        self.sums: dict[int, _Sums] = {id(m): _Sums() for m in self.modules}
        self._patches = [patch(module, "forward", self._forward(module)) for module in self.modules]

    def _forward(self, bn: _BatchNorm) -> Callable[[Tensor], Tensor]:
        original = bn.forward

        def forward(x: Tensor) -> Tensor:
            if not bn.training:
                return original(x)
            if x.is_meta:  # a shadow run for shapes: no statistics (momentum=None would read the meta counter's value)
                return F.batch_norm(x, None, None, bn.weight, bn.bias, True, 0.0, bn.eps)
            bn._check_input_dim(x)  # type: ignore[attr-defined]
            forward_pass = self.accumulating()
            if forward_pass and not self.defer:
                return original(x)  # plain BatchNorm on this micro-batch
            if forward_pass:
                sums = self.sums[id(bn)]
                dims = [d for d in range(x.dim()) if d != 1]  # all but the channel dimension
                xd = x.detach().to(torch.float64)
                s, sq = xd.sum(dims), (xd * xd).sum(dims)
                sums.sum = s if sums.sum is None else sums.sum + s
                sums.sumsq = sq if sums.sumsq is None else sums.sumsq + sq
                sums.count += x.numel() // x.size(1)
            if not self.defer:
                # recomputation of a plain micro-batch: the same computation (so checkpointing sees the same saved
                # tensors) but its statistics update goes to throwaway copies
                mean, var = bn.running_mean.clone(), bn.running_var.clone()  # type: ignore[union-attr]
                return F.batch_norm(x, mean, var, bn.weight, bn.bias, True, 0.0, bn.eps)
            # normalize with this micro-batch's statistics; running statistics untouched here
            return F.batch_norm(x, None, None, bn.weight, bn.bias, True, 0.0, bn.eps)

        return forward

    @torch.no_grad()
    def commit(self) -> None:
        """Update every running mean/variance once from the statistics of the whole batch."""
        for bn in self.modules:
            sums = self.sums[id(bn)]
            if sums.count == 0 or sums.sum is None or sums.sumsq is None:
                continue
            if sums.count < 2:
                raise ValueError(
                    f"BatchNorm {type(bn).__name__} saw 1 value per channel in this batch; its variance is undefined; "
                    "use a larger batch"
                )
            mean = sums.sum / sums.count
            var = (sums.sumsq / sums.count - mean * mean) * (sums.count / (sums.count - 1))  # unbiased, as BatchNorm
            bn.num_batches_tracked += 1  # type: ignore[operator]
            momentum = bn.momentum if bn.momentum is not None else 1.0 / float(bn.num_batches_tracked)
            bn.running_mean.mul_(1 - momentum).add_(mean.to(bn.running_mean.dtype), alpha=momentum)  # type: ignore[union-attr]
            bn.running_var.mul_(1 - momentum).add_(var.to(bn.running_var.dtype), alpha=momentum)  # type: ignore[union-attr]
            self.sums[id(bn)] = _Sums()

    def detach(self) -> None:
        """Leave plain BatchNorm modules (any uncommitted sums are dropped)."""
        remove_all(self._patches)
