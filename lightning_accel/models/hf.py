"""Any transformers causal language model, built from a config or a local directory.

``model=hf_causal_lm`` trains a Hugging Face architecture (Llama, Qwen2, Mistral, GPT-2,
... any ``model_type`` with a causal-LM head) without downloading anything: either from a
config written in the recipe, with random weights (``AutoModelForCausalLM.from_config``),
or from a directory that ``save_pretrained`` wrote (``pretrained_path``, local files
only). The model comes back unchanged, so parameter names in checkpoints are
transformers' own and the strategies see the blocks transformers made.

transformers turns ``use_cache`` on by default; a training recipe sets ``use_cache:
false`` in its config (a forward that fills a KV cache only wastes memory in training).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_accel.config.errors import UserError, close_matches
from lightning_accel.host_memory import PeakRSS
from lightning_accel.models import load_peak
from lightning_accel.models.extras import import_extra, plain

transformers = import_extra("transformers", "hf", "model=hf_causal_lm")
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig  # noqa: E402
from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES  # noqa: E402

from lightning_accel.models.hf_checkpoint import read_config, refuse, tensor_shapes, unloaded, weight_files, where  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
# config.json names that transformers 5 still reads and converts (to rope_parameters, dtype)
_LEGACY_KEYS = {"rope_theta", "rope_scaling", "torch_dtype"}


def hf_causal_lm(
    config: Mapping[str, Any] | None = None,
    pretrained_path: str | None = None,
    dtype: str = "float32",
    attn_implementation: str | None = None,
    load_by_block: bool = False,
) -> nn.Module:
    """A transformers ``*ForCausalLM`` model; its forward returns ``CausalLMOutputWithPast``.

    Args:
        config: the architecture, as in a ``config.json``: ``model_type`` plus that
            config class's keys (``{"model_type": "llama", "hidden_size": 2048, ...}``).
            Weights are random (the model's own initializer, seeded by the run's seed).
        pretrained_path: a local directory written by ``save_pretrained`` (config and
            weights); nothing is downloaded. Leave ``config`` unset: the directory brings
            its own (a recipe's composition drops the recipe's own config for it:
            :mod:`lightning_accel.config.pretrained`). A directory whose files or tensor
            names would not load every parameter is refused in one line, on the meta
            device without reading a weight.
        dtype: parameter dtype, ``float32`` (default: what optimizers and the offload
            masters expect), ``bfloat16``, ``float16`` or ``float64``. Mixed precision is
            the trainer's job, not this one.
        attn_implementation: ``sdpa`` (transformers' default), ``eager``, ... passed on.
        load_by_block: with ``pretrained_path``, a model bigger than host memory: built on the meta device from
            ``config.json`` (its tensor names checked as above) and filled from the safetensors files one offload
            unit at a time by ``strategy=l2l_offload`` (with ``nvme_path``, the blocks that do not fit
            ``host_budget`` go to disk as they arrive: see docs/offload.md). The same weights as a plain load, bit
            for bit. Needs that strategy: any other would find the weights still on meta.
    """
    if dtype not in DTYPES:
        raise UserError(f"hf_causal_lm dtype={dtype!r} is not one of {', '.join(DTYPES)}{close_matches(dtype, DTYPES)}")
    kwargs: dict[str, Any] = {"dtype": DTYPES[dtype]}
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    if pretrained_path is not None:
        if config is not None:
            raise UserError(
                f"hf_causal_lm got both pretrained_path={pretrained_path!r} and a config; the directory brings its own "
                "config: set model.net.config=null"
            )
        if load_by_block:
            return _on_meta(Path(pretrained_path), kwargs)
        return _from_directory(Path(pretrained_path), kwargs)
    if load_by_block:
        raise UserError("hf_causal_lm load_by_block=true loads a pretrained_path; a model from a config is built on meta by "
                        "trainer.init_module(empty_init=True) under strategy=l2l_offload, or set model.net.load_by_block=false")
    if config is None:
        raise UserError("hf_causal_lm needs a config (model_type plus its keys) or a pretrained_path; set model.net.config")
    return AutoModelForCausalLM.from_config(make_config(config), **kwargs)


_ABSENT = object()


def directory_config(path: Path, given: Mapping[str, Any]) -> str:
    """The architecture the ``save_pretrained`` directory ``path`` holds, in words (``llama: 4 layers, hidden_size 128,
    vocab_size 256``), once every value in ``given`` (what the user set for ``model.net.config`` on the command line)
    agrees with its config.json; a value that does not is refused in one line naming both. The directory is checked as
    :func:`hf_causal_lm` checks it (exists, has a readable config.json with a model_type)."""
    raw = read_config(path)
    _check_model_type(str(raw["model_type"]), f"{where(path)}: config.json's model_type", "point it at a causal LM's save_pretrained output")
    loaded: PretrainedConfig | None = None
    for key, value in given.items():
        theirs = raw.get(key, (raw.get("rope_parameters") or {}).get(key, _ABSENT))  # transformers 5 keeps rope_theta there
        if theirs is _ABSENT:  # a default config.json leaves out, or a name the config class maps (gpt2's n_embd)
            loaded = loaded or AutoConfig.from_pretrained(path, local_files_only=True)
            theirs = getattr(loaded, key, _ABSENT)
        if theirs is _ABSENT:
            raise UserError(f"model.net.config.{key}={value!r} is not a key of the {raw['model_type']} config.json in "
                            f"{where(path)}; drop model.net.config.{key}: the directory's config is used as saved")
        if plain(theirs) != plain(value):
            raise UserError(f"model.net.config.{key}={value!r} contradicts {where(path)}, whose config.json has {key}={theirs!r}; "
                            f"drop model.net.config.{key} (the directory's config is used as saved), or point pretrained_path "
                            f"at a checkpoint saved with {key}={value!r}")
    shape = [f"{raw[k]} layers" if k.endswith("layers") or k == "n_layer" else f"{k} {raw[k]}"
             for k in ("num_hidden_layers", "n_layer", "hidden_size", "n_embd", "vocab_size") if k in raw]
    return f"{raw['model_type']}: {', '.join(shape)}" if shape else str(raw["model_type"])


def make_config(config: Mapping[str, Any]) -> PretrainedConfig:
    """The transformers config for ``{"model_type": ..., **keys}``; unknown keys are refused.

    transformers stores any keyword it does not know as an attribute and never reads it
    again, so a misspelt ``hidden_sizee`` would silently train the default width.
    """
    keys = plain(config)
    model_type = keys.pop("model_type", None)
    if model_type is None:
        raise UserError("hf_causal_lm config needs model_type (e.g. llama, qwen2, mistral, gpt2); set model.net.config.model_type")
    _check_model_type(model_type, "model_type")
    config_class = CONFIG_MAPPING[model_type]
    known = {f.name for f in dataclasses.fields(config_class)} | set(config_class.attribute_map) | _LEGACY_KEYS
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise UserError(
            f"{unknown[0]!r} is not a {config_class.__name__} key{close_matches(unknown[0], known)}; "
            f"check model.net.config.{unknown[0]} against the model's config.json"
        )
    return AutoConfig.for_model(model_type, **keys)


def _check_model_type(model_type: str, name: str, fix: str = "e.g. llama, qwen2, mistral, gpt2") -> None:
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        names = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
        raise UserError(
            f"{name}={model_type!r} has no causal-LM model in transformers {transformers.__version__}"
            f"{close_matches(str(model_type), names)}; {fix}"
        )


def _from_directory(path: Path, kwargs: dict[str, Any]) -> nn.Module:
    """The model a ``save_pretrained`` directory holds, its files checked first (:mod:`.hf_checkpoint`).

    Under a meta default device (the pre-run check) nothing is loaded: the model is built
    from ``config.json`` alone and the checkpoint's tensor names and shapes are matched
    against it. Otherwise the weights load in ``dtype`` (a bf16 directory loaded as bf16 is
    not even copied: the parameters map the safetensors file, copy-on-write), and a load
    that left a parameter random or a tensor unused is refused.
    """
    model_type = str(read_config(path)["model_type"])
    _check_model_type(model_type, f"{where(path)}: config.json's model_type", "point it at a causal LM's save_pretrained output")
    shapes = tensor_shapes(path, weight_files(path))
    if torch.get_default_device().type == "meta":
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path, local_files_only=True), **kwargs)
        refuse(path, list(model.state_dict()), *unloaded(model, shapes))
        return model
    try:
        with PeakRSS() as peak:
            model, info = AutoModelForCausalLM.from_pretrained(
                path, local_files_only=True, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs
            )
    except OSError as err:
        raise UserError(f"{where(path)}: {str(err).strip().splitlines()[0]}") from None
    except RuntimeError as err:  # its report, logged above, names the tensors
        if "conversion" not in str(err):
            raise
        raise UserError(f"{where(path)}: the weights do not convert into the model config.json builds (see the load report above); "
                        "keep config.json and the weights from the same save_pretrained") from None
    refuse(path, list(model.state_dict()), info["missing_keys"], info["unexpected_keys"], info["mismatched_keys"])
    load_peak.record(model, str(path), peak.added)  # the run prints it: the load's cost, not a guess
    # from_pretrained returns eval mode (for inference) and Lightning keeps the modes it finds,
    # so a fine-tune would run without its dropout; train mode, as from_config gives
    return model.train()


def _on_meta(path: Path, kwargs: dict[str, Any]) -> nn.Module:
    """The model of a ``save_pretrained`` directory on the meta device, marked to be filled from its safetensors
    files unit by unit (:func:`lightning_accel.offload.materialize.load_by_block`); its files checked first."""
    from lightning_accel.offload.materialize import load_by_block

    with torch.device("meta"):
        model = _from_directory(path, kwargs)
    try:
        return load_by_block(model, path).train()
    except ValueError as err:
        raise UserError(f"{where(path)}: {err}") from None
