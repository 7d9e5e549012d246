"""A frozen base's block Linear weights in torchao NF4, as QLoRA and torchtune's QLoRA build it.

Each ``nn.Linear`` inside the transformer blocks (found by the blocks policy the
strategies share, :func:`~lightning_accel.models.block_policy.find_blocks`) gets its weight
replaced by ``to_nf4(weight, block_size, scaler_block_size)``: 4-bit NormalFloat codes per
64 values, their scalers quantized again to int8 per 256 (double quantization), about 0.52
bytes a parameter, stored as ``nn.Parameter(nf4, requires_grad=False)``. The embeddings,
norms and the head stay as they are. ``F.linear`` on an NF4 weight dequantizes it to the
input's dtype (torchao's ``__torch_function__``), so the Linear and peft's LoRA around it
work unchanged.

torchao's ``to_nf4`` needs each weight's element count to be a multiple of ``block_size *
scaler_block_size``; a weight that is not is refused in one line before anything is
quantized. On the meta device (the pre-run check) only that check runs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence

import torch
from torch import nn

from lightning_accel.config.errors import UserError, one_line
from lightning_accel.models.block_policy import find_blocks
from lightning_accel.models.extras import import_extra

# where to_nf4 lives: torchao 0.18 exports it from torchao.quantization; before it moved there, torchao.dtypes.nf4tensor
NF4_MODULES = ("torchao.quantization", "torchao.dtypes.nf4tensor")


def block_linears(net: nn.Module, names: Sequence[str] | None = None) -> list[tuple[str, nn.Linear]]:
    """The ``nn.Linear`` modules inside ``net``'s blocks (qualified names), in order; with ``names``,
    those of the whole model whose name ends with one of them (``q_proj`` or ``layers.0.mlp.up_proj``)."""
    if names is not None:
        return [(n, m) for n, m in net.named_modules() if isinstance(m, nn.Linear) and any(_ends_with(n, x) for x in names)]
    try:
        blocks = find_blocks(net, "auto", stacks="all")  # an encoder-decoder: both stacks
    except ValueError as err:
        raise UserError(
            f"model/adapter=qlora quantizes the Linears of {type(net).__name__}'s repeated blocks, and it has none "
            f"({one_line(str(err)).split(';')[0]}); name the Linears to quantize: model.adapter.quantize_modules=[q_proj,v_proj]"
        ) from None
    found = []
    for block in blocks:
        for name, module in block.module.named_modules():
            if isinstance(module, nn.Linear):
                found.append((f"{block.name}.{name}" if name else block.name, module))
    return found


def _ends_with(qualified: str, name: str) -> bool:
    return qualified == name or qualified.endswith(f".{name}")


def check_nf4_shapes(linears: Sequence[tuple[str, nn.Linear]], block_size: int, scaler_block_size: int) -> None:
    """Refuse, in one line, the first weight ``to_nf4`` cannot quantize with these block sizes."""
    group = block_size * scaler_block_size
    for name, module in linears:
        numel = module.weight.numel()
        if numel % group == 0:
            continue
        if numel % block_size:
            fix = f"set model.adapter.block_size to a divisor of {numel} (64 is QLoRA's)"
        else:
            blocks = numel // block_size
            fits = max(s for s in (256, 128, 64, 32, 16, 8, 4, 2, 1) if blocks % s == 0)
            fix = f"set model.adapter.scaler_block_size={fits} (it must divide {numel} / {block_size} = {blocks})"
        raise UserError(
            f"model.adapter: {name}.weight {tuple(module.weight.shape)} has {numel} elements, not a multiple of "
            f"block_size x scaler_block_size = {block_size} x {scaler_block_size} = {group} as torchao's to_nf4 needs; "
            f"{fix}, or leave it unquantized by listing the Linears to quantize in model.adapter.quantize_modules"
        )


def load_to_nf4() -> Callable[..., torch.Tensor]:
    """torchao's ``to_nf4`` from where the installed version keeps it; a missing torchao names the extra."""
    import_extra("torchao", "finetune", "model/adapter=qlora")
    for path in NF4_MODULES:
        try:
            return importlib.import_module(path).to_nf4
        except (ImportError, AttributeError):
            continue
    raise UserError(f"model/adapter=qlora: this torchao has no to_nf4 in {' or '.join(NF4_MODULES)}; pip install \"torchao>=0.13\"")


def quantize_nf4(net: nn.Module, block_size: int = 64, scaler_block_size: int = 256, names: Sequence[str] | None = None) -> int:
    """Replace the block Linear weights of ``net`` by frozen NF4 ones, in place; returns how many.

    On the meta device the shapes are checked and nothing is quantized.
    """
    linears = block_linears(net, names)
    if not linears:
        what = f"named {list(names)}" if names is not None else "inside its blocks"
        raise UserError(
            f"model.adapter: {type(net).__name__} has no nn.Linear {what} to quantize; "
            "check model.adapter.quantize_modules (null: every Linear of the blocks), or use model/adapter=lora"
        )
    check_nf4_shapes(linears, block_size, scaler_block_size)
    if any(module.weight.is_meta for _, module in linears):
        return 0
    to_nf4 = load_to_nf4()
    for _, module in linears:
        with torch.no_grad():
            nf4 = to_nf4(module.weight.detach().contiguous(), block_size, scaler_block_size)
        module.weight = nn.Parameter(nf4, requires_grad=False)
    return len(linears)
