"""Training loops written as litgpt writes them on Lightning Fabric, for any ``Fabric(strategy=...)``.

:func:`finetune_full` follows litgpt's ``finetune/full.py`` fit loop (accumulation under ``fabric.no_backward_sync``,
``chunked_cross_entropy`` on shifted targets, ``fabric.backward(loss / accumulation)``, a step and ``zero_grad``
when not accumulating, ``fabric.save`` of the state); :func:`pretrain` follows ``pretrain.py`` (the learning rate
set per iteration, ``fabric.clip_gradients(max_norm=...)`` before the step). The model is litgpt's ``GPT`` (or its
LoRA variant) from a tiny ``Config``; the data are fixed random token batches. Nothing is downloaded.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

litgpt = pytest.importorskip("litgpt")
from litgpt.utils import chunked_cross_entropy  # noqa: E402

VOCAB, SEQ = 32, 8


def config(**kwargs: Any) -> Any:
    """A tiny litgpt ``Config``: 3 blocks, width 16 (``kwargs``: LoRA fields for :func:`lora_gpt`)."""
    cls = litgpt.lora.Config if any(k.startswith("lora") for k in kwargs) else litgpt.Config
    return cls(block_size=SEQ, vocab_size=VOCAB, padded_vocab_size=VOCAB, n_layer=3, n_head=2, n_embd=16, **kwargs)


def gpt(dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Module:
    """litgpt's ``GPT`` from :func:`config`, in ``dtype``, initialized from ``seed``."""
    torch.manual_seed(seed)
    return litgpt.GPT(config()).to(dtype)


def lora_gpt(seed: int = 0) -> nn.Module:
    """litgpt's LoRA ``GPT`` (r=4 on query and value) with a frozen bf16 base (loaded as people load a checkpoint),
    fp32 adapters trainable (``litgpt.lora.mark_only_lora_as_trainable``)."""
    torch.manual_seed(seed)
    model = litgpt.lora.GPT(config(lora_r=4, lora_alpha=8, lora_dropout=0.0, lora_query=True, lora_value=True))
    for name, param in model.named_parameters():
        if "lora_" not in name:
            param.data = param.data.to(torch.bfloat16)
        else:  # litgpt zeroes lora_B: start from a non-zero update, so the base's gradient path is exercised too
            torch.nn.init.normal_(param, std=0.02)
    litgpt.lora.mark_only_lora_as_trainable(model)
    return model


def batches(n: int, batch_size: int = 4, seed: int = 1) -> list[Tensor]:
    """``n`` fixed batches of ``SEQ + 1`` tokens (inputs and shifted targets come from one row, as in pretrain.py)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch_size, SEQ + 1), generator=g) for _ in range(n)]


def finetune_full(fabric: Any, model: nn.Module, batches: list[Tensor], accumulation: int = 2, lr: float = 1e-2,
                  save_to: Path | None = None, setup_together: bool = False, resume: Path | None = None) -> tuple[Any, Any]:
    """litgpt's ``finetune/full.py`` loop (``resume``: its ``fabric.load`` of a saved state before the loop). Returns
    the set-up model and optimizer."""
    if setup_together:  # fabric.setup(model, optimizer), as most Fabric code writes it
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.1)
        model, optimizer = fabric.setup(model, optimizer)
    else:  # litgpt: the model first, then the optimizer over its parameters
        model = fabric.setup(model)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.1)
        optimizer = fabric.setup_optimizers(optimizer)
    state = {"model": model, "optimizer": optimizer, "iter_num": 0, "step_count": 0}
    if resume is not None:
        fabric.load(resume, state)
    for batch in batches:
        state["iter_num"] += 1
        batch = fabric.to_device(batch)
        input_ids, targets = batch[:, :-1], batch[:, 1:]
        is_accumulating = state["iter_num"] % accumulation != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            logits = model(input_ids)
            loss = chunked_cross_entropy(logits[..., :-1, :], targets[..., :-1])
            fabric.backward(loss / accumulation)
        if not is_accumulating:
            optimizer.step()
            optimizer.zero_grad()
            state["step_count"] += 1
    if save_to is not None:
        fabric.save(save_to, state)
    return model, optimizer


def pretrain(fabric: Any, model: nn.Module, batches: list[Tensor], accumulation: int = 2, lr: float = 1e-2,
             max_norm: float | None = 0.05, clip_val: float | None = None, warmup: int = 2) -> tuple[Any, Any]:
    """litgpt's ``pretrain.py`` loop: the learning rate set each iteration (linear warm-up, cosine decay), clipping by
    norm (or by value with ``clip_val``) before each step. Returns the set-up model and optimizer."""
    model = fabric.setup(model)
    optimizer = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95)))
    iters = len(batches)
    for iter_num, batch in enumerate(batches, start=1):
        progress = min(iter_num / warmup, 1.0) * 0.5 * (1 + math.cos(math.pi * iter_num / iters))
        for group in optimizer.param_groups:
            group["lr"] = lr * progress
        batch = fabric.to_device(batch)
        input_ids, targets = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        is_accumulating = iter_num % accumulation != 0
        with fabric.no_backward_sync(model, enabled=is_accumulating):
            logits = model(input_ids)
            loss = chunked_cross_entropy(logits, targets, chunk_size=4)  # chunked: a list of logits joined in the loss
            fabric.backward(loss / accumulation)
        if not is_accumulating:
            if clip_val is not None:
                fabric.clip_gradients(model, optimizer, clip_val=clip_val)
            elif max_norm is not None:
                fabric.clip_gradients(model, optimizer, max_norm=max_norm)
            optimizer.step()
            optimizer.zero_grad()
    return model, optimizer


def weights(model: nn.Module) -> dict[str, Tensor]:
    """The model's state, detached copies on the CPU."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def max_difference(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    """The largest elementwise difference over the entries of ``a`` (which ``b`` must all have)."""
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def fresh(model: nn.Module) -> nn.Module:
    """A copy of ``model`` to train (the original stays the common start)."""
    return copy.deepcopy(model)
