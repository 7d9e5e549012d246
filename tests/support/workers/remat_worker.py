"""One rank of the 2-process re-materialization test, launched with Lightning-style env vars.

argv: OUT_DIR SCHEDULES MODES (both comma-separated). Per schedule, checkpoint mode and M in {1, 2, 4, 8} (from 2 for 1f1b):
two steps on the same weights (the first one warms up: torch infers the stages' shapes on it),
then saves this rank's gradients of the second step and how many times each block ran
forward during it (a re-materialized micro-batch runs twice).
"""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_accel.models import MLP
from lightning_accel.pipeline.distributed import RankPipeline



def chunk_counts(schedule: str) -> tuple[int, ...]:
    """M in {1, 2, 4, 8}; 1F1B on 2 stages needs M >= 2."""
    return (2, 4, 8) if schedule == "1f1b" else (1, 2, 4, 8)


def main() -> None:
    out, schedules, modes = sys.argv[1], sys.argv[2].split(","), sys.argv[3].split(",")
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=int(os.environ.get("PIPE_TIMEOUT", "30"))))
    results = {}
    for schedule in schedules:
        for mode in modes:
            for chunks in chunk_counts(schedule):
                torch.manual_seed(0)
                net = MLP(6, 3, hidden=16, depth=4).double()
                g = torch.Generator().manual_seed(1)
                x = torch.randn(8, 6, generator=g, dtype=torch.float64)
                y = torch.randn(8, 3, generator=g, dtype=torch.float64)
                pipe = RankPipeline(net, [1, 3], chunks, F.mse_loss, schedule=schedule, checkpoint=mode)
                calls = [0]
                for block in pipe.modules[0].blocks:
                    # a pre-hook on the block's first layer (the recompute calls the block's forward, not the block), as
                    # the recompute stops once it has what backward needs, maybe inside the last block
                    first = next(block.children(), block)
                    first.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
                pipe.step(x, y)
                for p in pipe.parameters():
                    p.grad = None
                calls[0] = 0
                pipe.step(x, y)
                # a parameter outside the blocks has a gradient only on the rank that uses it
                grads = {n: p.grad for n, p in net.named_parameters() if not p.is_meta and p.grad is not None}
                results[(schedule, mode, chunks)] = {"grads": grads, "calls": calls[0], "blocks": len(pipe.modules[0].blocks)}
    torch.save(results, os.path.join(out, f"remat-rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
