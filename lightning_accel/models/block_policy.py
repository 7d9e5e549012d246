"""Choosing a model's repeated blocks: by class, ``"auto"``, or a callable.

L2L offload streams a model block by block and GPipe cuts it into stages at block
boundaries; both need the same answer to "which submodules are the blocks?", for any
``nn.Module``, not only zoo networks. The policy is decided once, here, and the
mechanisms receive plain data: the blocks' qualified names and modules, in execution
order (registration order, which is forward order for every ModuleList-style model).

Policies:
- a set of module classes (or class names / dotted paths, as a Hydra config gives them):
  every outermost submodule of one of those classes;
- ``"auto"``: the children of the longest ``nn.ModuleList``/``nn.Sequential`` whose
  children all share one class (GPT's ``blocks``, a ResNet stage list, an MLP stack);
- a callable ``model -> iterable of submodules``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Union

from torch import nn

BlockPolicy = Union[str, Iterable[Union[type, str]], Callable[[nn.Module], Iterable[nn.Module]]]


@dataclass(frozen=True)
class Block:
    """One block: its qualified name in the model and the module itself."""

    name: str
    module: nn.Module


def _class_name(cls: type) -> str:
    return cls.__qualname__


def _resolve_classes(model: nn.Module, policy: Iterable[type | str]) -> tuple[type, ...]:
    present = {type(m).__qualname__: type(m) for m in model.modules()}
    classes: list[type] = []
    for entry in policy:
        if isinstance(entry, type):
            classes.append(entry)
        elif "." in entry:
            module_name, _, attr = entry.rpartition(".")
            classes.append(getattr(importlib.import_module(module_name), attr))
        elif entry in present:
            classes.append(present[entry])
        else:
            raise ValueError(
                f"block class {entry!r} is not used in {type(model).__name__} (its module classes: "
                f"{', '.join(sorted(present))}); name one of them, or pass blocks='auto'"
            )
    return tuple(classes)


def _auto(model: nn.Module) -> list[Block]:
    best: tuple[int, int, str, nn.Module] | None = None
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(module) < 2:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        key = (len(module), size)
        if best is None or key > best[:2]:
            best = (len(module), size, name, module)
    if best is None:
        return []
    _, _, prefix, container = best
    return [Block(f"{prefix}.{i}" if prefix else str(i), child) for i, child in enumerate(container)]


def find_blocks(model: nn.Module, policy: BlockPolicy = "auto") -> list[Block]:
    """The blocks of ``model`` under ``policy``, in execution order.

    Raises ``ValueError`` naming the model, the policy and the fix when there are none.
    """
    names = {id(m): n for n, m in model.named_modules()}
    if isinstance(policy, str) and policy == "auto":
        blocks = _auto(model)
        described = "'auto' (the longest ModuleList of one class)"
    elif callable(policy) and not isinstance(policy, type):
        chosen = list(policy(model))  # type: ignore[operator]
        unknown = [type(m).__name__ for m in chosen if id(m) not in names]
        if unknown:
            raise ValueError(f"the block callable returned modules that are not in the model ({', '.join(unknown)}); return submodules of the model")
        blocks = [Block(names[id(m)], m) for m in chosen]
        described = f"callable {getattr(policy, '__name__', policy)!r}"
    else:
        entries = [policy] if isinstance(policy, (str, type)) else list(policy)  # type: ignore[list-item]
        classes = _resolve_classes(model, entries)
        blocks = []
        inside: tuple[str, ...] = ()
        for name, module in model.named_modules():
            if any(name.startswith(f"{outer}.") for outer in inside):
                continue  # only outermost matches: a block's own sub-blocks stay inside it
            if isinstance(module, classes):
                blocks.append(Block(name, module))
                inside = (*inside, name)
        described = f"classes {', '.join(_class_name(c) for c in classes)}"
    if not blocks:
        raise ValueError(
            f"no blocks found in {type(model).__name__} under {described}; pass blocks=<the repeated "
            "block class>, e.g. blocks=['GPTBlock'], or a callable returning the block modules"
        )
    if len({id(b.module) for b in blocks}) != len(blocks):
        raise ValueError("the block policy returned the same module twice; each block must appear once")
    return blocks


def resident_modules(model: nn.Module, blocks: Sequence[Block]) -> list[str]:
    """Names of the parameters outside every block (embeddings, head, norms)."""
    in_block = {id(p) for b in blocks for p in b.module.parameters()}
    return [n for n, p in model.named_parameters() if id(p) not in in_block]
