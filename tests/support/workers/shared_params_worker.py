"""Two ranks of :class:`RankPipeline` on transformers models, for which parameters outside the blocks get summed.

Run by ``tests/pipeline/test_distributed.py`` as ``python shared_params_worker.py OUT_DIR MODELS MODE``: for each
model of ``tests/support/real_models.py`` in MODELS (comma-separated), float64, 2 stages of a 3-layer model, 2
micro-batches (one block per stage on more than 2 ranks), 2 steps of one batch with the gradients zeroed between them. Saves ``{model}-rank{r}.pt``: the
second step's gradients this rank holds, its users per parameter outside the blocks, and the bytes it summed per step.
First, ``late-rank{r}.txt``: the refusal when a stage starts using a parameter only another stage used before.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_accel.models import MLP
from lightning_accel.pipeline.distributed import RankPipeline
from tests.support.real_models import BUILDERS, VOCAB, lm_loader


def lm_loss(out, y):
    return F.cross_entropy(out.logits.reshape(-1, VOCAB), y.reshape(-1))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    x, y, _mask = next(iter(lm_loader()))
    return x, y


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    net = BUILDERS[name]().double()
    net.config.use_cache = False
    return net


class LateUser(MLP):
    """The zoo MLP whose output also reads ``pre.bias`` (a first-stage weight) once ``late`` is set: from then on the
    last stage uses a parameter that only the first one used at its first step."""

    late = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out + self.pre.bias.sum() * 0 if self.late else out


def late_user(out: Path, rank: int) -> None:
    """Two steps of :class:`LateUser`, ``late`` at the second: ``late-rank{r}.txt`` holds the error every rank raised."""
    torch.manual_seed(0)
    net = LateUser(6, 3, hidden=16, depth=2).double()
    pipe = RankPipeline(net, [1, 1], chunks=2, loss_fn=F.mse_loss)
    x, y = torch.randn(4, 6, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    pipe.step(x, y)
    net.late = True
    try:
        pipe.step(x, y)
    except RuntimeError as err:
        (out / f"late-rank{rank}.txt").write_text(str(err))


def main() -> None:
    out, models = Path(sys.argv[1]), sys.argv[2].split(",")
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=int(os.environ.get("PIPE_TIMEOUT", "30"))))
    world = dist.get_world_size()
    if world == 2:
        late_user(out, rank)
    for name in models:
        net = build(name)
        pipe = RankPipeline(net, [2, 1] if world == 2 else [1] * world, chunks=2, loss_fn=lm_loss)
        x, y = batch()
        summed = []
        for _ in range(2):
            net.zero_grad(set_to_none=True)
            pipe.step(x, y)
            summed.append(pipe.summed_bytes)
        names = {id(p): n for n, p in net.named_parameters()}
        torch.save(
            {
                "grads": {n: p.grad for n, p in net.named_parameters() if not p.is_meta and p.grad is not None},
                "users": {names[id(p)]: u for p, u in zip(pipe.shared_params, pipe.users)},
                "summed": summed,
            },
            out / f"{name}-rank{rank}.pt",
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
