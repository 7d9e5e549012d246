"""A user script whose ``training_step`` logs what changes from step to step, on 2 CPU processes (gloo).

Run as ``python step_report_worker.py OUT_DIR``: Lightning's subprocess launcher re-runs
this script for rank 1. Under 1F1B the last rank (1) runs ``training_step`` once per micro-batch and sends every rank
the loss and what it logged, reduced over the micro-batches (under GPipe, the default, every rank runs the step once and
logs its own values); each rank saves ``rank{r}.pt``: per step, every ``self.log`` call
the strategy made on that rank (name, value, options), the loss ``training_step`` returned
there, and how many ``broadcast_object_list`` calls the step made (the strategy's object
path, taken only when the logged names, options or kinds of value changed). After fit it
destroys the process group, as a script should, and at exit writes ``threads-at-exit-rank{r}.txt``:
how many gloo threads are still alive when interpreter teardown begins (the strategy's groups must be gone).
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import Any


_EXIT_REPORT: list[str] = []  # the file _gloo_threads_at_exit writes, once main knows this rank


def _gloo_threads_at_exit() -> None:
    tasks = f"/proc/{os.getpid()}/task"
    names = [open(f"{tasks}/{t}/comm").read().strip() for t in os.listdir(tasks)] if os.path.isdir(tasks) else None
    alive = -1 if names is None else sum(n.startswith(("pt_gloo", "gloo_tcp")) for n in names)
    for path in _EXIT_REPORT:
        with open(path, "w") as f:
            f.write(str(alive))


if __name__ == "__main__":  # registered before the strategy's module registers its exit hook, so it runs after it
    atexit.register(_gloo_threads_at_exit)


import lightning.pytorch as pl
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.models import MLP
from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy

STEPS = 10
# steps on which the logged names or kinds of value differ from the step before (step 0: nothing cached yet)
CHANGED = [0, 2, 4, 5, 6, 7]


def bits(value: Any) -> tuple:
    """A logged value down to its type, dtype, shape and bits, for exact comparison across ranks."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.reshape(-1).view(torch.uint8).tolist())
    return (type(value).__name__, repr(value))


def expected_logs(step: int, loss: torch.Tensor) -> list[tuple[str, Any, dict]]:
    """What ``training_step`` logs at ``step`` for a batch loss ``loss`` (float32): the reference the test checks."""
    logs: list[tuple[str, Any, dict]] = [
        ("always", loss, {"prog_bar": True}),
        ("step_int", step, {}),
        ("half", (loss * 3).to(torch.bfloat16), {"batch_size": 4}),
        ("count", torch.tensor(step * 1000, dtype=torch.int64), {"reduce_fx": "max"}),
    ]
    if step in (2, 3):
        logs.append(("sometimes", step / 3, {}))  # logged only on some steps
    logs.append(("phase_a" if step < 5 else "phase_b", loss * 2, {}))  # a name that changes
    if step == 6:
        logs.append(("np32", np.float32(step + 0.25), {}))  # not a number to the strategy: the object path
    return logs


class Logging(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = MLP(4, 1, hidden=8, depth=2)
        self.seen: list[list[tuple[str, Any, dict]]] = [[] for _ in range(STEPS)]

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        x, y = batch
        out = self.net(x)
        loss = F.mse_loss(out, y)
        # every micro-batch logs the same kinds; the strategy reduces them over the micro-batches like the loss
        for name, value, kw in expected_logs(batch_idx, loss):
            self.log(name, value, **kw)
        return {"loss": loss, "mae": (out - y).abs().mean().detach()}  # a key beside the loss: the batch's, on every rank

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        """What the strategy logs on this rank after the step (inside training_step it sees its own stand-in)."""
        stored = value.detach().clone() if isinstance(value, torch.Tensor) else value
        self.seen[self.trainer.global_step].append((name, stored, dict(kwargs)))
        super().log(name, value, *args, **kwargs)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Record(pl.Callback):
    """Per step: the loss returned, and the ``broadcast_object_list`` calls made during the step."""

    def __init__(self) -> None:
        self.returned: list[torch.Tensor] = []
        self.others: list[list[Any]] = []  # per step: the keys on_train_batch_end got, and the mean absolute error
        self.object_calls: list[int] = []
        self.calls = 0
        real = dist.broadcast_object_list

        def counting(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return real(*args, **kwargs)

        dist.broadcast_object_list = counting

    def on_train_batch_start(self, trainer: pl.Trainer, *_: Any) -> None:
        self.calls = 0

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any) -> None:
        self.returned.append(outputs["loss"].detach().clone())
        self.object_calls.append(self.calls)
        self.others.append([sorted(outputs), outputs["mae"].clone()])


def main() -> None:
    out = sys.argv[1]
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(4 * STEPS, 4, generator=g), torch.randn(4 * STEPS, 1, generator=g))
    task, record = Logging(), Record()
    trainer = pl.Trainer(
        max_epochs=1, accelerator="cpu", devices=2, strategy=DistributedGPipeStrategy(chunks=2, balance=[1, 1], schedule="1f1b", timeout=60),
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[record],
    )
    trainer.fit(task, DataLoader(data, batch_size=4))
    torch.save(
        {"seen": task.seen, "returned": record.returned, "object_calls": record.object_calls, "others": record.others},
        os.path.join(out, f"rank{trainer.global_rank}.pt"),
    )
    _EXIT_REPORT.append(os.path.join(out, f"threads-at-exit-rank{trainer.global_rank}.txt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
