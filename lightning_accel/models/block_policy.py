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
  children all share one class (GPT's ``blocks``, transformers Llama's ``model.layers``,
  GPT-2's and litgpt's ``transformer.h``, a ResNet stage list, an MLP stack), ranked by
  (length, parameters). A mixed ``nn.Sequential`` (children of different classes, the
  classic torchgpipe / FairScale Pipe input; the model itself or a submodule) has each
  child as a block when no same-class container exists, or when the best one lies *inside*
  one of its children (then that container is a detail of one layer, e.g. a list of
  heads); the largest such Sequential (parameters, then length) is taken. A same-class
  container that is itself a child of a mixed Sequential still wins, as it splits finer:
  ``Sequential(embed, Sequential(*blocks), head)`` gives the blocks, the model or not;
- a callable ``model -> iterable of submodules``.

Blocks are named as the model registers them (``layer.mlp_1`` for an ``nn.Sequential(OrderedDict(mlp_1=...))``,
``stack.0`` for a list): the name under which ``named_modules`` and ``state_dict`` know the block.

``find_blocks(..., children=True)`` (what L2L offload asks for) lets ``"auto"`` fall back, where the model has no
container of blocks at all (Lightning's own test models, many users' models: a few layers as attributes), to *each
direct child that has parameters*, in registration order; a model whose only child with parameters is a wrapper
(``self.net = Net()``) is looked into, down to the first module with several such children. The parameters held
directly by the modules above them stay resident. ``gpipe`` cuts its stages there too, where the forward is shown to run
them as a chain (:mod:`lightning_accel.pipeline.child_chain`; refused in one line otherwise); ``gpipe_distributed`` still
refuses such a model with the candidates it found.

``find_blocks(..., stacks="all")`` (what L2L offload and QLoRA ask for) adds, under
``"auto"``, every other repeated stack of the model: a same-class container of two or more
children, outside the chosen one and not inside another stack's block, whose children are at
least half the size of the chosen container's (an encoder-decoder's encoder and decoder:
T5's ``encoder.block`` and ``decoder.block``, BART's and Whisper's ``encoder.layers`` and
``decoder.layers``; not a list of heads or per-codebook embeddings). They come in
registration order, which is forward order for these models: the encoder's blocks, then
the decoder's. ``gpipe`` asks for them too (its stages are the model's own forward, so the encoder's output reaches
every decoder stage), and ``gpipe_distributed`` (its stages carry the encoder's last block output on to every later
stage: :mod:`lightning_accel.pipeline.stack_carry`).
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
            found = getattr(importlib.import_module(module_name), attr)
            if not (isinstance(found, type) and issubclass(found, nn.Module)):
                what = "a function" if callable(found) and not isinstance(found, type) else f"a {type(found).__name__}"
                raise ValueError(f"block class {entry!r} is {what}, not an nn.Module class; name the repeated block's class, or pass blocks='auto'")
            classes.append(found)
        elif entry in present:
            classes.append(present[entry])
        else:
            raise ValueError(
                f"block class {entry!r} is not used in {type(model).__name__} (its module classes: "
                f"{', '.join(sorted(present))}); name one of them, or pass blocks='auto'"
            )
    return tuple(classes)


def _containers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (nn.ModuleList, nn.Sequential))]


def _uniform(container: nn.Module) -> bool:
    return len({type(child) for child in container}) == 1


