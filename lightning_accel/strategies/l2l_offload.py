"""The L2L (layer-to-layer) CPU offload strategy.

A thin Lightning adapter over :mod:`lightning_accel.offload`: parameters, gradients and
optimizer state of the model's blocks live in host memory; only the block being computed
(plus ``prefetch_blocks`` blocks on their way) lives on the device. The user's
``configure_optimizers`` is honoured unchanged: the optimizer simply finds the block
parameters on the host, with their fp32 gradients, when it steps.

What each hook adds to :class:`SingleDeviceStrategy`:

- ``model_to_device``: plan the units, move block parameters to the host store, keep the
  rest (embeddings, head, norms) on the device, wrap the blocks' forwards;
- ``training_step`` / ``pre_backward`` / ``post_backward``: bracket the passes so the
  executor prefetches in the right direction and lands the gradients on the host;
- ``optimizer_step``: on a step's backward pass, step each block's parameters on the host
  (in a worker thread) as soon as that block's gradients have arrived, overlapping the
  backward of the blocks still running; then expose the remaining host gradients as
  ``param.grad`` for clipping and the final step (resident parameters, and every block
  when the overlap is off), and refresh the low-precision shadows;
- ``load_optimizer_state_dict``: keep each state tensor on its parameter's device (host
  for blocks) instead of moving everything to the root device.

Gradient clipping by global norm works (it sees every gradient, host and device), but it
needs all gradients before any parameter may step, so with ``gradient_clip_val`` set (and
likewise under fp16 loss scaling, whose overflow check spans all gradients) the whole
host step runs after the backward pass: the overlap is lost and the step time is added
to the critical path. The overlap also needs a per-parameter optimizer (SGD, Adam(W),
RMSprop, Adagrad, ...), for which stepping blocks one at a time equals one full step.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import CUDAAccelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from torch.optim import LBFGS, Optimizer
from typing_extensions import override

from lightning_accel.models.block_policy import BlockPolicy
from lightning_accel.offload import L2LExecutor, OffloadStats, make_plan
from lightning_accel.plugins.precision.offload import OffloadPrecision


class L2LOffloadStrategy(SingleDeviceStrategy):
    """Train on one device with the model's blocks offloaded to host memory.

    Args:
        blocks: which submodules stream: ``"auto"`` (the longest ModuleList of one class),
            class names/classes (``["GPTBlock"]``), or a callable ``model -> modules``.
        prefetch_blocks: how many blocks ahead to copy while one computes (device memory
            grows by one block per step of depth; 1 hides the copy behind compute).
        offload_resident: also keep the non-block parameters on the host, streamed in for
            each step (saves their device memory, costs their copy every step).
        checkpoint_blocks: recompute each block in backward instead of keeping its
            activations and weights (device memory independent of depth; about one extra
            forward of compute).
        overlap_step: step each block on the host as soon as its gradients arrive, while
            the backward pass continues (off automatically under clipping / fp16). None
            (default): on when the device is an accelerator; off on the CPU, where the
            "host" step would compete with the "device" compute for the same cores
            (measured: 1.58x plain with it, 1.26x without, in ``bench offload``).
        device: the device to compute on; default: the Trainer's accelerator (cuda:0 or cpu).
    """

    strategy_name = "l2l_offload"

    def __init__(
        self,
        blocks: BlockPolicy = "auto",
        prefetch_blocks: int = 1,
        offload_resident: bool = False,
        checkpoint_blocks: bool = True,
        overlap_step: bool | None = None,
        device: str | torch.device | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(device=device if device is not None else "cpu", **kwargs)
        if prefetch_blocks < 0:
            raise ValueError(f"prefetch_blocks must be >= 0, got {prefetch_blocks}; use 1 to overlap copies with compute")
        self._device_given = device is not None
        self.blocks = blocks
        self.prefetch_blocks = prefetch_blocks
        self.offload_resident = offload_resident
        self.checkpoint_blocks = checkpoint_blocks
        self.overlap_step = overlap_step
        self._executor: L2LExecutor | None = None
        self._last_stats = OffloadStats()

    @property
    @override
    def root_device(self) -> torch.device:
        if not self._device_given and isinstance(self.accelerator, CUDAAccelerator):
            return torch.device("cuda", torch.cuda.current_device())
        return super().root_device

    @property
    def offload_stats(self) -> OffloadStats:
        """Bytes moved, copy time, overlap, peak device bytes and resident blocks."""
        if self._executor is None:
            return self._last_stats
        return self._executor.stats

    def _compute_dtype(self) -> torch.dtype:
        plugin = self.precision_plugin
        if isinstance(plugin, OffloadPrecision):
            plugin.set_device(self.root_device.type)
            return plugin.compute_dtype
        if type(plugin) is Precision:
            return torch.float32
        raise ValueError(
            f"L2LOffloadStrategy does not support the precision plugin {type(plugin).__name__}"
            f"{'(' + repr(getattr(plugin, 'precision', '')) + ')'}; HINT: pass plugins=[OffloadPrecision('bf16-mixed')] "
            "(or '16-mixed', '32-true') and leave Trainer(precision=...) unset"
        )

    @override
    def setup_environment(self) -> None:
        # before the accelerator sets up the device: refuse XLA with the reason, not a device error
        from lightning.pytorch.accelerators import XLAAccelerator

        from lightning_accel.accelerators import XLAPJRTAccelerator

        if isinstance(self.accelerator, (XLAAccelerator, XLAPJRTAccelerator)) or self.root_device.type == "xla":
            raise ValueError(
                "L2LOffloadStrategy does not run on XLA devices: it streams one block at a time between host and device "
                "inside the step, and on XLA each such copy ends the traced graph (a recompile or host round trip per block). "
                "HINT: on a TPU use strategy='xla_pjrt' with precision='bf16-true', or run L2L on CUDA or the CPU"
            )
        super().setup_environment()

    @override
    def setup(self, trainer: Trainer) -> None:
        self._compute_dtype()  # refuse an unsupported precision before anything moves
        super().setup(trainer)
        for optimizer in self.optimizers:
            _check_host_optimizer(optimizer)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        if self._executor is not None:
            self._executor.detach()
        try:
            plan = make_plan(self.model, self.blocks, self.prefetch_blocks, self.offload_resident)
        except ValueError as err:
            raise ValueError(f"L2LOffloadStrategy: {err}") from None
        device = self.root_device
        compute_dtype = self._compute_dtype()
        if device.type == "cuda":
            _check_fits(plan, device, compute_dtype)
        self._executor = L2LExecutor(self.model, plan, device, compute_dtype, checkpoint_blocks=self.checkpoint_blocks)
        self._executor.attach()
        copies = (
            "the device is the host in fp32, so blocks compute on their masters (no copies)"
            if self._executor.streamer.alias
            else f"device copies in {compute_dtype} on {device}"
        )
        rank_zero_info(f"L2LOffloadStrategy: {plan.describe()}; {copies}")

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self._executor is not None
        self._executor.begin_step()
        return super().training_step(*args, **kwargs)

    def _eval(self, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        assert self._executor is not None
        self._executor.begin_step()
        try:
            return step(*args, **kwargs)
        finally:
            self._executor.end_eval()

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval(super().validation_step, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval(super().test_step, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._eval(super().predict_step, *args, **kwargs)

    @override
    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        assert self._executor is not None
        self._executor.begin_backward()
        super().pre_backward(closure_loss)

    @override
    def post_backward(self, closure_loss: torch.Tensor) -> None:
        super().post_backward(closure_loss)
        assert self._executor is not None
        self._executor.end_backward()

    @override
    def optimizer_step(self, optimizer: Optimizer, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        executor = self._executor
        assert executor is not None

        wanted = self.root_device.type != "cpu" if self.overlap_step is None else self.overlap_step
        overlap = wanted and self._can_overlap(optimizer)

        def closure_then_host_grads() -> Any:
            executor.step_blocks_during_backward(functools.partial(_step_subset, optimizer) if overlap else None)
            result = closure()
            executor.install_grads()  # clipping and the final step see the host gradients
            return result

        output = super().optimizer_step(optimizer, closure_then_host_grads, model, **kwargs)
        executor.after_step()
        return output

    def _can_overlap(self, optimizer: Optimizer) -> bool:
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        clipping = bool(trainer is not None and trainer.gradient_clip_val)
        scaling = getattr(self.precision_plugin, "scaler", None) is not None
        return isinstance(optimizer, _PER_PARAMETER) and not clipping and not scaling

    @override
    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        super().load_model_state_dict(checkpoint, strict=strict)
        if self._executor is not None:
            self._executor.store.refresh_shadows()

    @override
    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        # Optimizer.load_state_dict already puts each state tensor on its parameter's
        # device (host for blocks); the base class would then move all of it to the GPU.
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            optimizer.load_state_dict(state)

    @override
    def teardown(self) -> None:
        if self._executor is not None:
            self._executor.detach()  # the model computes normally again; stats stay readable
            self._last_stats = self._executor.stats
            self._executor = None
        super().teardown()


# Optimizers whose update of a parameter reads only that parameter's gradient and state:
# stepping them block by block equals one step over all parameters.
_PER_PARAMETER = (
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop, torch.optim.Adagrad,
    torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adadelta,
)


def _step_subset(optimizer: Optimizer, params: list[nn.Parameter]) -> None:
    """``optimizer.step()`` restricted to ``params`` (same hyper-parameters and state)."""
    keep = {id(p) for p in params}
    groups = optimizer.param_groups
    optimizer.param_groups = [{**g, "params": [p for p in g["params"] if id(p) in keep]} for g in groups]
    try:
        optimizer.step()
    finally:
        optimizer.param_groups = groups


def _check_host_optimizer(optimizer: Optimizer) -> None:
    """Refuse optimizers that cannot step parameters living in host memory."""
    name = type(optimizer).__name__
    if isinstance(optimizer, LBFGS):
        raise ValueError(
            "L2LOffloadStrategy cannot run LBFGS on the host: it re-evaluates the whole model inside step(); "
            "HINT: use a per-parameter optimizer such as AdamW or SGD"
        )
    for group in optimizer.param_groups:
        for flag in ("fused", "capturable"):
            if group.get(flag):
                raise ValueError(
                    f"L2LOffloadStrategy steps block parameters on the host, but {name}({flag}=True) needs CUDA "
                    f"parameters; HINT: set {flag}=False in configure_optimizers"
                )


def _check_fits(plan: Any, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse a block that does not fit on the device by itself, before any step."""
    free, _ = torch.cuda.mem_get_info(device)
    element = torch.tensor([], dtype=dtype).element_size()
    biggest = max(plan.blocks, key=lambda u: u.numel)
    need = biggest.nbytes(element) * (1 + plan.prefetch_blocks)
    if not plan.offload_resident:
        need += plan.resident.nbytes(4)
    if need > free:
        raise ValueError(
            f"block {biggest.name} needs {need / 2**30:.2f} GiB on {device} with prefetch_blocks={plan.prefetch_blocks} "
            f"(plus the resident parameters) but only {free / 2**30:.2f} GiB is free; use smaller blocks "
            "(a finer block policy), prefetch_blocks=0, or offload_resident=True"
        )
