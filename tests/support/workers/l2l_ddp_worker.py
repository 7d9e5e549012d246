"""A user script training with ``L2LOffloadDDPStrategy`` and with plain Lightning DDP on N CPU processes (gloo).

Run as ``python l2l_ddp_worker.py OUT_DIR DEVICES CASE[,CASE...]``: Lightning's subprocess launcher
re-runs this script for the other ranks. Each case is one ``Trainer.fit`` in the same processes
(start-up paid once); every rank writes ``{case}-rank{r}.pt`` (its weights after fit, the losses,
the bytes of optimizer state it holds for block parameters and in all, the bytes reduced and
gathered in the last step) and rank 0 writes ``{case}.ckpt``.

Case names: ``{model}-{how}[-{extra}]``; model ``gpt64`` (zoo GPT, float64), ``gpt32``, ``gptbf16``
(OffloadPrecision / Lightning's bf16-mixed), ``gpt16`` (fp16 with a loss scaler), ``llama64`` (transformers Llama, float64); how ``ddp``
(Lightning's DDP), ``part`` (partitioned host step) or ``repl`` (replicated); extras ``accclip``
(accumulate 2 batches, clip the norm at 0.05), ``act`` (offload_activations), ``resident`` (offload_resident:
the embeddings and head stream from the host too, a fifth unit of the partition), ``delayed``
(delayed_update after 1 warm-up step), ``2ep`` (two epochs),
``resumed`` (two epochs from ``gpt64-part.ckpt``), ``hooks`` (a callback records what ``on_after_backward`` shows:
every parameter's gradient and the whole model's norm), ``acc`` (accumulate 2 batches), ``tier`` (the NVMe tier,
both ranks under ``OUT_DIR/nvme`` with no host budget: every block's optimizer state, masters and shadows on disk;
``resumed`` then starts from ``{model}-{how}-tier.ckpt``), ``budget`` (the tier under a host budget per rank that
keeps part of it in memory), ``block`` (``llama64`` saved with ``save_pretrained`` before the first fit, built on meta
and loaded by block into each rank's tier: ``hf_causal_lm(load_by_block=True)``). Rank-local results also hold the rank's optimizer state and, with the tier, its plan
line and its scratch directory during the fit.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import grad_norm
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.models import GPT, LanguageModelTask
from lightning_accel.plugins.precision import OffloadPrecision
from lightning_accel.strategies.l2l_offload_ddp import L2LOffloadDDPStrategy

PER_RANK_BATCH = 4
SEQUENCES = 32
CLIP = 0.05  # below the first steps' gradient norm (~0.3): clipping acts
FP16_SCALE = 2.0**19  # the first steps' scaled fp16 gradients overflow: skipped steps, a lowered scale
TIER_BUDGET = "500kB"  # per rank, gpt32: a rank's own half of the AdamW state fits beside every master (all of it would not)


def gpt_task(dtype: torch.dtype = torch.float64) -> LanguageModelTask:
    """The zoo GPT, 4 blocks, tied embedding and head, AdamW with weight decay."""
    torch.manual_seed(0)
    net = GPT("tiny", n_layer=4, n_embd=16, n_head=2, block_size=8, vocab_size=32)
    return LanguageModelTask(net, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)).to(dtype)


def gpt_data(world: int = 2) -> TensorDataset:
    """16 sequences per rank: 4 batches of ``PER_RANK_BATCH`` each."""
    g = torch.Generator().manual_seed(3)
    x = torch.randint(0, 32, (SEQUENCES // 2 * world, 8), generator=g)
    return TensorDataset(x, torch.roll(x, -1, dims=1))


class GlobalBatches:
    """The global batches N DDP ranks train on (Lightning's DistributedSampler, seed 0, each rank's
    ``PER_RANK_BATCH``), concatenated in rank order: one process on these sees what the ranks see together."""

    def __init__(self, n: int, world: int) -> None:
        self.n, self.world = n, world
        self.sampler = self  # Lightning sets the epoch on ``batch_sampler.sampler``
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        from torch.utils.data import DistributedSampler

        shards = []
        for rank in range(self.world):
            sampler = DistributedSampler(range(self.n), num_replicas=self.world, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(self.epoch)
            shards.append(list(sampler))
        for start in range(0, len(shards[0]), PER_RANK_BATCH):
            yield [i for shard in shards for i in shard[start : start + PER_RANK_BATCH]]

    def __len__(self) -> int:
        return self.n // self.world // PER_RANK_BATCH


def llama_task() -> pl.LightningModule:
    from tests.support.real_models import real_task

    return real_task("llama", torch.float64)


def llama_loader() -> DataLoader:
    from tests.support.real_models import lm_loader

    return lm_loader(n=SEQUENCES, batch_size=PER_RANK_BATCH)


class Losses(pl.Callback):
    def __init__(self) -> None:
        self.returned: list[float] = []
        self.norms: list[float] = []  # the whole model's gradient norm before each step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.returned.append(float(outputs["loss"]))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if isinstance(trainer.strategy, L2LOffloadDDPStrategy):  # each rank may hold a share: a collective
            self.norms.append(float(trainer.strategy.grad_norm(2)))
        else:
            self.norms.append(float(grad_norm(pl_module, 2)["grad_2.0_norm_total"]))


class AfterBackward(pl.Callback):
    """What ``on_after_backward`` shows, per call: every parameter's gradient (a copy, or None) and the whole model's
    norm (Lightning's ``grad_norm`` under DDP; ``strategy.grad_norm``, a collective, under the offload strategy)."""

    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor | None]] = []
        self.norms: list[float] = []

    def on_after_backward(self, trainer, pl_module):
        self.grads.append({n: None if p.grad is None else p.grad.detach().cpu().clone() for n, p in pl_module.named_parameters()})
        if isinstance(trainer.strategy, L2LOffloadDDPStrategy):
            self.norms.append(float(trainer.strategy.grad_norm(2)))
        else:
            self.norms.append(float(grad_norm(pl_module, 2)["grad_2.0_norm_total"]))