def _size(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _inside_a_child(inner: str, outer: str) -> bool:
    """Whether ``inner`` lies strictly inside one child of the container ``outer``."""
    prefix = f"{outer}." if outer else ""
    return inner.startswith(prefix) and "." in inner[len(prefix):]


def _stacks(model: nn.Module, chosen: str, container: nn.Module) -> list[str]:
    """The names of ``model``'s repeated stacks, ``chosen`` among them, in registration order (see the module doc)."""
    per_child = _size(container) / len(container)
    names = [chosen]
    for name, other in _containers(model):
        if len(other) < 2 or not _uniform(other) or _size(other) / len(other) < per_child / 2:
            continue
        if any(name == n or name.startswith(f"{n}.") or n.startswith(f"{name}.") for n in names):
            continue  # the chosen stack itself, one inside a block of it, or one around it
        names.append(name)
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted(names, key=order.__getitem__)


def _auto(model: nn.Module, stacks: str = "one") -> list[Block]:
    candidates = [(n, m) for n, m in _containers(model) if len(m) >= 2]
    uniform = [(n, m) for n, m in candidates if _uniform(m)]
    mixed = [(n, m) for n, m in candidates if isinstance(m, nn.Sequential) and not _uniform(m)]
    best = max(uniform, key=lambda c: (len(c[1]), _size(c[1])), default=None)
    # mixed Sequentials (the model itself included) that beat the best same-class container: none exists,
    # or it is a detail inside one of their children
    eligible = [c for c in mixed if best is None or _inside_a_child(best[0], c[0])]
    outer = max(eligible, key=lambda c: (_size(c[1]), len(c[1])), default=None)
    chosen = outer if outer is not None else best
    if chosen is None:
        return []
    prefixes = [chosen[0]] if stacks == "one" or chosen is not best else _stacks(model, *chosen)
    modules = dict(model.named_modules())
    return [Block(f"{prefix}.{name}" if prefix else name, child) for prefix in prefixes
            for name, child in modules[prefix]._modules.items() if child is not None]  # (repeats kept: refused below)


def _children_with_parameters(model: nn.Module) -> list[Block]:
    """The fallback of ``"auto"`` (``children=True``): each direct child that has parameters, looking through a chain
    of single wrappers that hold no parameters of their own."""
    prefix, module = "", model
    while True:
        holding = [(n, c) for n, c in module.named_children() if any(True for _ in c.parameters())]
        own = any(True for _ in module.parameters(recurse=False))
        if len(holding) == 1 and not own and any(True for _ in holding[0][1].children()):
            name, module = holding[0]
            prefix = f"{prefix}{name}."
            continue
        return [Block(f"{prefix}{n}", c) for n, c in holding]


def _candidates_line(model: nn.Module) -> str:
    seen = _containers(model)
    if not seen:
        return "candidates: none (the model has no nn.ModuleList or nn.Sequential)"
    shown = [
        f"{n or '<model>'} ({type(m).__name__}, {len(m)} child{'' if len(m) == 1 else 'ren'}"
        f"{'' if len(m) < 2 or _uniform(m) else ', mixed classes'})"
        for n, m in seen[:8]
    ]
    more = f", and {len(seen) - 8} more" if len(seen) > 8 else ""
    return f"candidates: {', '.join(shown)}{more}"


def find_blocks(model: nn.Module, policy: BlockPolicy = "auto", stacks: str = "one", children: bool = False) -> list[Block]:
    """The blocks of ``model`` under ``policy``, in execution order; with ``stacks="all"``, ``"auto"`` takes every
    repeated stack (an encoder-decoder's both), ``"one"`` the largest; with ``children=True``, ``"auto"`` on a model
    without a container of blocks takes each direct child that has parameters (see the module doc).

    Raises ``ValueError`` naming the model, the policy and the fix when there are none.
    """
    if stacks not in ("one", "all"):
        raise ValueError(f"stacks={stacks!r}: use 'one' (a pipeline's single stack) or 'all' (every repeated stack)")
    names = {id(m): n for n, m in model.named_modules()}
    if isinstance(policy, str) and policy == "auto":
        blocks = _auto(model, stacks)
        if not blocks and children:
            blocks = _children_with_parameters(model)
        described = ("'auto' (the longest ModuleList/Sequential of one class, or a mixed nn.Sequential"
                     + (", else each child with parameters)" if children else ")"))
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
            f"no blocks found in {type(model).__name__} under {described}; {_candidates_line(model)}; "
            "pass blocks=<the repeated block class>, e.g. blocks=['GPTBlock'], or a callable returning the block modules"
        )
    first: dict[int, str] = {}
    for b in blocks:
        if id(b.module) in first:
            raise ValueError(
                f"blocks {first[id(b.module)]!r} and {b.name!r} are the same {type(b.module).__name__} object; each block "
                "must appear once (nn.Sequential(*[m] * n) repeats one module: build each layer separately)"
            )
        first[id(b.module)] = b.name
    return blocks


def resident_modules(model: nn.Module, blocks: Sequence[Block]) -> list[str]:
    """Names of the parameters outside every block (embeddings, head, norms)."""
    in_block = {id(p) for b in blocks for p in b.module.parameters()}
    return [n for n, p in model.named_parameters() if id(p) not in in_block]
