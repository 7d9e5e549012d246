"""Estimate, then train, CPU recipes, run as a script: ``python rss_worker.py RECIPE...``.

Prints one JSON object: the process's resident set after its imports (``imported_rss``) and, per
recipe, the estimate's host bytes next to the peak RSS that two optimizer steps of the recipe's
module, strategy and precision added (:class:`~lightning_accel.host_memory.PeakRSS`, the module
built inside the measured span), on random batches of the recipe's batch shape (token windows or
images, as :func:`~lightning_accel.estimate.batch.item_shapes` reads them off its data module),
and ``OffloadStats``' host figures under L2L. Each recipe first trains one step as shipped, so
what a first fit initializes lazily (kernels, thread pools, oneDNN's primitives for the batch's
shapes) is already resident when the measured fit starts.

A ``gpipe_distributed`` recipe runs as its processes (2 gloo ranks on this machine, this script
with ``--rank``; all such recipes in one pair, started while this process measures the others),
each measuring its own peak against its stage's estimate: per rank (``ranks``), and added up
for the recipe as for the others.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import threading
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.utils import instantiate
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.config.compose import compose_recipe
from lightning_accel.estimate import estimate_recipe
from lightning_accel.estimate.batch import item_shapes
from lightning_accel.host_memory import PeakRSS, _status_bytes
from lightning_accel.runner import build_model, build_strategy

STEPS = 2


def _loader(cfg: Any, steps: int) -> DataLoader:
    """``steps`` batches of random items of the recipe's shapes: byte tokens, or images and class 0/1."""
    (x_shape, x_dtype), (y_shape, _) = item_shapes(instantiate(cfg.data))
    n = steps * int(cfg.data.batch_size)
    # seeded alike in every process: a gpipe_distributed recipe's ranks must load the same batches (they are checked)
    gen = torch.Generator().manual_seed(0)
    if x_dtype == torch.long:  # token windows, the targets shifted by one
        tokens = torch.randint(0, 256, (n, x_shape[0] + 1), generator=gen)
        x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    else:
        x, y = torch.randn(n, *x_shape, dtype=x_dtype, generator=gen), torch.randint(0, 2, (n, *y_shape), generator=gen)
    return DataLoader(TensorDataset(x, y), batch_size=int(cfg.data.batch_size))


def _fit(recipe: str, steps: int) -> pl.Trainer:
    cfg = compose_recipe(recipe, [])
    module = build_model(cfg)
    precision = cfg.trainer.get("precision")
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(cfg.trainer.get("devices") or 1), strategy=build_strategy(cfg),
        plugins=[instantiate(p) for p in cfg.get("plugins") or []], **({"precision": precision} if precision is not None else {}),
        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, _loader(cfg, steps))
    return trainer


def _release() -> None:
    """Hand freed memory back to the system, so the next fit's peak starts from what is alive."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _measured_fit(recipe: str) -> tuple[int | None, Any]:
    """A warm-up step, then the peak RSS two steps add, building the module included."""
    _fit(recipe, 1)
    _release()
    with PeakRSS() as peak:
        trainer = _fit(recipe, STEPS)
    stats = getattr(trainer.strategy, "offload_stats", None)
    figures = (stats.host_bytes, stats.host_optimizer_bytes) if stats is not None else (None, None)
    del trainer
    _release()
    return peak.added, figures


def _ranks(recipes: list[str], into: dict[str, Any]) -> None:
    """The ``gpipe_distributed`` recipes in one pair of processes (the process group outlives a fit): each rank's peak."""
    from lightning_accel.benchmarks.two_ranks import rank_result, run_two_ranks

    try:
        outputs = run_two_ranks([__file__, "--rank", *recipes], timeout=600)
        into.update(results=sorted((rank_result(o) for o in outputs), key=lambda r: r["rank"]))
    except Exception as err:  # re-raised in the main thread
        into.update(error=err)


def measure_all(recipes: list[str]) -> dict[str, Any]:
    """Every recipe's estimate and measured peak; the ``gpipe_distributed`` ones run as 2 processes meanwhile."""
    estimates = {name: estimate_recipe(name, []) for name in recipes}
    out: dict[str, Any] = {
        name: {"strategy": e.strategy, "estimate_host_bytes": e.host_total, "components": e.ranks[0].host} for name, e in estimates.items()
    }
    distributed = [name for name, e in estimates.items() if e.strategy == "gpipe_distributed"]
    for name in distributed:
        assert [r.count for r in estimates[name].ranks] == [1, 1], f"{name}: the worker launches 2 processes of one stage each"
    ranks: dict[str, Any] = {}
    thread = threading.Thread(target=_ranks, args=(distributed, ranks))
    if distributed:
        thread.start()
    for name in recipes:
        if name not in distributed:
            out[name]["peak_rss_added"], (out[name]["offload_host_bytes"], out[name]["offload_host_optimizer_bytes"]) = _measured_fit(name)
    if distributed:
        thread.join()
        if "error" in ranks:
            raise ranks["error"]
        for name in distributed:
            added = [r["peak_rss_added"][name] for r in ranks["results"]]
            out[name]["ranks"] = [{"estimate_host_bytes": e.host_bytes, "peak_rss_added": a} for e, a in zip(estimates[name].ranks, added)]
            out[name]["peak_rss_added"] = sum(added) if all(a is not None for a in added) else None
    return out


if __name__ == "__main__":
    if sys.argv[1] == "--rank":  # the processes of gpipe_distributed recipes, under run_two_ranks' environment
        peaks = {name: _measured_fit(name)[0] for name in sys.argv[2:]}
        print("RESULT " + json.dumps({"rank": int(os.environ["RANK"]), "peak_rss_added": peaks}), flush=True)
        os._exit(0)  # skip the interpreter's teardown of a gloo group still referenced
    imported = _status_bytes("VmRSS")  # torch, Lightning, transformers and lightning_accel imported, nothing built
    print(json.dumps({"imported_rss": imported, "recipes": measure_all(sys.argv[1:])}))
