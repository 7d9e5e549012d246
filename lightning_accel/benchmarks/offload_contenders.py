"""The offloads a user would pick instead of L2L, each wired as its own docs advise, measured as ``bench offload`` measures.

Each contender trains the same GPT in :class:`~lightning_accel.models.LanguageModelTask` on the same
random tokens as :func:`lightning_accel.benchmarks.offload._measure` and returns the same row:
``step_s`` (median after ``warmup``), ``tokens_per_s``, ``oom``, ``params``, ``peak_gib`` (CUDA), plus
``host_gib`` (the host memory the fit added at its peak) and, for a contender that cannot run here,
``skipped`` (why, with the fix) instead of figures.

- :func:`fsdp2_offload`: FSDP2, one unit per block. ``configure_model`` calls
  ``fully_shard(block, offload_policy=CPUOffloadPolicy(pin_memory=...))`` on every block (the blocks
  :func:`~lightning_accel.models.block_policy.find_blocks` finds, as L2L streams them), then on the root,
  under Lightning's ``ModelParallelStrategy``; so one block's weights are on the device at a time, not
  the whole model as Lightning's registered ``fsdp_cpu_offload`` (one unit) moves them. Pinned host
  memory on CUDA; on the CPU it runs with gloo and ``pin_memory=False``. In bf16-mixed it uses FSDP2's
  own ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` (logits in fp32), as torch's FSDP2
  docs and torchtitan do, rather than autocast over fp32 weights.
- :func:`zero3_offload`: DeepSpeed ZeRO-3 with parameters and optimizer state on the host,
  ``DeepSpeedStrategy(stage=3, offload_parameters=True, offload_optimizer=True)`` and ``DeepSpeedCPUAdam``
  (Lightning's ZeRO-3 offload docs), only where deepspeed imports and a CUDA device is present.
"""

from __future__ import annotations

import importlib.util
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from typing_extensions import override

from lightning_accel.benchmarks.offload_workload import StepTimer, token_data
from lightning_accel.host_memory import PeakRSS
from lightning_accel.models import GPT, LanguageModelTask
from lightning_accel.models.block_policy import find_blocks


class PerBlockFSDP2Task(LanguageModelTask):
    """A :class:`LanguageModelTask` whose ``configure_model`` applies FSDP2 with CPU offload, one unit per block, then
    the root (which keeps the embedding and head)."""

    def __init__(self, net: nn.Module, pin_memory: bool, param_dtype: torch.dtype | None = None) -> None:
        super().__init__(net)
        self.pin_memory = pin_memory
        self.param_dtype = param_dtype

    @override
    def configure_model(self) -> None:
        if isinstance(self.net, FSDPModule):
            return  # Lightning calls the hook again for each fit, validate or test
        mesh = self.device_mesh["data_parallel"]
        offload = CPUOffloadPolicy(pin_memory=self.pin_memory)
        mixed = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32)
        for block in find_blocks(self.net):
            fully_shard(block.module, mesh=mesh, offload_policy=offload, mp_policy=mixed)
        # the root's output (the logits) in fp32, so the loss is computed as under plain Lightning
        root_mixed = MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=torch.float32,
                                          output_dtype=torch.float32 if self.param_dtype is not None else None)
        fully_shard(self.net, mesh=mesh, offload_policy=offload, mp_policy=root_mixed)


