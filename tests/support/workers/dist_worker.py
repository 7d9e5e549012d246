"""One rank of a 2-process pipeline test, launched the way Lightning's subprocess launcher does (env vars).

argv: OUT_DIR SCHEDULES MODES: SCHEDULES and MODES comma-separated (one launch runs every mode
for every schedule, one after another, to pay the start-up once); a mode is "train" (save this rank's gradients and loss per
schedule, and ``averaged.pt``: gradients of three dtypes averaged over both ranks in buckets of
at most 64 bytes), "die" (rank 1 exits in the middle of its first forward), "eval" (save
``eval-{schedule}-rank{r}.pt``: :meth:`RankPipeline.forward`'s output for each batch size of
:data:`EVAL_SIZES`, and the batch sizes each of this rank's stages saw, in order) or "raise" (:func:`raise_and_recover`);
"replicas" alone, on 4 ranks: :func:`replicas`.
"""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lightning_accel.models import MLP
from lightning_accel.pipeline.distributed import RankPipeline, average_gradients
from lightning_accel.pipeline.gradients import _sum_between, sum_over_users

EVAL_SIZES = (8, 7, 3, 1)  # with chunks=4: divides, does not divide, fewer samples than chunks, one sample


def eval_batch(size: int) -> torch.Tensor:
    return torch.randn(size, 6, generator=torch.Generator().manual_seed(size), dtype=torch.float64)


def evaluate(out: str, schedule: str, rank: int) -> None:
    torch.manual_seed(0)
    net = MLP(6, 3, hidden=16, depth=4).double().eval()
    balance = [1, 1, 1, 1] if schedule == "interleaved_1f1b" else [1, 3]
    pipe = RankPipeline(net, balance, chunks=4, loss_fn=F.mse_loss, schedule=schedule)
    seen: dict[int, list[int]] = {s: [] for s in pipe.indices}
    for stage, module in zip(pipe.indices, pipe.modules):
        module.blocks[0].register_forward_pre_hook(  # not its shadow runs, while another stage of this rank runs
            lambda _, args, stage=stage: seen[stage].append(args[0].size(0)) if pipe.boundaries.active_stage == stage else None
        )
    outputs = {size: pipe.forward(eval_batch(size)) for size in EVAL_SIZES}  # every rank passes the batch
    torch.save({"outputs": outputs, "seen": seen}, os.path.join(out, f"eval-{schedule}-rank{rank}.pt"))


class MyError(Exception):
    """The user's own exception type."""


def _raise(message: str) -> None:
    raise MyError(message)


def raise_and_recover(out: str, schedule: str, rank: int, pipe: RankPipeline, x: torch.Tensor, y: torch.Tensor) -> None:
    """Rank 0's first block raises at its first forward (the first step's shape inference), then rank 1's last block in
    the backward of the second step's micro-batch 1; each step ends on both ranks with what each raised (saved as type and
    message); the third step trains as if neither had happened. Then two evaluations raise (rank 0's block in a streamed
    micro-batch, the last stage's step on the whole batch) and a third streams the batch (``raise-{schedule}-rank{r}.pt``:
    errors, gradients, loss, the last evaluation's output)."""
    first, last = pipe.blocks[0], pipe.blocks[-1]
    calls = {"forward": 0, "backward": 0}

    def forward_hook(*_):
        calls["forward"] += 1
        if calls["forward"] == 1:
            _raise("first forward")

    def backward_hook(*_):
        calls["backward"] += 1
        if calls["backward"] == 2:
            _raise("second backward")

    hooks = [first.register_forward_pre_hook(forward_hook)] if rank == 0 else [last.register_full_backward_hook(backward_hook)]
    errors = []
    for _ in range(2):
        try:
            pipe.step(x, y)
            errors.append(None)
        except Exception as err:  # noqa: BLE001  # what reached this rank, as data
            errors.append((type(err).__name__, str(err), pipe.failure.in_backward))
        pipe.net.zero_grad(set_to_none=True)
    for h in hooks:
        h.remove()
    loss = pipe.step(x, y)
    grads = {n: p.grad for n, p in pipe.net.named_parameters() if not p.is_meta}
    # evaluation: rank 0's block raises in a streamed micro-batch; then the last stage's step on the whole batch
    hook = first.register_forward_pre_hook(lambda *_: _raise("evaluated")) if rank == 0 else None
    parts = x.tensor_split(pipe.eval_chunks(len(x)))
    for run in (lambda i: pipe.net(parts[i]) if i is not None else pipe.net(x),
                lambda i: pipe.net(parts[i]) if i is not None else _raise("whole batch")):
        try:
            pipe.evaluate(len(x), run)
            errors.append(None)
        except Exception as err:  # noqa: BLE001
            errors.append((type(err).__name__, str(err), pipe.failure.in_backward))
        if hook is not None:
            hook.remove()
            hook = None
    output = pipe.forward(x)  # and evaluation runs again
    torch.save({"errors": errors, "grads": grads, "loss": loss, "output": output}, os.path.join(out, f"raise-{schedule}-rank{rank}.pt"))


