"""A profiler around an L2L fit sees the offload's labels: fetch, copy, release, gradients to the host, host step."""

from __future__ import annotations

from collections import Counter

import lightning.pytorch as pl
import pytest
import torch
from torch.profiler import ProfilerActivity, _ExperimentalConfig, profile
from torch.utils.data import DataLoader, TensorDataset

from lightning_accel.models import GPT, LanguageModelTask
from lightning_accel.plugins.precision import OffloadPrecision
from lightning_accel.strategies.l2l_offload import L2LOffloadStrategy

LABELS = ("l2l/fetch", "l2l/copy", "l2l/release", "l2l/grad_to_host", "l2l/host_step")


def _lm_data() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (24, 17), generator=g)
    return DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=8)


@pytest.mark.parametrize("overlap_step", [False, True], ids=["step-after-backward", "step-during-backward"])
def test_a_profiled_fit_has_the_offload_labels(overlap_step: bool) -> None:
    torch.manual_seed(0)
    steps, blocks = 3, 2
    # bf16 compute: the CPU "device" gets real copies (fp32 would alias the masters, nothing to copy)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=L2LOffloadStrategy(overlap_step=overlap_step),
                         plugins=[OffloadPrecision("bf16-mixed")], max_steps=steps, limit_val_batches=0, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = LanguageModelTask(GPT("tiny", n_layer=blocks, block_size=16))
    # torch's profiler records the thread that started it; the host-step thread only with profile_all_threads
    with profile(activities=[ProfilerActivity.CPU], experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        trainer.fit(model, _lm_data())
    events = [e for e in prof.events() if e.name.startswith("l2l/")]
    counts = Counter(e.name for e in events)
    assert set(counts) == set(LABELS), counts
    # one copy per block fetched: each block's forward and its recomputation, except the last block, which
    # stays on the device across the turn (2 x blocks - 1 per step); each released once
    assert counts["l2l/copy"] == counts["l2l/release"] == steps * (2 * blocks - 1), counts
    # a gradient's hand-over is one parameter's (labelled only while a profiler runs), the landing per unit
    hooked = sum(p.requires_grad for block in model.net.blocks for p in block.parameters())
    assert counts["l2l/grad_to_host"] > steps * hooked, counts
    main = next(e.thread for e in events if e.name == "l2l/copy")
    stepped_aside = {e.thread for e in events if e.name == "l2l/host_step"} - {main}
    if overlap_step:  # the blocks' steps ran on the host-step thread, during the backward, and were seen there
        assert trainer.strategy.offload_stats.blocks_stepped_in_backward == steps * blocks
        assert len(stepped_aside) == 1, counts
    else:
        assert not stepped_aside and counts["l2l/host_step"] >= steps, counts  # the update after each closure, and its tail
