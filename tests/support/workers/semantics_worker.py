"""A user script for the pipeline's semantics under ``gpipe_distributed`` on 2 CPU processes (gloo), in float64.

Run as ``python semantics_worker.py OUT_DIR SECTIONS``: Lightning's launcher starts rank 1 from
it; SECTIONS is a comma-separated list of :data:`SECTIONS` names, every case of them one
``Trainer.fit`` in the same two processes (start-up paid once). After each fit rank 0 saves the
trained module's state (the whole model, gathered) as ``{case}.pt``, and every rank
``{case}-rank{r}.txt`` (``ok``). The section ``features`` runs :mod:`tests.support.lightning_features` (Lightning's
callbacks, epoch-end outputs, the module after fit). The section ``raising``, last, has rank 1's stage raise the user's
exception and saves what each rank got (``raising-rank{r}.txt``). The test computes the references
(plain Lightning, or ``gpipe`` in one process) from the same models and data (:func:`fit`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.strategies.gpipe_distributed import DistributedGPipeStrategy
from tests.support.lightning_features import run_on_two_ranks

STEPS = 3


class BatchNormBlocks(pl.LightningModule):
    """The mixed ``nn.Sequential`` of the docs, every layer a block: two BatchNorms are blocks of their own.
    ``inside``: two blocks of ``Linear, BatchNorm`` (the BatchNorm inside a block) and a head. A dropout before the
    first BatchNorm: its masks come from rank 0's generator, which the shape inference must leave alone."""

    def __init__(self, inside: bool = False, lr: float = 0.1) -> None:
        super().__init__()
        torch.manual_seed(0)
        if inside:
            self.net = nn.Sequential(
                nn.Sequential(nn.Linear(5, 8), nn.Dropout(0.3), nn.BatchNorm1d(8)),
                nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU()), nn.Linear(8, 3),
            )
        else:
            self.net = nn.Sequential(
                nn.Linear(5, 8), nn.Dropout(0.3), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8), nn.BatchNorm1d(8),
                nn.Linear(8, 3),
            )
        self.lr = lr

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class FirstBatchNorm(BatchNormBlocks):
    """A BatchNorm with ``momentum=None`` (the cumulative average, weighted by ``num_batches_tracked``) as the first block,
    on rank 0, where its inputs are the data (plain training's, whatever the weights); another inside rank 1's stage.
    Rank 1 runs rank 0's blocks on meta for their shapes: the meta run must not read the meta counter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.BatchNorm1d(5, momentum=None), nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 3),
        )


def data(n: int = 24) -> TensorDataset:
    g = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randn(n, 5, generator=g), torch.randn(n, 3, generator=g))


class Plain(BatchNormBlocks):
    """Three linear blocks and no BatchNorm (a micro-batch of one sample is fine)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


class Pair(nn.Module):
    """A block returning two tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(5, 8), nn.Linear(5, 8)

    def forward(self, x):
        return torch.tanh(self.a(x)), torch.sigmoid(self.b(x))


class Mix(nn.Module):
    """A block taking a pair and returning a pair."""

    def __init__(self) -> None:
        super().__init__()
        self.lin, self.gate = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, h, g):
        return torch.tanh(self.lin(h)) * g, g + 0.1 * self.gate(h)


class TupleNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Pair(), Mix(), Mix(), Mix()])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        out = self.blocks[0](x)
        for block in self.blocks[1:]:
            out = block(*out)
        h, g = out
        return self.head(h + g)


class Tuples(BatchNormBlocks):
    """Stages exchange a pair: the gradient of each element reaches the weights that made it (``b`` and ``gate`` only
    through the second). Validated too: evaluation streams the pair."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = TupleNet()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))


# case name -> (model, strategy options, loader batch size, samples, Trainer arguments)
def _bn_cases() -> dict[str, tuple]:
    """BatchNorm a block of its own in every checkpoint mode deferred at chunks 4, and at chunks 1 and 4 per
    micro-batch; inside a block, one case of each kind."""
    chosen = [
        ("own", "never", 4, True), ("own", "except_last", 4, True), ("own", "always", 4, True),
        ("own", "always", 1, False), ("own", "except_last", 4, False),
        ("inside", "never", 1, False), ("inside", "always", 4, False), ("inside", "except_last", 4, True),
    ]
    cases: dict[str, tuple] = {}
    for layout, checkpoint, chunks, deferred in chosen:
        name = f"bn-{layout}-{checkpoint}-{chunks}{'-deferred' if deferred else ''}"
        model = (lambda inside=layout == "inside": BatchNormBlocks(inside))
        cases[name] = (model, dict(chunks=chunks, checkpoint=checkpoint, deferred_batch_norm=deferred), 8, 24, {})
    return cases


def _bn_default_cases() -> dict[str, tuple]:
    """Deferred statistics accepted (deferred_batch_norm=True; not given, BatchNorm with micro-batches is refused),
    4 micro-batches: statistics once per batch."""
    return {"bn-first-default": (FirstBatchNorm, dict(chunks=4, balance=[3, 3], deferred_batch_norm=True), 8, 24, {})}


