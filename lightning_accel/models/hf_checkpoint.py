"""What a save_pretrained directory holds, checked without loading it.

``model.net.pretrained_path`` is refused in one line before any weight is read: a path
that is not a directory, a missing or unreadable ``config.json``, no weights file (the
names transformers 5 looks for, in its order), a shard index naming a missing shard, a
safetensors header that does not parse (a truncated or corrupt file: only the header is
read). :func:`unloaded` then names what ``from_pretrained`` would leave unloaded, without
reading a weight: transformers' own loading loop run on meta tensors of the checkpoint's
shapes, into the model its ``config.json`` builds on the meta device. The pre-run check
and the real load (``output_loading_info``) so refuse the same directories, in the same
line (:func:`refuse`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import convert_and_load_state_dict_in_model
from transformers.modeling_utils import LoadStateDictConfig
from transformers.utils import logging as hf_logging

from lightning_accel.config.errors import UserError, one_line

# transformers 5's choice when several are present (modeling_utils._get_resolved_checkpoint_files)
WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
_SAVE_AGAIN = "write it again with save_pretrained"

Shape = tuple[int, ...]


def where(path: Path) -> str:
    return f"model.net.pretrained_path={str(path)!r}"


def read_config(path: Path) -> dict[str, Any]:
    """``config.json`` of the directory ``path``, with its ``model_type``."""
    if not path.exists():
        raise UserError(f"{where(path)} does not exist; point it at a directory written by save_pretrained (nothing is downloaded)")
    if not path.is_dir():
        raise UserError(f"{where(path)} is a file, not a directory; point it at the directory save_pretrained wrote")
    file = path / "config.json"
    if not file.is_file():
        raise UserError(f"{where(path)} has no config.json; point it at a directory written by save_pretrained (nothing is downloaded)")
    try:
        config = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as err:  # JSONDecodeError is a ValueError
        raise UserError(f"{where(path)}: config.json is not valid JSON ({err}); {_SAVE_AGAIN}") from None
    if not isinstance(config, dict) or not config.get("model_type"):
        raise UserError(f"{where(path)}: config.json has no model_type; {_SAVE_AGAIN} (it records the architecture)")
    return config


def weight_files(path: Path) -> list[Path]:
    """The files ``from_pretrained`` would read: the one weights file, or every shard its index names."""
    name = next((n for n in WEIGHTS if (path / n).is_file()), None)
    if name is None:
        raise UserError(f"{where(path)} has no weights file ({', '.join(WEIGHTS)}); save the model into it with save_pretrained")
    if not name.endswith(".index.json"):
        return [path / name]
    try:
        shards = sorted(set(json.loads((path / name).read_text())["weight_map"].values()))
    except (ValueError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
        raise UserError(f"{where(path)}: {name} is not a shard index (JSON with a weight_map); {_SAVE_AGAIN}") from None
    missing = [s for s in shards if not (path / s).is_file()]
    if missing:
        raise UserError(
            f"{where(path)}: {name} names {missing[0]}, which is not in the directory ({len(missing)} of {len(shards)} "
            "shards missing); copy every shard into it, or write it again with save_pretrained"
        )
    return [path / s for s in shards]


def tensor_shapes(path: Path, files: list[Path]) -> dict[str, Shape]:
    """Every tensor's name and shape, from the safetensors headers (or a ``.bin``'s pickle, on meta)."""
    shapes: dict[str, Shape] = {}
    for file in files:
        try:
            if file.suffix == ".safetensors":
                with safe_open(str(file), framework="pt") as f:  # reads the header only
                    shapes.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
            else:
                state = torch.load(file, map_location="meta", weights_only=True, mmap=True)
                shapes.update({k: tuple(v.shape) for k, v in state.items()})
        except Exception as err:
            raise UserError(
                f"{where(path)}: {file.name} cannot be read, truncated or corrupt ({one_line(str(err))[:120]}); "
                f"copy it again, or {_SAVE_AGAIN}"
            ) from None
    return shapes


def unloaded(model: Any, shapes: dict[str, Shape]) -> tuple[set[str], set[str], set[tuple[str, Shape, Shape]]]:
    """``(missing, unexpected, mismatched)`` as ``from_pretrained(..., output_loading_info=True)``
    reports them, for a checkpoint of ``shapes`` loaded into ``model`` (on the meta device).

    transformers 5's own loading loop runs on meta tensors of those shapes, so every rule is
    its own: key renamings and the base-model prefix, the conversions that fuse a MoE's
    per-expert tensors (a missing expert is a conversion error), tied weights present through
    either end, the keys a model marks ignorable. Nothing is read or allocated.
    """
    state = {k: torch.empty(shape, device="meta") for k, shape in shapes.items()}
    config = LoadStateDictConfig(device_map={"": "meta"}, weight_mapping=get_model_conversion_mapping(model), ignore_mismatched_sizes=True)
    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # "Loading weights" would tell a user that something loads
    try:
        info, _ = convert_and_load_state_dict_in_model(model, state, config)
    finally:
        if bar:
            hf_logging.enable_progress_bar()
    model.tie_weights(missing_keys=info.missing_keys, recompute_mapping=False)  # re-ties the meta parameters
    model._adjust_missing_and_unexpected_keys(info)
    if info.conversion_errors:  # e.g. a MoE layer's experts that do not all stack
        key = sorted(info.conversion_errors)[0]
        info.missing_keys.add(key)
    return set(info.missing_keys), set(info.unexpected_keys), set(info.mismatched_keys)


def refuse(path: Path, keys: list[str], missing: set[str], unexpected: set[str], mismatched: set[Any]) -> None:
    """One line for the first problem of a load into a model of state-dict ``keys``, or nothing
    when every parameter comes from the checkpoint."""
    if mismatched:
        key, there, here = sorted(mismatched, key=lambda m: m[0])[0]
        raise UserError(
            f"{where(path)}: {key} is {tuple(there)} in the weights but {tuple(here)} in the model config.json builds "
            f"({len(mismatched)} of the model's {len(keys)} tensors differ); keep config.json and the weights from the same save_pretrained"
        )
    if missing:
        key = next(k for k in [*keys, *sorted(missing)] if k in missing)  # the first in the model's order
        raise UserError(
            f"{where(path)}: the weights have no {key} ({len(missing)} of the model's {len(keys)} tensors missing), which "
            "would train from random values; point it at the complete save_pretrained output"
        )
    if unexpected:
        key = sorted(unexpected)[0]
        raise UserError(
            f"{where(path)}: the weights hold {key}, which the model config.json builds does not have ({len(unexpected)} "
            "unknown tensors in all); keep config.json and the weights from the same save_pretrained"
        )
