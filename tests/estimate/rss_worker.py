"""Estimate, then train, CPU recipes in one process, run as a script: ``python rss_worker.py RECIPE...``.

Prints one JSON object: the process's resident set after its imports (``imported_rss``) and, per
recipe, the estimate's host bytes next to the peak RSS that two optimizer steps of the recipe's
module, strategy and precision added (:class:`~lightning_accel.host_memory.PeakRSS`), on random
tokens of the recipe's batch shape, and ``OffloadStats``' host figures under L2L. Each recipe is
first trained once at a batch of 1 x 8 tokens, so what a first fit initializes lazily (kernels,
thread pools) is already resident when the measured fit starts.
"""

from __future__ import annotations

import ctypes
import gc
import json
import sys
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.config.compose import compose_recipe
from lightning_accel.estimate import estimate_recipe
from lightning_accel.host_memory import PeakRSS, _status_bytes
from lightning_accel.runner import build_model, build_strategy

STEPS = 2


def _fit(recipe: str, overrides: list[str]) -> pl.Trainer:
    cfg = compose_recipe(recipe, overrides)
    module = build_model(cfg)
    b, t = int(cfg.data.batch_size), int(cfg.data.block_size)
    tokens = torch.randint(0, 256, (STEPS * b, t + 1))
    loader = DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=b)
    precision = cfg.trainer.get("precision")
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, strategy=build_strategy(cfg), plugins=[instantiate(p) for p in cfg.get("plugins") or []],
        **({"precision": precision} if precision is not None else {}), max_steps=STEPS, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, loader)
    return trainer


def _release() -> None:
    """Hand freed memory back to the system, so the next fit's peak starts from what is alive."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def measure(recipe: str) -> dict[str, Any]:
    estimate = estimate_recipe(recipe, [])
    _fit(recipe, ["data.batch_size=1", "data.block_size=8"])  # warm-up
    _release()
    with PeakRSS() as peak:
        trainer = _fit(recipe, [])
    stats = getattr(trainer.strategy, "offload_stats", None)
    out = {
        "estimate_host_bytes": estimate.host_total,
        "components": estimate.ranks[0].host,
        "peak_rss_added": peak.added,
        "offload_host_bytes": stats.host_bytes if stats is not None else None,
        "offload_host_optimizer_bytes": stats.host_optimizer_bytes if stats is not None else None,
    }
    del trainer
    _release()
    return out


if __name__ == "__main__":
    imported = _status_bytes("VmRSS")  # torch, Lightning, transformers and lightning_accel imported, nothing built
    results = {name: measure(name) for name in sys.argv[1:]}
    print(json.dumps({"imported_rss": imported, "recipes": results}))