def _ragged_cases() -> dict[str, tuple]:
    """A whole epoch (plain Lightning's drop_last=False): a last batch smaller than chunks (2 of 34 in batches of 8:
    2 micro-batches of 1); a batch_size chunks does not divide (6: 3 of 2; the last 2: 2 of 1) under 1F1B; and one
    that no count fits (1F1B needs 2 micro-batches for 2 stages; the last batch of 33 has 1 sample): refused."""
    epoch = {"max_steps": -1, "max_epochs": 1}
    return {
        "ragged-last-smaller-gpipe": (Plain, dict(chunks=4, schedule="gpipe", checkpoint="except_last"), 8, 34, epoch),
        "ragged-batch6-1f1b": (Plain, dict(chunks=4, schedule="1f1b"), 6, 20, epoch),
        "ragged-refused-1f1b": (Plain, dict(chunks=4, schedule="1f1b"), 8, 33, epoch),
    }


def _tuple_cases() -> dict[str, tuple]:
    options = dict(balance=[2, 2], blocks=lambda net: list(net.blocks), checkpoint="except_last")
    return {
        "tuple-gpipe": (Tuples, dict(chunks=2, schedule="gpipe", **options), 8, 24, {}),
        "tuple-1f1b": (Tuples, dict(chunks=4, schedule="1f1b", **options), 8, 24, {}),
    }


def moe_loader() -> DataLoader:
    """32 token sequences in batches of 8 (tests/support/real_models.py)."""
    from tests.support.real_models import lm_loader

    return lm_loader()


def tiny_mixtral() -> pl.LightningModule:
    """transformers' Mixtral (mixture of experts: its experts call grouped_mm, which refuses meta float32) in float32,
    as a causal LM task (tests/support/real_models.py)."""
    import transformers

    from tests.support.real_models import VOCAB, CausalLM

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    )
    return CausalLM(transformers.MixtralForCausalLM(cfg))


class RouterLM(pl.LightningModule):
    """Mixtral's own loss with ``labels`` (cross-entropy plus 0.5 x the router's load-balancing loss over every layer),
    the padding ``attention_mask`` given, as a user with ``output_router_logits=True`` writes it; 4 layers, so each of 2
    ranks holds two MoE layers whose router statistics the loss needs."""

    def __init__(self) -> None:
        import transformers

        from tests.support.real_models import VOCAB

        super().__init__()
        torch.manual_seed(0)
        self.net = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
            num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
            output_router_logits=True, router_aux_loss_coef=0.5,
        ))

    def training_step(self, batch, batch_idx):
        tokens, _, mask = batch
        return self.net(input_ids=tokens, attention_mask=mask, labels=tokens.masked_fill(mask == 0, -100)).loss

    def validation_step(self, batch, batch_idx):
        tokens, _, mask = batch
        out = self.net(input_ids=tokens, attention_mask=mask, labels=tokens.masked_fill(mask == 0, -100))
        self.log("val_loss", out.loss)
        self.log("val_router_loss", out.aux_loss)  # the load-balancing loss over every layer, before its coefficient

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def run_router_loss(out: str) -> None:
    """RouterLM, 3 steps of 8 sequences in 2 micro-batches, 1f1b, float32, the user's shuffling loader with Lightning's
    defaults (its distributed sampler); rank 0 saves the trained state and what the strategy said about the router, and
    the trained model's validation metrics over the 4 batches (``moe-router-val.pt``); Lightning's sanity check has
    validated 2 batches before the first step (rank 1 then learns the structure of rank 0's MoE layer outputs from the
    evaluation's first message: before, it ran them on meta, which grouped_mm refuses in float32)."""
    import warnings

    os.environ.pop("PL_GLOBAL_SEED", None)  # run_moe's seed_everything(1): Lightning's sampler would shuffle by it
    task = RouterLM()
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=DistributedGPipeStrategy(chunks=2, schedule="1f1b", timeout=60), max_steps=3,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        val_check_interval=3,  # validation after the last step; Lightning's sanity check validates before the first
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(task, DataLoader(moe_loader().dataset, batch_size=8, shuffle=True), val_dataloaders=moe_loader())
    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in task.state_dict().items()}, os.path.join(out, "moe-router.pt"))
        said = [str(w.message) for w in caught if "output_router_logits" in str(w.message)]
        Path(out, "moe-router-said.txt").write_text("\n".join(said))
        validated = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val_")}
        torch.save(validated, os.path.join(out, "moe-router-val.pt"))


def run_moe(out: str) -> None:
    """A tiny Mixtral, 3 steps of 8 sequences in 2 micro-batches per step, float32; rank 0 saves the trained state."""
    task = tiny_mixtral()
    strategy = DistributedGPipeStrategy(chunks=2, timeout=60)
    pl.seed_everything(1, verbose=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
    )
    trainer.fit(task, moe_loader())
    if trainer.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in task.state_dict().items()}, os.path.join(out, "moe.pt"))


SECTIONS = {"batchnorm": _bn_cases, "bn_default": _bn_default_cases, "ragged": _ragged_cases, "tuples": _tuple_cases}


