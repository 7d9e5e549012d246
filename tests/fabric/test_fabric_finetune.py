"""A QLoRA fine-tune in a Fabric loop under ``l2l_offload``: peft LoRA on a Llama whose block Linears are torchao NF4.
The adapters' update equals Fabric's own strategy's (bf16-mixed rounding only), the NF4 base stays bit-identical and of
its type, and the host keeps it at its stored size."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torch import nn

pytest.importorskip("peft")
pytest.importorskip("torchao")

import lightning_accel  # noqa: E402,F401  (registers the names with Fabric)
from lightning_accel.fabric import L2LOffloadStrategy  # noqa: E402

from tests.support.finetune_models import adapters, assert_frozen_unchanged, frozen, lora_llama, relative_update_difference  # noqa: E402


def _finetune(strategy: Any) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], nn.Module]:
    net = lora_llama(nf4=True, layers=2)
    start, base = adapters(net), frozen(net)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy, precision="bf16-mixed")
    fabric.launch()
    model = fabric.setup(net)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3))
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        ids = torch.randint(0, 128, (4, 17), generator=g)
        logits = model(input_ids=ids[:, :-1]).logits
        fabric.backward(nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten()))
        optimizer.step()
        optimizer.zero_grad()
    assert_frozen_unchanged(base, net)  # the NF4 weights: never written, still NF4
    return start, adapters(net), net


def test_qlora_under_l2l_trains_the_adapters_as_fabric_and_keeps_the_nf4_base_as_stored() -> None:
    start, reference, _ = _finetune("auto")
    strategy = L2LOffloadStrategy()
    _, trained, _ = _finetune(strategy)
    assert relative_update_difference(start, reference, trained) < 1e-5  # measured 1.7e-7: rounding only
    assert 0.518 < strategy.offload_stats.host_bytes_per_param < 0.8  # NF4 ~0.52 B a frozen parameter, plus the adapters
