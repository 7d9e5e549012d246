"""A user script unfreezing, freezing again and pruning under ``L2LOffloadDDPStrategy`` on 2 CPU processes (gloo).

Run as ``python unfreeze_ddp_worker.py OUT_DIR CASE[,CASE...]``: Lightning's subprocess launcher re-runs this script
for the other rank. A case is ``{case}-{how}[-{extra}]``: ``case`` one of :data:`tests.support.unfreeze_models.CASES`,
``how`` ``part`` (host step partitioned), ``repl`` (replicated) or ``ddp`` (Lightning's DDP), extras ``bf16``
(OffloadPrecision('bf16-mixed') on the fp32 model: the thawed matrices get bf16 shadows), ``delayed``
(delayed_update from the first step) and ``tier`` (the NVMe tier under ``OUT_DIR/nvme``, no host budget: laid out
again at each change). Each case is one run of :func:`~tests.support.unfreeze_models.fit_case` in the
same processes; every rank writes ``{case}-rank{r}.pt`` (its weights, the units it steps, its optimizer state's bytes
and the host bytes per parameter) and rank 0 writes ``{case}.ckpt`` (what DDP would write: one plain optimizer state).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader

from lightning_accel.plugins.precision import OffloadPrecision
from lightning_accel.strategies.l2l_offload_ddp import L2LOffloadDDPStrategy
from tests.support.unfreeze_models import PER_RANK_BATCH, Transfer, data, fit_case, weights


class StateInMemory(pl.Callback):
    """The optimizer state the rank holds in memory for host parameters at the end of training (the tier still open)."""

    nbytes: int | None = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.nbytes = trainer.strategy.host_optimizer_bytes()


def run(out: str, case: str) -> None:
    name, how, *extras = case.split("-")
    bf16 = "bf16" in extras
    task = Transfer(torch.float32 if bf16 else torch.float64)
    kwargs: dict[str, Any] = {"devices": 2}
    if how == "ddp":
        strategy: Any = "ddp"
        if bf16:
            kwargs["precision"] = "bf16-mixed"
    else:
        options: dict[str, Any] = {"delayed_update": True, "delayed_update_warmup": 0} if "delayed" in extras else {}
        if "tier" in extras:
            options["nvme_path"] = os.path.join(out, "nvme")

        def strategy() -> L2LOffloadDDPStrategy:
            return L2LOffloadDDPStrategy(host_step="partitioned" if how == "part" else "replicated", timeout=60, **options)

        if bf16:
            kwargs["plugins"] = [OffloadPrecision("bf16-mixed")]
    # shuffled: Lightning's DistributedSampler(shuffle=True, seed 0), which GlobalBatches replays on one process
    seen = StateInMemory()
    trainer = fit_case(name, task, DataLoader(data(2), batch_size=PER_RANK_BATCH, shuffle=True), strategy,
                       callbacks_too=[seen] if how != "ddp" else [], **kwargs)[-1]
    trainer.save_checkpoint(os.path.join(out, f"{case}.ckpt"))
    result: dict[str, Any] = {"weights": weights(task)}
    if isinstance(trainer.strategy, L2LOffloadDDPStrategy):
        strategy_ = trainer.strategy
        names = {id(p): n for n, p in task.named_parameters()}
        stats = strategy_.offload_stats
        result.update(
            owned=sorted(names[id(p)] for p in strategy_.owned_parameters()),
            host_optimizer_bytes=strategy_.host_optimizer_bytes(), host_bytes=stats.host_bytes,
            offloaded_params=stats.offloaded_params, nvme_bytes=stats.nvme_bytes, state_in_memory=seen.nbytes,
        )
    torch.save(result, os.path.join(out, f"{case}-rank{trainer.global_rank}.pt"))


def main() -> None:
    out, cases = sys.argv[1], sys.argv[2].split(",")
    torch.set_num_threads(1)
    for case in cases:
        run(out, case)


if __name__ == "__main__":
    main()
