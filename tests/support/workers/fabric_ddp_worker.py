"""litgpt's loops on 2 CPU processes (gloo) under ``Fabric(strategy="l2l_offload_ddp")`` and under Fabric's own DDP.

Run as ``python fabric_ddp_worker.py OUT_DIR``: the first ``fabric.launch()`` starts rank 1 by running this script
again (Fabric's subprocess launcher); every later ``Fabric`` in the same processes joins the same process group. Each
rank trains on its own batches (as a ``DistributedSampler`` would hand them out) and writes ``rank{r}.pt``: the
weights after each case (litgpt's ``finetune/full.py`` loop with accumulation under ``no_backward_sync``, its
``pretrain.py`` loop clipping by norm, and by value with the replicated host step, ``bf16-mixed``, a resume from
``fabric.save``, fp16 with a loss scaler, the NVMe tier, the fine-tuning loop again on a model built on meta and given its weights by ``fabric.load_raw``), the
model's output after the loop, the averagings a run started, and what ``all_reduce`` / ``all_gather`` / ``broadcast``
returned.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.fabric.plugins.precision import MixedPrecision

import lightning_accel  # noqa: F401  (registers the names with Fabric)
from lightning_accel.fabric import L2LOffloadDDPStrategy
from tests.support.fabric_loops import (batches, chunked_cross_entropy, config, finetune_full, fresh, gpt, litgpt, pretrain,
                                       weights)

BATCHES = 4  # per rank: 2 optimizer steps with accumulation 2
FP16_SCALE = 2.0**19  # the first step's scaled fp16 gradients overflow: a skipped step, a lowered scale


def _fabric(strategy: Any, precision: str | None = "32-true", **kwargs: Any) -> L.Fabric:
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy, precision=precision, **kwargs)
    fabric.launch()
    return fabric


def _counting(fabric: L.Fabric, counts: list[int]) -> None:
    """Count the backwards whose gradients the engine starts averaging (none inside ``no_backward_sync``)."""
    engine = fabric.strategy.offload
    sync = engine._grad_sync
    begin = sync.begin

    def counted() -> None:
        counts.append(len(counts) + 1)
        begin()

    sync.begin = counted


def main() -> None:
    out = Path(sys.argv[1])
    torch.set_num_threads(1)
    first = _fabric("ddp")  # starts rank 1
    rank = first.global_rank
    start = gpt()  # float64, the same on every rank (rank 0's is sent to the others anyway)
    data = batches(BATCHES, seed=1 + rank)  # this rank's share
    result: dict[str, Any] = {}

    reference, _ = finetune_full(first, fresh(start), data)
    result["finetune-ddp"] = weights(reference)
    with torch.no_grad():
        result["output-ddp"] = reference(data[0][:, :-1])
    ours = _fabric("l2l_offload_ddp")
    model, optimizer = finetune_full(ours, fresh(start), data, save_to=out / "finetune.ckpt")
    result["finetune"] = weights(model)
    result["host_optimizer_bytes"] = ours.strategy.offload.host_optimizer_bytes()
    result["gathered_bytes"] = ours.strategy.offload.gathered_bytes

    # the same loop again, on a model built on meta (fabric.init_module) given the start's weights by fabric.load_raw,
    # with fabric.backward(loss, model=model), counting the averagings
    torch.save(start.state_dict(), out / f"start-rank{rank}.pt")
    averaged: list[int] = []
    again = _fabric("l2l_offload_ddp")
    with again.init_module(empty_init=True):
        model = litgpt.GPT(config()).double()
    result["built_on_meta"] = all(p.is_meta for p in model.parameters())
    model = again.setup(model)
    again.load_raw(out / f"start-rank{rank}.pt", model)
    optimizer = again.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1))
    _counting(again, averaged)
    for i, batch in enumerate(data, start=1):  # finetune_full's steps
        input_ids, targets = batch[:, :-1], batch[:, 1:]
        with again.no_backward_sync(model, enabled=i % 2 != 0):
            logits = model(input_ids)
            loss = chunked_cross_entropy(logits[..., :-1, :], targets[..., :-1])
            again.backward(loss / 2, model=model)
        if i % 2 == 0:
            optimizer.step()
            optimizer.zero_grad()
    result["averaged"] = len(averaged)
    result["again"] = weights(model)
    with torch.no_grad():  # the module after the loop, for inference
        result["output"] = model(data[0][:, :-1])
    trained = model

    # resume: the first half, saved; a model with other weights loads it and runs the second half
    half = _fabric("l2l_offload_ddp")
    finetune_full(half, fresh(start), data[:2], save_to=out / "half.ckpt", setup_together=True)  # fabric.setup(model, optimizer)
    resumed = _fabric("l2l_offload_ddp")
    model, _ = finetune_full(resumed, gpt(seed=5), data[2:], resume=out / "half.ckpt")
    result["resumed"] = weights(model)
    # Fabric's DDP resuming from our checkpoint
    plain = _fabric("ddp")
    result["resumed-ddp"] = weights(finetune_full(plain, gpt(seed=5), data[2:], resume=out / "half.ckpt")[0])

    result["pretrain-ddp"] = weights(pretrain(_fabric("ddp"), fresh(start), data)[0])
    result["pretrain"] = weights(pretrain(_fabric("l2l_offload_ddp"), fresh(start), data)[0])
    result["value-ddp"] = weights(pretrain(_fabric("ddp"), fresh(start), data, max_norm=None, clip_val=1e-3)[0])
    result["value"] = weights(pretrain(_fabric(L2LOffloadDDPStrategy(host_step="replicated")), fresh(start), data,
                                       max_norm=None, clip_val=1e-3)[0])

    start32 = gpt(torch.float32)
    result["bf16-ddp"] = weights(finetune_full(_fabric("ddp", "bf16-mixed"), fresh(start32), data[:2])[0])
    result["bf16"] = weights(finetune_full(_fabric("l2l_offload_ddp", "bf16-mixed"), fresh(start32), data[:2])[0])

    # fp16 with a loss scale the first step's gradients overflow: skipped on every rank, the scale halved, as under DDP
    for name, strategy in (("fp16-ddp", "ddp"), ("fp16", "l2l_offload_ddp")):
        scaler = torch.amp.GradScaler("cpu", init_scale=FP16_SCALE)
        fabric = _fabric(strategy, None, plugins=[MixedPrecision("16-mixed", "cpu", scaler)])
        result[name] = weights(finetune_full(fabric, fresh(start32), data, accumulation=1)[0])
        result[f"{name}-scale"] = scaler.get_scale()

    # the NVMe tier on each rank (every block's state and masters in its files): the run in memory, bit for bit
    tiered = _fabric(L2LOffloadDDPStrategy(nvme_path=str(out / "nvme")))
    result["tier"] = weights(finetune_full(tiered, fresh(start), data, save_to=out / "tier.ckpt")[0])
    result["tier_plan"] = tiered.strategy.offload._tier_plan.describe()

    # Fabric's collectives under the strategy
    result["all_reduce"] = ours.all_reduce(torch.tensor(float(rank + 1)), reduce_op="mean")
    result["all_gather"] = ours.all_gather(torch.tensor([rank]))
    result["broadcast"] = ours.broadcast(f"from rank {rank}", src=0)
    ours.barrier()
    again.strategy.teardown()  # the executor detached, the module's own forward back: it computes as before
    with torch.no_grad():
        result["output-torn-down"] = trained(data[0][:, :-1])
    torch.save(result, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