class TierSeen(pl.Callback):
    """The rank's NVMe tier directory while it trains (its files are gone after fit)."""

    def __init__(self) -> None:
        self.directory: str | None = None
        self.files: list[str] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        tier = trainer.strategy._executor.tier
        if tier is not None and self.directory is None:
            self.directory, self.files = tier.directory, sorted(os.listdir(tier.directory))


def fit(out: str, devices: int, case: str) -> None:
    model, how, *extras = case.split("-")
    task = llama_task() if model == "llama64" else gpt_task(torch.float32 if model in ("gpt32", "gptbf16", "gpt16") else torch.float64)
    if "block" in extras:  # the same Llama, saved, built on meta and loaded by block into each rank's tier
        from lightning_accel.models.hf import hf_causal_lm
        from tests.support.real_models import CausalLM

        task = CausalLM(hf_causal_lm(pretrained_path=os.path.join(out, "llama64-saved"), dtype="float64", load_by_block=True))
    data = llama_loader() if model == "llama64" else DataLoader(gpt_data(devices), batch_size=PER_RANK_BATCH)
    kwargs: dict[str, Any] = {}
    if "accclip" in extras:
        kwargs.update(accumulate_grad_batches=2, gradient_clip_val=CLIP)
    if "acc" in extras:
        kwargs.update(accumulate_grad_batches=2)
    plugins = []
    if how == "ddp":
        strategy: Any = "ddp"
        if model == "gptbf16":
            kwargs["precision"] = "bf16-mixed"
        if model == "gpt16":  # Lightning's 16-mixed on the CPU has no scaler; give it one
            plugins.append(MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=FP16_SCALE)))
    else:
        tier = {"nvme_path": os.path.join(out, "nvme")} if {"tier", "budget", "block"} & set(extras) else {}
        if "budget" in extras:
            tier["host_budget"] = TIER_BUDGET
        strategy = L2LOffloadDDPStrategy(host_step="partitioned" if how == "part" else "replicated",
                                         offload_activations="act" in extras, offload_resident="resident" in extras, timeout=60,
                                         **({"delayed_update": True, "delayed_update_warmup": 1} if "delayed" in extras else {}),
                                         **tier)
        if model == "gptbf16":
            plugins.append(OffloadPrecision("bf16-mixed"))
        if model == "gpt16":
            plugins.append(OffloadPrecision("16-mixed", init_scale=FP16_SCALE))
    epochs = 2 if {"2ep", "resumed"} & set(extras) else 1
    losses, after_backward, tier_seen = Losses(), AfterBackward(), TierSeen()
    trainer = pl.Trainer(
        max_epochs=epochs, accelerator="cpu", devices=devices, strategy=strategy, plugins=plugins, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[losses, *([after_backward] if "hooks" in extras else []), *([tier_seen] if how != "ddp" else [])], **kwargs,
    )
    ckpt = os.path.join(out, f"{model}-{how}{'-tier' if 'tier' in extras else ''}.ckpt") if "resumed" in extras else None
    if "resumed" in extras and how == "ddp":
        ckpt = os.path.join(out, "gpt64-part.ckpt")  # DDP resumes from the partitioned strategy's checkpoint
    trainer.fit(task, data, ckpt_path=ckpt)
    trainer.save_checkpoint(os.path.join(out, f"{case}.ckpt"))
    result: dict[str, Any] = {
        "weights": {k: v.detach().cpu().clone() for k, v in task.state_dict().items()},
        "losses": losses.returned,
        "norms": losses.norms,
        "after_backward": after_backward.grads,
        "after_backward_norms": after_backward.norms,
        "scale": float(trainer.precision_plugin.scaler.get_scale()) if getattr(trainer.precision_plugin, "scaler", None) else None,
        "optimizer_bytes": sum(
            v.numel() * v.element_size() for s in trainer.optimizers[0].state.values() for v in s.values() if torch.is_tensor(v)
        ),
    }
    if isinstance(trainer.strategy, L2LOffloadDDPStrategy):
        strategy = trainer.strategy
        names = {id(p): n for n, p in task.named_parameters()}
        result.update(
            host_optimizer_bytes=strategy.host_optimizer_bytes(),
            owned=sorted(names[id(p)] for p in strategy.owned_parameters()),
            reduced_bytes=strategy.reduced_bytes, gathered_bytes=strategy.gathered_bytes,
            reduced_in_backward=strategy.reduced_in_backward,
            optimizer_state={i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
                             for i, s in trainer.optimizers[0].state_dict()["state"].items()},
            tier_plan=strategy._tier_plan.describe() if strategy._tier_plan is not None else None,
            tier_directory=tier_seen.directory, tier_files=tier_seen.files,
            nvme_bytes=strategy.offload_stats.nvme_bytes, nvme_read_bytes=strategy.offload_stats.nvme_read_bytes,
        )
    torch.save(result, os.path.join(out, f"{case}-rank{trainer.global_rank}.pt"))


def main() -> None:
    out, devices, cases = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
    torch.set_num_threads(1)
    if any("block" in c.split("-") for c in cases) and os.environ.get("LOCAL_RANK", "0") == "0":
        llama_task().net.save_pretrained(os.path.join(out, "llama64-saved"))  # before rank 1 exists (the first fit starts it)
    for case in cases:
        fit(out, devices, case)


if __name__ == "__main__":
    main()
