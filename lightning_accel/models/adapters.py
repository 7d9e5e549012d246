"""Adapters on a frozen base, the ``model.adapter`` option: peft LoRA, and QLoRA (LoRA over an NF4 base).

``model/adapter=lora`` builds :class:`LoRA` from the recipe's or the command line's keys:
``r``, ``alpha``, ``dropout``, ``target_modules`` and any other field of peft's
``LoraConfig`` (``+model.adapter.use_rslora=true``); an unknown key is refused in one line.
``model/adapter=qlora`` (:class:`QLoRA`) first turns the base's block Linear weights into
torchao NF4 (:mod:`.quantize`), then adds the same adapters. The task applies the adapter
to its net in ``__init__`` (``LanguageModelTask(net, adapter=...)``), so every strategy
sees the peft model; peft freezes the base, and parameter names stay peft's own
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``).
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

from torch import nn

from lightning_accel.config.errors import UserError, close_matches, one_line
from lightning_accel.models.extras import import_extra, plain
from lightning_accel.models.quantize import load_to_nf4, quantize_nf4

peft = import_extra("peft", "finetune", "model.adapter")

# our short names for LoraConfig's fields
_ALIASES = {"alpha": "lora_alpha", "dropout": "lora_dropout"}
# peft's own get_peft_model calls transformers' deprecated name: nothing a user can change
_PEFT_NOISE = r".*`is_gradient_checkpointing` is deprecated"


class LoRA:
    """peft LoRA adapters on a frozen base.

    Args:
        r: the adapters' rank.
        alpha: LoRA's scaling numerator (the update is scaled by ``alpha / r``).
        dropout: dropout on the adapters' input.
        target_modules: names of the modules to adapt (``[q_proj, v_proj]``), ``all-linear``,
            or None: peft's default for the architecture (q_proj and v_proj for Llama).
        config: any other ``peft.LoraConfig`` field, by its name.
    """

    name = "lora"

    def __init__(self, r: int = 8, alpha: float = 16, dropout: float = 0.0, target_modules: Any = None, **config: Any) -> None:
        fields = {f.name for f in dataclasses.fields(peft.LoraConfig) if f.init}
        for key in config:
            if key in _ALIASES.values():
                short = next(k for k, v in _ALIASES.items() if v == key)
                raise UserError(f"model.adapter.{key} is written model.adapter.{short} here; set model.adapter.{short}={config[key]}")
            if key not in fields:
                raise UserError(
                    f"model.adapter.{key}: {key!r} is not a peft LoraConfig key{close_matches(key, [*fields, *_ALIASES])}; "
                    f"use r, alpha, dropout, target_modules or another LoraConfig field"
                )
        self.keys: dict[str, Any] = plain({"r": r, "lora_alpha": alpha, "lora_dropout": dropout, "target_modules": target_modules, **config})
        self._lora_config(self.keys)  # peft's own checks of the values, now

    def _lora_config(self, keys: dict[str, Any]) -> Any:
        try:
            return peft.LoraConfig(**keys)
        except (ValueError, TypeError) as err:
            raise UserError(f"model.adapter: {one_line(str(err))}; fix that key of model/adapter={self.name}") from None

    def config(self) -> dict[str, Any]:
        """What a checkpoint records of the adapter: its option and its keys."""
        return {"option": self.name, **self.keys}

    def apply(self, net: nn.Module) -> nn.Module:
        """``net`` with the adapters added and everything else frozen (peft's ``get_peft_model``)."""
        keys = dict(self.keys)
        if "task_type" not in keys and _is_transformers(net):
            keys["task_type"] = "CAUSAL_LM"  # PeftModelForCausalLM, as peft's from_pretrained will build it
        config = self._lora_config(keys)
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_PEFT_NOISE, category=FutureWarning)
                return peft.get_peft_model(net, config)
        except (ValueError, NotImplementedError) as err:
            if "target_modules" not in str(err) and "Target modules" not in str(err):
                raise UserError(f"model.adapter: {one_line(str(err))}; fix that key of model/adapter={self.name}") from None
            names = sorted({n.rsplit(".", 1)[-1] for n, m in net.named_modules() if isinstance(m, nn.Linear)})
            raise UserError(
                f"model.adapter.target_modules={keys['target_modules']}: {one_line(str(err)).rstrip('.')}; "
                f"name modules of {type(net).__name__}, e.g. any of its Linear layers: {', '.join(names)}"
            ) from None


class QLoRA(LoRA):
    """LoRA over a base whose block Linear weights are torchao NF4 (QLoRA; torchtune's QLoRA).

    Args:
        block_size: values per NF4 scaler (QLoRA: 64).
        scaler_block_size: scalers per int8 double-quantization block (QLoRA: 256).
        quantize_modules: None: every Linear inside the transformer blocks; or the names of
            those to quantize (as ``target_modules``), e.g. to leave out one whose size
            ``to_nf4`` cannot take.
        r, alpha, dropout, target_modules, config: as :class:`LoRA`.
    """

    name = "qlora"

    def __init__(
        self,
        r: int = 8,
        alpha: float = 16,
        dropout: float = 0.0,
        target_modules: Any = None,
        block_size: int = 64,
        scaler_block_size: int = 256,
        quantize_modules: list[str] | None = None,
        **config: Any,
    ) -> None:
        super().__init__(r, alpha, dropout, target_modules, **config)
        for key, value in (("block_size", block_size), ("scaler_block_size", scaler_block_size)):
            if not isinstance(value, int) or value < 1:
                raise UserError(f"model.adapter.{key}={value!r} is not a positive whole number; QLoRA uses block_size=64, scaler_block_size=256")
        load_to_nf4()  # a missing torchao is said now, before any run
        self.block_size, self.scaler_block_size = block_size, scaler_block_size
        self.quantize_modules = plain(quantize_modules)

    def config(self) -> dict[str, Any]:
        quantized = {"block_size": self.block_size, "scaler_block_size": self.scaler_block_size, "quantize_modules": self.quantize_modules}
        return {**super().config(), **quantized}

    def apply(self, net: nn.Module) -> nn.Module:
        """Quantize the block Linears (only check their shapes on the meta device), then add the adapters."""
        quantize_nf4(net, self.block_size, self.scaler_block_size, self.quantize_modules)
        return super().apply(net)


def _is_transformers(net: nn.Module) -> bool:
    return any(c.__module__.startswith("transformers.") and c.__name__ == "PreTrainedModel" for c in type(net).__mro__)
