"""Two ranks of :class:`RankPipeline` on transformers models, for which parameters outside the blocks get summed.

Run by ``tests/pipeline/test_distributed.py`` as ``python resident_worker.py OUT_DIR MODELS MODE``: for each
model of ``tests/strategies/real_models.py`` in MODELS (comma-separated), float64, 2 stages of a 3-layer model, 2
micro-batches, 2 steps of one batch with the gradients zeroed between them. Saves ``{model}-rank{r}.pt``: the
second step's gradients this rank holds, its users per parameter outside the blocks, and the bytes it summed per step.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "strategies"))
from real_models import BUILDERS, VOCAB, lm_loader  # noqa: E402

from lightning_accel.pipeline.distributed import RankPipeline  # noqa: E402


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


def main() -> None:
    out, models = Path(sys.argv[1]), sys.argv[2].split(",")
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=int(os.environ.get("PIPE_TIMEOUT", "30"))))
    for name in models:
        net = build(name)
        pipe = RankPipeline(net, [2, 1], chunks=2, loss_fn=lm_loss)
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
                "users": {names[id(p)]: u for p, u in zip(pipe.resident, pipe.users)},
                "summed": summed,
            },
            out / f"{name}-rank{rank}.pt",
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