class _HostOffloadModelParallelStrategy(ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` without its closing ``model.to(device)``.

    ``fully_shard`` has already placed everything: the offloaded shards in host memory and the buffers on the
    device. The base class's ``model.to(device)`` would copy every shard onto the device at once (FSDP puts them
    back in host memory at its lazy init): a whole-model device peak that CPU offload exists to avoid.
    """

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        loose = [name for name, p in self.model.named_parameters() if not isinstance(p, DTensor)]
        if loose:
            raise RuntimeError(f"parameters {loose[:3]} are outside every FSDP unit; configure_model must fully_shard the root")
        for module in self.model.modules():
            for key, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[key] = buffer.to(self.root_device)


def _fit(task: pl.LightningModule, strategy: Any, precision: Any, accelerator: str, batch: int, seq: int, steps: int,
         warmup: int, **trainer_kwargs: Any) -> dict[str, Any]:
    """``task`` trained as ``_measure`` trains its contenders; the row ``_measure`` returns, with ``host_gib``."""
    timer = StepTimer(warmup)
    trainer = pl.Trainer(
        accelerator=accelerator, devices=1, strategy=strategy, precision=precision, max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[timer],
        **trainer_kwargs,
    )
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    try:
        with PeakRSS() as host:
            trainer.fit(task, token_data(batch, seq, steps))
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"step_s": float("nan"), "oom": True}
    step_s = sorted(timer.times)[len(timer.times) // 2]  # median: robust to a noisy neighbour
    row = {"step_s": step_s, "tokens_per_s": batch * seq / step_s, "oom": False, "task": task,
           "params": sum(getattr(p, "ds_numel", p.numel()) for p in task.parameters()),  # ZeRO-3 leaves p empty
           "host_gib": host.added / 2**30 if host.added is not None else float("nan")}
    if torch.cuda.is_available():
        row["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return row


def fsdp2_offload(net_kwargs: dict[str, Any], precision: str, accelerator: str, batch: int, seq: int, steps: int,
                  warmup: int) -> dict[str, Any]:
    """FSDP2 with CPU offload, one unit per block, on one device; ``precision`` is ``"32-true"`` or ``"bf16-mixed"``.

    The row's ``task`` is the trained module (its parameters DTensors, the blocks ``FSDPModule``s)."""
    if precision not in ("32-true", "bf16-mixed"):
        raise ValueError(f"fsdp2_offload: precision {precision!r} is not one it compares; use '32-true' or 'bf16-mixed'")
    torch.manual_seed(0)  # the same initial weights as _measure's contenders
    task = PerBlockFSDP2Task(GPT(**net_kwargs, block_size=seq), pin_memory=accelerator != "cpu",
                             param_dtype=torch.bfloat16 if precision == "bf16-mixed" else None)
    initialized = torch.distributed.is_initialized()
    try:
        # FSDP2 casts (param_dtype) instead of Lightning's autocast. One data-parallel rank: Lightning's distributed
        # sampler would only reorder the batches, and every contender trains on the same batches in the same order.
        return _fit(task, _HostOffloadModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1), "32-true",
                    accelerator, batch, seq, steps, warmup, use_distributed_sampler=False)
    finally:
        if not initialized and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()  # the 1-process gloo/nccl group this fit started


def _zero3_unavailable(accelerator: str) -> str | None:
    """Why ZeRO-3 offload cannot run here, with the fix; None where it can."""
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed not installed (pip install deepspeed, constrained to this torch)"
    if accelerator == "cpu" or not torch.cuda.is_available():
        return "needs CUDA (Lightning's DeepSpeedStrategy runs on CUDA GPUs only)"
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder

        CPUAdamBuilder().load()  # the JIT build DeepSpeedCPUAdam needs; minutes the first time
    except Exception as err:  # a compiler, CUDA headers or ninja missing: the builder's own message says which
        return f"DeepSpeedCPUAdam did not build: {type(err).__name__}: {str(err)[:200]}"
    return None


def zero3_offload(net_kwargs: dict[str, Any], precision: str, accelerator: str, batch: int, seq: int, steps: int,
                  warmup: int) -> dict[str, Any]:
    """DeepSpeed ZeRO-3 with parameters and optimizer state offloaded to the host, on one CUDA device."""
    why = _zero3_unavailable(accelerator)
    if why is not None:
        return {"step_s": float("nan"), "oom": False, "skipped": why}
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from lightning.pytorch.strategies import DeepSpeedStrategy

    torch.manual_seed(0)
    # the task's default optimizer (AdamW, lr 3e-4, weight decay 0.01) as DeepSpeed's vectorized host Adam
    task = LanguageModelTask(GPT(**net_kwargs, block_size=seq),
                             optimizer=partial(DeepSpeedCPUAdam, lr=3e-4, weight_decay=0.01, adamw_mode=True))
    strategy = DeepSpeedStrategy(stage=3, offload_parameters=True, offload_optimizer=True)
    return _fit(task, strategy, precision, accelerator, batch, seq, steps, warmup)


# name -> row function, in the order the tables print them
CONTENDERS = {"FSDP2 offload, per block": fsdp2_offload, "ZeRO-3 offload": zero3_offload}