def replicas(out: str, schedule: str, rank: int) -> None:
    """4 ranks, two pipelines of 2 (ranks 0-1 and 2-3) told of failures together (``failure_group=None``): rank 0's
    block raises in the second step; every rank ends that step with an error at once, no replica waiting for the other
    (``replicas-rank{r}.txt``: the steps that trained, then the error's type and message)."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    torch.manual_seed(0)
    net = MLP(6, 3, hidden=16, depth=4).double()
    pipe = RankPipeline(net, [1, 3], chunks=4, loss_fn=F.mse_loss, schedule=schedule, group=groups[rank // 2], failure_group=None)
    calls = [0]

    def hook(*_):
        calls[0] += 1
        if rank == 0 and calls[0] == 6:  # the second step's first micro-batch (the first step ran 1 + 4 forwards)
            _raise("replica 0")

    pipe.blocks[0].register_forward_pre_hook(hook)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    seen = []
    try:
        for _ in range(3):
            pipe.step(x, y)
            seen.append("trained")
    except Exception as err:  # noqa: BLE001  # what reached this rank, as data
        seen.append(f"{type(err).__name__}: {err}")
    with open(os.path.join(out, f"replicas-rank{rank}.txt"), "w") as f:
        f.write(" | ".join(seen))


def main() -> None:
    out, schedules, modes = sys.argv[1], sys.argv[2], sys.argv[3].split(",")  # modes in turn, one process group
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=timedelta(seconds=int(os.environ.get("PIPE_TIMEOUT", "30"))))
    if modes == ["replicas"]:
        replicas(out, schedules, rank)
        dist.destroy_process_group()
        return
    for mode in modes:
        for schedule in schedules.split(","):
            if mode == "eval":
                evaluate(out, schedule, rank)
                continue
            torch.manual_seed(0)
            net = MLP(6, 3, hidden=16, depth=4).double()
            g = torch.Generator().manual_seed(1)
            x, y = torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64)
            balance = [1, 1, 1, 1] if schedule == "interleaved_1f1b" else [1, 3]
            pipe = RankPipeline(net, balance, chunks=4, loss_fn=F.mse_loss, schedule=schedule, record=True)
            if mode == "die" and rank == 1:
                pipe.modules[0].blocks[0].register_forward_pre_hook(lambda *_: os._exit(3))
            if mode == "raise":
                raise_and_recover(out, schedule, rank, pipe, x, y)
                continue
            try:
                loss = pipe.step(x, y)
            except RuntimeError as err:
                print(f"rank {rank} error: {err}", flush=True)
                os._exit(4)  # do not wait in destroy_process_group for a dead peer
            grads = {n: p.grad for n, p in net.named_parameters() if not p.is_meta}
            torch.save({"grads": grads, "loss": loss, "events": [tuple(e) for e in pipe.events()], "summed_bytes": pipe.summed_bytes},
                       os.path.join(out, f"{schedule}-rank{rank}.pt"))
        if mode == "train":  # rank r's gradients are r + 1 (and one parameter without a gradient)
            params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n, dtype in
                      [(3, torch.float32), (20, torch.float64), (5, torch.float32), (2, torch.bfloat16), (4, torch.float64)]]
            for i, p in enumerate(params[:-1]):
                p.grad = torch.full_like(p, rank + 1.0) * (i + 1)
            average_gradients(params, None, bucket_bytes=64)
            torch.save([p.grad for p in params], os.path.join(out, f"averaged-rank{rank}.pt"))
            # sum_over_users: users (0, 1), the whole group (an all-reduce); one user and none: left alone. _sum_between:
            # the sends and receives a strict subset of a larger group takes, here on both ranks. Rank r's gradients: r + 1
            params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n, dtype in
                      [(3, torch.float32), (4, torch.float64), (5, torch.float32), (2, torch.float64)]]
            for p in params[:3]:
                p.grad = torch.full_like(p, rank + 1.0)
            users = [(0, 1), (0, 1), (rank,), ()]
            summed = sum_over_users(params, users, rank, None)
            flat = torch.full((6,), rank + 1.0, dtype=torch.float64)
            _sum_between(flat, (0, 1), rank, None)  # what a strict subset of a larger group runs
            torch.save({"grads": [p.grad for p in params], "summed": summed, "between": flat}, os.path.join(out, f"users-rank{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
