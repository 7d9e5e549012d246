"""What ``bench pipeline`` trains: a model, its batch, the user's loss, and its 2 stages cut by hand for raw pipelining.

Every contender of the bench trains the same :class:`Workload`: the one-process rows and
our pipelines (``RankPipeline``, ``DistributedGPipeStrategy``) call the model's own forward
through :attr:`Workload.loss`, as a user's ``training_step`` does; raw
``torch.distributed.pipelining`` runs :attr:`Workload.raw_stage` modules, written by hand
as its users write them, with :attr:`Workload.raw_loss` as the schedule's ``loss_fn`` on
the last stage's output. Two workloads: our zoo MLP (``--model mlp``, the default) and a
transformers ``LlamaForCausalLM`` (``--model llama``), whose forward builds position ids,
rotary tables and a mask before its layers (:mod:`lightning_accel.benchmarks.pipeline_llama`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_accel.models import MLP

__all__ = ["MODELS", "Workload", "step_times", "workload"]

MODELS = ("mlp", "llama")
# per model: --depth (blocks), --hidden, --batch when not given
DEFAULTS = {"mlp": {"depth": 16, "hidden": 512, "batch": 1024}, "llama": {"depth": 8, "hidden": 256, "batch": 16}}


@dataclass(frozen=True)
class Workload:
    """One model and batch, and how each contender trains it.

    ``build()`` returns a fresh seeded copy of the model (the same weights every call), its
    inputs and its target. ``loss(net, inputs, target)`` is the user's loss on (part of) the
    batch through the model's own forward. ``raw_stage(net, rank, split)`` is stage ``rank``
    of 2 (blocks ``[:split]`` and ``[split:]``) built by hand from ``net``'s own modules;
    ``raw_loss(output, target)`` is the raw schedule's ``loss_fn`` on the last stage's output.
    """

    title: str  # says the model and batch in the table's heading
    blocks: int  # blocks the pipelines split (MLP blocks, decoder layers)
    unit: str  # what a batch row is ("rows", "sequences of 64 tokens")
    build: Callable[[], tuple[nn.Module, Any, Any]]
    loss: Callable[[nn.Module, Any, Any], Tensor]
    raw_stage: Callable[[nn.Module, int, int], nn.Module]
    raw_loss: Callable[[Tensor, Any], Tensor]


def _mlp(depth: int, hidden: int, batch: int) -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    net = MLP(hidden, hidden, hidden=hidden, depth=depth)
    g = torch.Generator().manual_seed(1)
    return net, torch.randn(batch, hidden, generator=g), torch.randn(batch, hidden, generator=g)


def _mlp_stage(net: nn.Module, rank: int, split: int) -> nn.Module:
    """Stages cut by hand, as a user of raw torch.distributed.pipelining writes them."""
    if rank == 0:
        return nn.Sequential(net.pre, *net.blocks[:split])
    return nn.Sequential(*net.blocks[split:], net.post)


def _llama_stage(net: nn.Module, rank: int, split: int) -> nn.Module:
    from lightning_accel.benchmarks.pipeline_llama import LlamaStage

    return LlamaStage(net, 0, split) if rank == 0 else LlamaStage(net, split, len(net.model.layers))


def workload(model: str, depth: int, hidden: int, batch: int, seq: int = 64, vocab: int = 2048) -> Workload:
    """The workload ``--model`` names, at the given size (``seq`` and ``vocab``: Llama only). Llama needs transformers:
    without it, a one-line error naming the extra."""
    if model == "mlp":
        return Workload(
            f"MLP depth {depth}, hidden {hidden}, batch {batch}", depth, "rows",
            lambda: _mlp(depth, hidden, batch), lambda net, x, y: F.mse_loss(net(x), y), _mlp_stage, F.mse_loss,
        )
    if model != "llama":
        raise ValueError(f"--model {model!r} is not one of {', '.join(MODELS)}")
    from lightning_accel.benchmarks.pipeline_llama import build_llama, causal_lm_loss, llama_loss

    def build() -> tuple[nn.Module, Tensor, Tensor]:
        net = build_llama(depth, hidden, vocab, seq)
        ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
        return net, ids, ids  # a causal LM's labels are its input ids (the loss shifts them)

    with torch.device("meta"):  # shapes only, to count the parameters
        params = sum(p.numel() for p in build_llama(depth, hidden, vocab, seq).parameters())
    return Workload(
        f"transformers LlamaForCausalLM ({params / 1e6:.1f}M parameters: {depth} layers, hidden {hidden}, vocab {vocab}), "
        f"batch {batch} x {seq} tokens", depth, f"sequences of {seq} tokens",
        build, llama_loss, _llama_stage, causal_lm_loss,
    )


def step_times(step: Callable[[], None], count: int) -> list[float]:
    """Seconds of each of ``count`` calls of ``step``, after 2 warm-up calls."""
    for _ in range(2):
        step()
    times = []
    for _ in range(count):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return times