def fit(model: pl.LightningModule, loader: DataLoader, strategy, devices: int = 1, **kwargs) -> pl.Trainer:
    """``STEPS`` optimizer steps of ``model`` in float64 (unless ``kwargs`` say otherwise), seeded alike in every run
    (dropout masks)."""
    pl.seed_everything(1, verbose=False)
    kwargs = {"max_steps": STEPS, **kwargs}
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, precision="64-true", logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, **kwargs,
    )
    trainer.fit(model, loader)
    return trainer


class MyError(Exception):
    """The user's own exception type."""


class Raising(nn.Module):
    """A layer that raises :class:`MyError` at its ``at``-th forward."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, 0
        self.lin = nn.Linear(8, 3)

    def forward(self, x):
        self.calls += 1
        if self.calls == self.at:
            raise MyError(f"boom at forward {self.at}")
        return self.lin(x)


class RaisingModel(BatchNormBlocks):
    """Four blocks, the last (on rank 1) raising at the 5th micro-batch forward: the second step's first."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(5, 8), nn.ReLU(), nn.Linear(8, 8), Raising(at=5))


def _rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def run_cases(out: str, section: str) -> None:
    for name, (model, options, batch, n, kwargs) in SECTIONS[section]().items():
        task = model()
        strategy = DistributedGPipeStrategy(timeout=60, **{"blocks": lambda net: list(net), **options})
        try:
            trainer = fit(task, DataLoader(data(n), batch_size=batch), strategy, devices=2, **kwargs)
            message = "ok"
        except ValueError as err:  # refused before the first step, on every rank alike
            message = str(err)
        if _rank() == 0:  # after fit: the whole trained model (the other stage gathered)
            torch.save({k: v.detach().clone() for k, v in task.state_dict().items()}, os.path.join(out, f"{name}.pt"))
        if isinstance(task, Tuples):  # the trained model, split again, streams a batch of 8
            message += f" val_loss={trainer.validate(task, DataLoader(data(8)), verbose=False)[0]['val_loss']!r}"
        with open(os.path.join(out, f"{name}-rank{_rank()}.txt"), "w") as f:
            f.write(message)


class SeesException(pl.Callback):
    """Keeps the type of what on_exception was handed."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.seen.append(type(exception).__name__)


class RaisingInValidation(BatchNormBlocks):
    """validation_step raises MyError on its second batch, before calling the network (so on rank 0 first)."""

    def validation_step(self, batch, batch_idx):
        if batch_idx == 1:
            raise MyError(f"boom in validation batch {batch_idx}")
        self.log("val_loss", F.mse_loss(self(batch[0]), batch[1]))


class SkipsAfterTheCall(Plain):
    """training_step returns None (Lightning's 'skip this batch') on its second batch, after calling the network."""

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return None if batch_idx == 1 else loss


def run_raising(out: str) -> None:
    """Rank 1's last block raises MyError in the second step, then (a second fit) validation_step raises, then (a third)
    training_step returns None after calling the network (the batch skipped, as under DDP with one replica);
    each rank saves what reached it, what on_exception got and whether its module is whole after the fit, and exits at
    once (the last section)."""
    for name, model, kwargs in [("raising", RaisingModel(), {}), ("raising-validation", RaisingInValidation(), {"val": True}),
                                ("raising-none", SkipsAfterTheCall(), {})]:
        balance = {"raising": [2, 2], "raising-validation": [4, 3], "raising-none": [3, 2]}[name]
        strategy = DistributedGPipeStrategy(chunks=4, balance=balance, blocks=lambda net: list(net), timeout=60,
                                            deferred_batch_norm=True)  # a BatchNorm in RaisingInValidation's blocks
        seen = SeesException()
        loader = DataLoader(data(24), batch_size=8)
        try:
            trainer = pl.Trainer(
                accelerator="cpu", devices=2, strategy=strategy, precision="64-true", logger=False, max_steps=STEPS,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                use_distributed_sampler=False, num_sanity_val_steps=0, callbacks=[seen],
            )
            trainer.fit(model, loader, loader if kwargs else None)
            message = "trained"
        except MyError as err:
            message = f"MyError: {err}"
        except Exception as err:  # noqa: BLE001  # anything else, as data
            message = f"{type(err).__name__}: {err}"
        whole = not any(t.is_meta for t in model.state_dict().values())
        if name == "raising-none" and _rank() == 0:  # trained on, the skipped batch left out: the whole module
            torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, os.path.join(out, f"{name}.pt"))
        with open(os.path.join(out, f"{name}-rank{_rank()}.txt"), "w") as f:
            f.write(f"{message} | on_exception: {','.join(seen.seen)} | whole: {whole}")
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    out, sections = sys.argv[1], sys.argv[2].split(",")
    torch.set_num_threads(1)
    for section in sections:
        if section == "raising":  # last: it ends the processes
            run_raising(out)
        if section == "moe":
            run_moe(out)
            run_router_loss(out)
            continue
        if section == "features":  # Lightning's features (tests/support/lightning_features.py): one fit per case
            run_on_two_ranks(out)
            continue
        run_cases(out, section)


if __name__ == "__main__":
    main()
