"""The Fabric row of ``bench offload``: ``Fabric(strategy="l2l_offload")`` in a loop written by hand, on the same GPT,
tokens, steps, optimizer and loss as the Trainer rows (the task's own ``configure_optimizers`` and loss), so its step
time against the Trainer's ``l2l_offload`` row is what the Fabric adapter costs (the mechanism is the same)."""

from __future__ import annotations

import time
from typing import Any

import torch
from lightning.fabric import Fabric

from lightning_accel.benchmarks.offload_workload import token_data
from lightning_accel.models import GPT, LanguageModelTask


def fabric_measure(net_kwargs: dict[str, Any], strategy: Any, accelerator: str, batch: int, seq: int, steps: int,
                   warmup: int) -> dict[str, Any]:
    """Median step seconds after ``warmup`` steps of the loop, as ``_measure`` reports a Trainer run's."""
    torch.manual_seed(0)
    task = LanguageModelTask(GPT(**net_kwargs, block_size=seq))
    fabric = Fabric(accelerator=accelerator, devices=1, strategy=strategy, precision="32-true")
    fabric.launch()
    fabric.setup(task.net)  # the task's loss calls its net, whose forward the strategy now drives
    optimizer = fabric.setup_optimizers(task.configure_optimizers())  # (the zoo task's default: one optimizer)
    times: list[float] = []
    for step, tokens in enumerate(token_data(batch, seq, steps), start=1):
        _sync()
        start = time.perf_counter()
        optimizer.zero_grad()
        _, loss = task._loss(fabric.to_device(tokens))
        fabric.backward(loss)
        optimizer.step()
        _sync()
        if step > warmup:
            times.append(time.perf_counter() - start)
    step_s = sorted(times)[len(times) // 2]
    return {"step_s": step_s, "tokens_per_s": batch * seq / step_s, "stats": getattr(fabric.strategy, "offload_stats", None),
            "task": task}


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
