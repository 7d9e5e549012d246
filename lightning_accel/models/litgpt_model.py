"""litgpt's GPT, built from one of litgpt's named configs or from a dict of Config fields.

``model=litgpt`` trains the decoder litgpt uses for all its architectures (Llama, Mistral,
Phi, Pythia, ...) with random weights: ``Config.from_name(name, **config)`` when a name is
given (the dict overrides its fields), ``Config(**config)`` otherwise. Its forward maps
token ids (B, T) to logits (B, T, padded_vocab_size): litgpt rounds the vocabulary up to
``padding_multiple`` (512 by default), so a byte-level corpus still trains, over a few
hundred never-seen classes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from torch import nn

from lightning_accel.config.errors import UserError, close_matches
from lightning_accel.models.extras import import_extra, plain

import_extra("litgpt", "hf", "model=litgpt")
from litgpt import GPT, Config  # noqa: E402
from litgpt.config import name_to_config  # noqa: E402


def litgpt_gpt(name: str | None = None, config: Mapping[str, Any] | None = None) -> nn.Module:
    """litgpt's ``GPT`` for a named config (``"Llama-3.2-1B"``, ``"pythia-14m"``) and/or Config fields."""
    fields = plain(config or {})
    known = {f.name for f in dataclasses.fields(Config)}
    unknown = [k for k in fields if k not in known]
    if unknown:
        raise UserError(
            f"{unknown[0]!r} is not a litgpt Config field{close_matches(unknown[0], known)}; "
            f"check model.net.config.{unknown[0]}"
        )
    if name is None:
        if not fields:
            raise UserError("litgpt_gpt needs a config name (model.net.name=pythia-14m) or Config fields (model.net.config)")
        return GPT(Config(**fields))
    if name not in name_to_config:
        raise UserError(
            f"model.net.name={name!r} is not a litgpt config{close_matches(name, name_to_config)}; "
            "litgpt.config.name_to_config lists them (e.g. Llama-3.2-1B, pythia-14m)"
        )
    return GPT(Config.from_name(name, **fields))
