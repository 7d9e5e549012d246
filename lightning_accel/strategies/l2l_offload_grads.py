"""The gradients a user's code sees under L2L offload: ``param.grad`` where plain Lightning shows it.

The blocks' gradients go to the host store as autograd produces them (:mod:`lightning_accel.offload.executor`), so
during a backward no ``param.grad`` of a block exists. :class:`L2LGradients` shows them again:

- in ``on_after_backward`` (called from the precision plugin's ``post_backward``, before the strategy's): landed first,
  where the user's LightningModule or a callback overrides that hook;
- after every backward, until the next backward or the optimizer step: ``clip_gradients`` or ``clip_grad_norm_``
  between ``manual_backward`` and ``opt.step()`` clip the host gradients, and a validation run that starts inside an
  accumulation window sees the partial sums;
- before the next backward they go back into the store as the user's code left them (zeroed, clipped, replaced, set
  to None), so autograd's accumulation does not add them twice (:meth:`~.HostStore.take_grads`).

``backward`` itself is Lightning's own: code that wraps or mocks ``Strategy.backward`` on the class (Lightning's tests
do) would be called again by an override's ``super().backward()``, forever.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch.strategies import Strategy
from typing_extensions import override

from lightning_accel.patching import Patch, patch
from lightning_accel.strategies.user_hooks import overrides

if TYPE_CHECKING:
    from lightning_accel.offload import L2LExecutor


class L2LGradients(Strategy):
    """Where L2L offload shows the host gradients as ``param.grad`` (see the module doc); a part of
    :class:`~lightning_accel.strategies.l2l_offload_hooks.L2LOffloadHooks`."""

    _executor: L2LExecutor | None
    _plugin_patch: Patch | None = None

    def _land_before_on_after_backward(self) -> None:
        """Lightning calls ``on_after_backward`` from the precision plugin's ``post_backward``, after the backward and
        before this strategy's ``post_backward``; where the user's code overrides it, the block gradients (gone to the
        host as they arrived) are landed and shown as ``param.grad`` there first, as plain Lightning shows them. Done on
        the plugin instance (for the fit), not in ``backward``: ``backward`` stays Lightning's own, so that code that
        wraps or mocks ``Strategy.backward`` finds it (our ``super().backward()`` would call such a wrapper again)."""
        self._unpatch_plugin()
        if not self._reads_gradients("on_after_backward"):
            return
        plugin = self.precision_plugin
        post_backward = plugin.post_backward

        def landed_for_hooks(tensor: torch.Tensor, module: Any) -> torch.Tensor:
            if self._executor is not None:
                self._gradients_for_hooks(tensor)
            return post_backward(tensor, module)

        self._plugin_patch = patch(plugin, "post_backward", landed_for_hooks)

    def _unpatch_plugin(self) -> None:
        found = getattr(self, "_plugin_patch", None)
        if found is not None:
            found.remove()
            self._plugin_patch = None

    def _gradients_for_hooks(self, closure_loss: torch.Tensor) -> None:
        """Before ``on_after_backward``: the host gradients landed and shown as ``param.grad``."""
        assert self._executor is not None
        self._executor.streamer.finish_grads()
        self._executor.install_grads()

    def _reads_gradients(self, *hooks: str) -> bool:
        """Whether the user's LightningModule or a callback overrides one of ``hooks`` (where Lightning shows gradients)."""
        return overrides(self.lightning_module, *hooks)

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        if self._executor is None:  # after teardown (a test driving the loop by hand): the model is an ordinary module
            super().pre_backward(closure_loss)
            return
        self._executor.store.take_grads()  # the gradients shown since the last backward, as the user's code left them
        self._executor.begin_backward()
        super().pre_backward(closure_loss)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        if self._executor is not None:
            self._executor.end_backward()
            self._show_grads()

    def _show_grads(self) -> None:
        """After a backward: the host gradients summed so far are ``param.grad`` until the next backward or the step,
        as plain Lightning shows them (to ``clip_gradients`` or ``clip_grad_norm_`` between ``manual_backward`` and
        ``opt.step()``, to a validation run inside an accumulation window)."""
        assert self._executor is not None
        self._executor.install_grads()

