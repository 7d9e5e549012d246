"""Checkpoints of a fine-tune: the trainable state, and a record of the frozen base they need.

A fine-tune's frozen base is nearly all of the model and is never written, so a checkpoint
holding it would be mostly a copy of weights the user already has (a 70B base: 35-140 GB
per save). :class:`FrozenBase` serves the task's checkpoint hooks:

- on save, the frozen parameters' entries leave ``checkpoint["state_dict"]`` (buffers and
  adapters stay; the optimizer, loop, loader and RNG state are Lightning's as always), and
  ``checkpoint["finetune"]`` records the base: its ``pretrained_path``, its config, the
  adapter's keys, the state-dict keys left out, and the sha256 of the frozen tensors as
  loaded (their stored bytes: an NF4 weight's codes and scalers), hashed once per fit, in the task's
  ``setup("fit")``: before a strategy splits the model over ranks (``gpipe_distributed``),
  so every rank knows the whole base's hash;
- on load, a checkpoint of another base is refused in one line, and the frozen entries are
  put back from the model's own tensors, so Lightning's strict loading sees every key
  (copying a tensor onto itself costs nothing).

A strategy that gathers the checkpoint from several ranks asks :func:`left_out_of_checkpoint`
first, so the frozen base does not cross the wire at every save.

:func:`base_keys` tells the pre-run checkpoint check which absent keys are the base's.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from lightning_accel.config.errors import UserError
from lightning_accel.stored import plain_parts

FINETUNE_KEY = "finetune"
# peft's wrapping, left out of the names the hash reads: the base's own names
_PEFT_NAMES = re.compile(r"base_model\.model\.|\.base_layer(?=\.)")


def frozen_entries(module: nn.Module) -> dict[str, Tensor]:
    """``module``'s frozen parameters by every state-dict key they appear under (tied ones twice)."""
    return {name: p for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


def fingerprint(module: nn.Module) -> str | None:
    """sha256 of the frozen parameters' names (without peft's wrapping), types, dtypes, shapes and
    stored bytes, in name order; None on the meta device (nothing to hash)."""
    frozen = sorted((_PEFT_NAMES.sub("", n), p) for n, p in module.named_parameters() if not p.requires_grad)
    digest = hashlib.sha256()
    for name, param in frozen:
        digest.update(f"{name}:{type(param.data).__name__}".encode())
        for part in plain_parts(param.detach()):
            if part.is_meta:
                return None
            digest.update(f":{part.dtype}{tuple(part.shape)}".encode())
            digest.update(_bytes(part).numpy())
    return digest.hexdigest()


def _bytes(tensor: Tensor) -> Tensor:
    """``tensor``'s bytes as a flat uint8 CPU tensor (bf16 has no numpy dtype; its bytes do)."""
    flat = tensor.detach().cpu().reshape(-1)
    if flat.numel() and flat.stride(0) != 1:  # a strided view, or one element viewed out of a larger tensor
        flat = flat.clone(memory_format=torch.contiguous_format)
    return flat.view(torch.uint8)


def left_out_of_checkpoint(module: nn.Module) -> set[str]:
    """The state-dict keys ``module``'s checkpoints leave out (its frozen base's, when it is a fine-tune with a
    :class:`FrozenBase` as ``module.frozen_base``): a strategy that gathers a checkpoint from several ranks skips them."""
    return set(frozen_entries(module)) if isinstance(getattr(module, "frozen_base", None), FrozenBase) else set()


def base_keys(checkpoint: Mapping[str, Any]) -> set[str]:
    """The state-dict keys a fine-tune checkpoint left out because they are the frozen base's."""
    record = checkpoint.get(FINETUNE_KEY)
    return set(record.get("keys", ())) if isinstance(record, Mapping) else set()


def adapter_option(checkpoint: Mapping[str, Any]) -> str | None:
    """``model/adapter=lora`` (the option a fine-tune checkpoint was trained with), or None."""
    record = checkpoint.get(FINETUNE_KEY)
    option = record.get("adapter", {}).get("option") if isinstance(record, Mapping) else None
    return f"model/adapter={option}" if option else None


def _named(record: Mapping[str, Any]) -> str:
    path = record.get("pretrained_path")
    return f"pretrained_path={path}" if path else "a random base built from model.net.config and seed"


class FrozenBase:
    """What a fine-tune's checkpoints say about its base; one per task.

    Args:
        net: the base as built, before the adapter (its ``name_or_path`` and ``config``
            are recorded: transformers models have both).
        adapter: the adapter's option and keys.
    """

    def __init__(self, net: nn.Module, adapter: Mapping[str, Any]) -> None:
        config = getattr(net, "config", None)
        self.pretrained_path = str(getattr(net, "name_or_path", "") or "") or None
        self.config = config.to_dict() if hasattr(config, "to_dict") else None
        self.adapter = dict(adapter)
        self._sha256: str | None = None

    def sha256(self, module: nn.Module) -> str | None:
        """The frozen base's hash, computed on the first call of a fit."""
        if self._sha256 is None:
            self._sha256 = fingerprint(module)
        return self._sha256

    def forget(self) -> None:
        """Hash again on the next save or load (called when a fit ends)."""
        self._sha256 = None

    def save(self, module: nn.Module, checkpoint: dict[str, Any]) -> None:
        """Drop the frozen entries from ``checkpoint["state_dict"]`` and record the base."""
        state = checkpoint["state_dict"]
        dropped = sorted(frozen_entries(module))  # a pipeline's strategy may not have gathered them at all
        for key in dropped:
            state.pop(key, None)
        checkpoint[FINETUNE_KEY] = {
            "pretrained_path": self.pretrained_path,
            "config": self.config,
            "sha256": self.sha256(module),
            "adapter": self.adapter,
            "keys": dropped,
        }

    def load(self, module: nn.Module, checkpoint: dict[str, Any]) -> None:
        """Refuse a checkpoint of another base; put the frozen entries back from ``module``'s tensors."""
        record = checkpoint.get(FINETUNE_KEY)
        if not isinstance(record, Mapping):
            return  # every tensor is in it (written without an adapter): Lightning loads it as it is
        here = self.sha256(module)
        there = record.get("sha256")
        if here is not None and there is not None and here != there:
            mine = {"pretrained_path": self.pretrained_path}
            raise UserError(
                f"the checkpoint's adapters were trained on another base: sha256 {there[:16]} ({_named(record)}) there, "
                f"{here[:16]} ({_named(mine)}) here; resume with the base it names"
                + (f": model.net.pretrained_path={record['pretrained_path']}" if record.get("pretrained_path") else "")
            )
        state = checkpoint["state_dict"]
        for key, param in frozen_entries(module).items():
            state.setdefault(key, param.detach())
