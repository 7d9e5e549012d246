"""The model against the data it will be fed, from shapes, before the first step: :func:`check_data_fits`.

A GPT-2 with 64 learned positions fed 128-token windows, a ResNet built for one channel fed RGB images, or an embedding
of 100 rows fed bytes up to 255 all fail inside the forward, in torch's words (``IndexError: index out of range in
self``), after set-up, sometimes only at validation after a checkpoint was written. Each is knowable from numbers the
data module and the network (built on the meta device) already hold:

- the data's sequence length (``block_size``; ``seq_len`` of synthetic tokens) against the model's learned positions:
  a position table (an ``nn.Embedding`` named ``wpe`` / ``*position*``) or the limit a model enforces itself
  (``block_size``, litgpt's ``max_seq_length``); rotary models (Llama) have no table and no limit here;
- the data's symbols (``vocab_size``: 256 for bytes) against the rows of the model's input embedding;
- the data's channels (``input_shape[0]``) against the first convolution's ``in_channels``;
- the data's classes (``num_classes``) against the classifier's.

Each refusal names the data key and the model key (found in ``model.net``'s config by the value it holds) and both fixes.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from omegaconf import DictConfig, OmegaConf
from torch import nn

from lightning_accel.config.errors import UserError

__all__ = ["check_data_fits"]

_POSITION_KEYS = ("n_positions", "max_position_embeddings", "block_size", "max_seq_length", "n_ctx", "seq_length")
_VOCAB_KEYS = ("vocab_size", "padded_vocab_size", "n_vocab")
_CHANNEL_KEYS = ("in_channels", "num_channels", "in_chans")
_CLASS_KEYS = ("num_classes", "n_classes")


def _flat(node: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _flat(value, f"{prefix}.{key}")
    else:
        yield prefix, node


def _model_key(cfg: DictConfig, names: tuple[str, ...], value: int) -> str | None:
    """The key under ``model`` that set ``value`` (``model.net.config.n_positions``), or None."""
    model = cfg.get("model")
    if model is None:
        return None
    try:
        flat = dict(_flat(OmegaConf.to_container(model, resolve=True), "model"))
    except Exception:  # an interpolation that does not resolve here: name no key
        return None
    found = [k for k, v in flat.items() if k.rsplit(".", 1)[-1] in names and v == value]
    return min(found, key=len) if found else None


def _int_attr(obj: Any, name: str) -> int | None:
    value = getattr(obj, name, None)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _positions(net: nn.Module) -> int | None:
    """The most positions ``net`` can take: its own limit, or its learned position table's rows; None: no limit."""
    limits = [v for v in (_int_attr(net, "max_seq_length"), _int_attr(net, "block_size")) if v is not None]
    for name, module in net.named_modules():
        leaf = name.rsplit(".", 1)[-1].lower()
        if isinstance(module, nn.Embedding) and (leaf in ("wpe", "pos_emb") or "position" in leaf):
            limits.append(module.num_embeddings)
    return min(limits) if limits else None


def _input_embedding(net: nn.Module) -> nn.Embedding | None:
    get = getattr(net, "get_input_embeddings", None)
    try:
        found = get() if callable(get) else None
    except Exception:  # a transformers model without one (NotImplementedError)
        found = None
    if isinstance(found, nn.Embedding):
        return found
    return next((m for m in net.modules() if isinstance(m, nn.Embedding)), None)


def _first_conv(net: nn.Module) -> nn.modules.conv._ConvNd | None:
    return next((m for m in net.modules() if isinstance(m, nn.modules.conv._ConvNd)), None)


def _data_shapes(data: Any) -> dict[str, int]:
    """What the data module says it feeds: ``sequence``, ``vocab``, ``channels``, ``classes`` (the ones it knows)."""
    kind = getattr(data, "kind", None)  # SyntheticDataModule: one of images, tokens, arrays
    shapes: dict[str, int] = {}
    text = kind in (None, "tokens")
    if text and (length := _int_attr(data, "block_size") or _int_attr(data, "seq_len")) is not None:
        shapes["sequence"] = length
    if text and (vocab := _int_attr(data, "vocab_size")) is not None:
        shapes["vocab"] = vocab
    shape = getattr(data, "input_shape", None) if kind in (None, "images") else None
    if isinstance(shape, tuple) and len(shape) == 3:
        shapes["channels"] = int(shape[0])
    if kind in (None, "images") and (classes := _int_attr(data, "num_classes")) is not None:
        shapes["classes"] = classes
    return shapes


def _data_key(data: Any, *names: str) -> str:
    return next((f"data.{n}" for n in names if hasattr(data, n)), f"data.{names[0]}")


def check_data_fits(data: Any, module: Any, cfg: DictConfig) -> None:
    """Refuse a network (``module``'s ``net``, built on meta) that cannot take what ``data`` (the data module) feeds."""
    net = getattr(module, "net", None)
    net = net if isinstance(net, nn.Module) else module
    if not isinstance(net, nn.Module):
        return
    shapes = _data_shapes(data)
    if "sequence" in shapes and (limit := _positions(net)) is not None and shapes["sequence"] > limit:
        length, key = shapes["sequence"], _data_key(data, "block_size", "seq_len")
        model_key = _model_key(cfg, _POSITION_KEYS, limit) or "the model's positions"
        raise UserError(f"{key}={length}: the data's windows of {length} tokens exceed the {limit} positions "
                        f"{type(net).__name__} was built with ({model_key}={limit}); set {key}={limit} or less, "
                        f"or build the model with {model_key}={length}")
    embedding = _input_embedding(net) if "vocab" in shapes else None
    if embedding is not None and embedding.num_embeddings < shapes["vocab"]:
        vocab, rows = shapes["vocab"], embedding.num_embeddings
        model_key = _model_key(cfg, _VOCAB_KEYS, rows) or "the model's vocabulary"
        raise UserError(f"{model_key}={rows}: the model embeds {rows} symbols but the data has {vocab} "
                        f"({_data_key(data, 'vocab_size')}: ids up to {vocab - 1} would index past the embedding); "
                        f"set {model_key}={vocab}")
    conv = _first_conv(net) if "channels" in shapes else None
    if conv is not None and conv.in_channels != shapes["channels"]:
        channels, built = shapes["channels"], conv.in_channels
        model_key = _model_key(cfg, _CHANNEL_KEYS, built) or "the model's input channels"
        raise UserError(f"{model_key}={built}: the model's first convolution takes {built} channel(s) but the data's images "
                        f"have {channels} (input shape {tuple(getattr(data, 'input_shape', ()))}); set {model_key}={channels}")
    if "classes" in shapes:
        _check_classes(shapes["classes"], module, net, cfg)


def _check_classes(classes: int, module: Any, net: nn.Module, cfg: DictConfig) -> None:
    """A classifier with fewer outputs than the data has labels: a label past them fails the loss or the metric."""
    head = [m for m in net.modules() if isinstance(m, nn.Linear)]
    outputs = [v for v in (_int_attr(module, "num_classes"), head[-1].out_features if head else None) if v is not None]
    if not outputs or min(outputs) >= classes:
        return
    built = min(outputs)
    model_key = _model_key(cfg, _CLASS_KEYS, built) or "the model's classes"
    raise UserError(f"{model_key}={built}: the model scores {built} classes but the data has {classes} (data.num_classes="
                    f"{classes}: labels up to {classes - 1}); set {model_key}={classes}, or data.num_classes={built}")
