"""torch's GPipe schedule in its two halves: every micro-batch's forward, then (later, when the caller says) every backward.

Why: under GPipe the last stage runs all its forwards before its first backward, so between the two the whole batch's
output exists on the last stage's rank. That is where the user's ``training_step`` can run once on the whole batch, as
under plain Lightning, instead of once per micro-batch (:mod:`lightning_accel.pipeline.whole_step`): the model's call
inside it runs :meth:`SplitGPipe.forward_phase` and returns the joined output, the step computes its loss and logs, and
:meth:`SplitGPipe.backward_phase` sends the loss's gradients back through the stages. ``torch``'s ``step`` runs both
halves in one call (``ScheduleGPipe._step_microbatches``), which leaves no room for the step's own code between them.

The two methods are torch 2.13's ``PipelineScheduleSingle.step`` and ``ScheduleGPipe._step_microbatches`` cut at the
point where the forwards' sends have been waited for, and nothing else: the same point-to-point operations in the same
order, so the other ranks may run torch's ``step`` unchanged. ``_step_microbatches`` itself is torch's (any rank may
still call ``step``). No Lightning here.

Those internals are torch's private names (``_split_tensor``, ``_sorted_batch_p2p``, ...), present in torch 2.13 and not
in every release (torch 2.9, which torch_xla 2.9 pins, lacks ``_split_tensor``). They are imported when a split step
first runs, not when ``lightning_accel`` is imported, so an environment whose torch lacks them (the XLA one) still
imports the package and every strategy but this route; the route then says in one line which torch it needs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.pipelining import ScheduleGPipe
from torch.profiler import record_function

__all__ = ["SplitGPipe"]


def _schedule_internals() -> tuple[Any, Any, Any, Any]:
    """torch's private pieces of ``ScheduleGPipe._step_microbatches`` that the two phases reuse, imported at first use."""
    try:
        from torch.distributed.pipelining.microbatch import _split_tensor
        from torch.distributed.pipelining.schedules import _TARGET_CHUNK_SPEC, _sorted_batch_p2p, _wait_batch_p2p
    except ImportError as err:
        raise RuntimeError(
            f"gpipe_distributed's whole-batch training step needs torch 2.13's pipelining internals; torch "
            f"{torch.__version__} lacks them ({err}): install torch==2.13.0"
        ) from None
    return _split_tensor, _TARGET_CHUNK_SPEC, _sorted_batch_p2p, _wait_batch_p2p


class SplitGPipe(ScheduleGPipe):
    """``ScheduleGPipe`` whose step can also run as :meth:`forward_phase` then :meth:`backward_phase`."""

    def forward_phase(self, *args: Any, target: Any = None, losses: list | None = None, **kwargs: Any) -> None:
        """``step``'s preparation and every micro-batch's forward (the loss function runs after each, on the last
        stage); the backward waits for :meth:`backward_phase`."""
        if self._has_backward and not torch.is_grad_enabled():
            raise RuntimeError("SplitGPipe.forward_phase needs gradients enabled (it is a training step)")
        _split_tensor, _TARGET_CHUNK_SPEC, _sorted_batch_p2p, _wait_batch_p2p = _schedule_internals()
        self._stage.has_backward = self._has_backward
        self._stage.clear_runtime_states()
        arg_mbs, kwarg_mbs = self._split_inputs(args, kwargs)
        target_mbs = list(_split_tensor(target, _TARGET_CHUNK_SPEC, self._n_microbatches)) if target is not None else None
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs, losses)
        self._initialize_stage(arg_mbs[0], kwarg_mbs[0], target_mbs[0] if target_mbs is not None else None, None)
        sends: list[Any] = []
        for i in range(self._n_microbatches):
            with record_function(f"Forward {i}"):
                for work in _sorted_batch_p2p(self._stage.get_fwd_recv_ops(i), desc="fwd_recv").values():
                    _wait_batch_p2p(work)
                output = self._stage.forward_one_chunk(i, arg_mbs[i], kwarg_mbs[i], save_forward_output=True)
                sends.extend(_sorted_batch_p2p(self._stage.get_fwd_send_ops(i), desc="fwd_send").values())
            self._maybe_compute_loss(self._stage, output, target_mbs, i, None)
        for work in sends:
            _wait_batch_p2p(work)

    def backward_phase(self, losses: list | None = None) -> None:
        """Every micro-batch's backward, after :meth:`forward_phase`, and the end of ``step`` (losses, gradient
        reduction)."""
        _, _, _sorted_batch_p2p, _wait_batch_p2p = _schedule_internals()
        sends: list[Any] = []
        for i in range(self._n_microbatches):
            with record_function(f"Backward {i}"):
                for work in _sorted_batch_p2p(self._stage.get_bwd_recv_ops(i), desc="bwd_recv").values():
                    _wait_batch_p2p(work)
                loss = self._maybe_get_loss(self._stage, i)
                self._stage.backward_one_chunk(i, loss=loss, last_backward=i == self._n_microbatches - 1)
                sends.extend(_sorted_batch_p2p(self._stage.get_bwd_send_ops(i), desc="bwd_send").values())
        for work in sends:
            _wait_batch_p2p(work)
        self._update_losses(self._stage, losses)
        self._stage.perform_reduce_grad(self._n_microbatches if self.scale_grads else 1)
