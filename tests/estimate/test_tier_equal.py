"""One plan, not two: the NVMe tier's plan ``estimate``, the preflight and ``bench offload --nvme`` compute
(:func:`lightning_accel.estimate.tier.module_tier`, on fake tensors) is the plan the strategy makes at set-up of a real
fit, figure for figure and line for line, whatever the plan chooses."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.estimate.tier import module_tier
from lightning_accel.models import GPT, LanguageModelTask
from lightning_accel.offload.tier_plan import TierPlan
from lightning_accel.plugins.precision import OffloadPrecision
from lightning_accel.strategies.l2l_offload import L2LOffloadStrategy


class Task(LanguageModelTask):
    """3 GPT blocks of 198k parameters (2.4 MB of AdamW state and masters each: a 1 MiB chunk is a third of one); with a
    4096-token vocabulary the resident unit (the embedding tied to the head) is 8.5 MB with its gradients and state."""

    def __init__(self, frozen: bool = False, vocab: int = 256) -> None:
        super().__init__(GPT("tiny", n_layer=3, block_size=8, vocab_size=vocab))
        if frozen:  # a fine-tune's shape: each block's attention a frozen bf16 base, its MLP trained
            for block in self.net.blocks:
                block.attn.to(torch.bfloat16).requires_grad_(False)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def _unnamed(plan: TierPlan) -> TierPlan:
    # (the strategy names its units in the LightningModule, the estimate in its net: "net.blocks.0" and "blocks.0")
    return dataclasses.replace(plan, units=tuple(dataclasses.replace(u, name="") for u in plan.units))


def _budget_that_streams_the_resident_unit(tmp_path: Path) -> int:
    kept, streamed = (module_tier(L2LOffloadStrategy(nvme_path=str(tmp_path), offload_resident=s, nvme_chunk="1MiB"), Task(vocab=4096), torch.float32,
                                  cuda=False)
                      for s in (False, True))
    assert kept is not None and streamed is not None and streamed.host_bytes < kept.host_bytes
    return streamed.host_bytes  # what only streaming the resident unit (the plan's choice, on a CPU device) keeps


CASES = {
    "unchunked": dict(strategy={}),
    "chunked": dict(strategy={"nvme_chunk": "1MiB"}),
    "frozen base, bf16-mixed": dict(strategy={}, frozen=True, precision="bf16-mixed"),
    "offload_resident": dict(strategy={"offload_resident": True}),
    "activations on host": dict(strategy={"offload_activations": True}),
    "accumulation: every gradient to the step": dict(strategy={"overlap_step": None}, trainer={"accumulate_grad_batches": 2}),
    "budget: the plan streams the resident unit": dict(strategy={"host_budget": "streams", "nvme_chunk": "1MiB"}, vocab=4096),
    "budget met in memory, no disk": dict(strategy={"host_budget": "1GB", "nvme_path": None}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_estimate_s_plan_is_the_one_the_strategy_makes_at_fit(case: str, tmp_path: Path) -> None:
    given: dict[str, Any] = CASES[case]
    options = {"nvme_path": str(tmp_path), **given["strategy"]}
    if options.get("host_budget") == "streams":
        options["host_budget"] = _budget_that_streams_the_resident_unit(tmp_path)
    frozen, precision, trainer, vocab = given.get("frozen", False), given.get("precision"), given.get("trainer", {}), given.get("vocab", 256)
    compute = torch.bfloat16 if precision == "bf16-mixed" else torch.float32
    estimated = module_tier(L2LOffloadStrategy(**options), Task(frozen, vocab), compute, cuda=False, trainer=trainer)

    strategy = L2LOffloadStrategy(**options)
    tokens = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(0))
    fit = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     plugins=[OffloadPrecision(precision)] if precision else None, **trainer)
    fit.fit(Task(frozen, vocab), DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=2))
    planned = strategy._tier_plan
    assert estimated is not None and planned is not None
    assert _unnamed(estimated) == _unnamed(planned)
    assert estimated.describe() == planned.describe()
    if case == "budget: the plan streams the resident unit":
        assert planned.held == 1 and "the resident unit streamed through the tier" in planned.describe()
    if case == "accumulation: every gradient to the step":
        assert planned.grads_in_flight is None
    if case == "chunked":
        assert planned.step_buffer == 2**20
