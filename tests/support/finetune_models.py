"""What people fine-tune, tiny: a transformers Llama loaded in bf16, its base frozen, peft LoRA on q/v, and the
same with the base's block Linear weights in torchao NF4 (QLoRA as torchtune builds it). Shared by the strategy
tests of fine-tuning (l2l_offload, gpipe, gpipe_distributed, l2l_offload_ddp workers).

The reference for each strategy is plain Lightning in ``bf16-mixed`` from the same start and data; a pipeline that
splits each batch into micro-batches is compared with plain Lightning accumulating over the same micro-batches (in
bf16, two half-batch matmuls round differently from one whole-batch one, so the split itself moves AdamW's update by
~2% on this model whatever the strategy). Nothing is downloaded.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_accel.stored import plain_parts

# every block Linear's numel a multiple of 64 * 256, as torchao's to_nf4 (block 64, scaler block 256) needs
SMALL = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=4)
# LoRA r=8 on q/v is 0.6% of a block here, as on a 7B model (0.4%): what the host bytes per parameter are judged on
WIDE = dict(hidden_size=512, intermediate_size=1024, num_attention_heads=8, num_key_value_heads=8)


def to_nf4(weight: Tensor) -> Tensor:
    nf4 = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")
    return nf4.to_nf4(weight, 64, 256)


def lora_llama(nf4: bool = False, dims: dict[str, int] | None = None, layers: int = 4, vocab: int = 128) -> nn.Module:
    """A random-init Llama in bf16 (as ``from_pretrained(dtype=torch.bfloat16)`` gives), optionally with NF4 block
    Linear weights, wrapped by peft's LoRA (r=8, q_proj/v_proj; B initialised non-zero so A and B both train)."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, num_hidden_layers=layers, max_position_embeddings=64, **(dims or SMALL))
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    if nf4:
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear) and ".layers." in f".{name}":
                module.weight = nn.Parameter(to_nf4(module.weight.data), requires_grad=False)
    return peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))


def adapters(net: nn.Module) -> dict[str, Tensor]:
    """The trainable parameters (the adapters), in float32, by name."""
    return {n: p.detach().float().clone() for n, p in net.named_parameters() if p.requires_grad}


def frozen(net: nn.Module) -> dict[str, tuple[type, list[Tensor]]]:
    """Each frozen parameter's type and stored bytes (an NF4 weight's codes and scalers), copied."""
    return {n: (type(p), [t.detach().clone() for t in plain_parts(p)]) for n, p in net.named_parameters() if not p.requires_grad}


def assert_frozen_unchanged(before: dict[str, tuple[type, list[Tensor]]], net: nn.Module) -> None:
    """Every frozen parameter of ``net`` is of the type it had and bit-identical to ``before``."""
    after = frozen(net)
    assert after.keys() == before.keys()
    for name, (kind, parts) in before.items():
        assert after[name][0] is kind, f"{name}: {kind.__name__} became {after[name][0].__name__}"
        assert len(after[name][1]) == len(parts) and all(torch.equal(a, b) for a, b in zip(after[name][1], parts)), name


def relative_update_difference(start: dict[str, Tensor], reference: dict[str, Tensor], other: dict[str, Tensor]) -> float:
    """|other - reference| / |reference - start| over all adapters: how far the update is from the reference's."""
    diff = sum(((other[k] - reference[k]) ** 2).sum() for k in reference) ** 0.5
    update = sum(((reference[k] - start[k]) ** 2).sum() for k in reference) ** 0.5
    return float(diff / update)


def state_entries(state: dict[str, Any], prefix: str = "net.") -> dict[str, Any]:
    """A LightningModule checkpoint's state dict by the net's own names."""
    return {k.removeprefix(prefix): v for k, v in state.items()}


def qlora_task(layers: int = 4, vocab: int = 128) -> Any:
    """Our own fine-tune, as ``model/adapter=qlora`` builds it: a bf16 Llama (seed 0) in a ``LanguageModelTask`` whose
    ``QLoRA`` adapter quantizes the block Linears to NF4 and adds LoRA on q/v; its checkpoints leave the base out."""
    transformers = pytest.importorskip("transformers")
    from lightning_accel.models.adapters import QLoRA
    from lightning_accel.models.tasks import LanguageModelTask

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, num_hidden_layers=layers, max_position_embeddings=64, **SMALL)
    net = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    return LanguageModelTask(net, adapter=QLoRA(target_modules=["q_proj", "v_proj"]))
