"""Whether a model's children run as a chain: what lets a pipeline cut stages from a model with no block container.

A pipeline cuts a model into stages at its blocks. Where the model has no ``nn.ModuleList``/``nn.Sequential`` of
blocks (Lightning's own test models, many users' models: ``self.l1``, ``self.act``, ``self.l2`` called in turn), the
blocks are the fallback of ``"auto"`` that L2L offload streams (:func:`~lightning_accel.models.block_policy.find_blocks`
with ``children=True``: each direct child that has parameters), but a pipeline may cut there only where the forward runs
them as a chain: each called once, as one module, in the order the model registers them, each on what the one before
produced. That is proved from the forward's code, before any work, by tracing it symbolically (``torch.fx``) with the
children as leaves, on a shallow copy (attributes the forward sets, and its lists, dicts and sets, are the copy's). What
the trace cannot prove (a forward that branches on a tensor, calls a child twice or out of order, reads a child's
weights outside its call, or never calls one; a model with no forward of its own) is refused in one line naming
``blocks=``, the way to tell the pipeline where to cut.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Sequence

import torch.fx as fx
from torch import nn

from lightning_accel.models.block_policy import Block, find_blocks

__all__ = ["chained_children", "chain_break"]

# the forwards a model inherits without writing one: torch's (it raises) and Lightning's (it calls torch's)
_NOT_OWN = ("_forward_unimplemented", "Module.forward", "LightningModule.forward")


class _ChildTracer(fx.Tracer):
    """A tracer that keeps each of ``leaves`` as one call (and torch's own layers, as fx does)."""

    def __init__(self, leaves: set[str]) -> None:
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaves or super().is_leaf_module(m, module_qualified_name)


def _trace(net: nn.Module, leaves: set[str]) -> fx.Graph:
    shallow = copy.copy(net)  # the forward's own attribute writes land here; modules and parameters are shared
    for name, value in vars(net).items():  # and what it appends to its own lists, dicts and sets
        if name not in ("_modules", "_parameters", "_buffers") and isinstance(value, (list, dict, set)):
            vars(shallow)[name] = copy.copy(value)
    defaults = {name: p.default for name, p in inspect.signature(type(net).forward).parameters.items()
                if p.default is not inspect.Parameter.empty}  # as self(x) calls it: the branches its defaults take
    return _ChildTracer(leaves).trace(shallow, concrete_args=defaults or None)


def _depends(node: fx.Node, on: fx.Node) -> bool:
    seen, todo = set(), [node]
    while todo:
        current = todo.pop()
        for source in current.all_input_nodes:
            if source is on:
                return True
            if source not in seen:
                seen.add(source)
                todo.append(source)
    return False


def chain_break(net: nn.Module, blocks: Sequence[Block]) -> str | None:
    """Why ``net``'s forward cannot be shown to run ``blocks`` as a chain (see the module doc), or None when it does."""
    names = [b.name for b in blocks]
    if type(net).forward.__qualname__ in _NOT_OWN:
        return "is not the model's own (its steps call the layers themselves: there is no call to micro-batch)"
    try:
        graph = _trace(net, set(names))
    except Exception as err:  # anything the symbolic trace cannot follow: nothing is proved
        first = (str(err).strip().splitlines() or [""])[0][:160]
        return f"could not be traced to check that ({type(err).__name__}: {first})"
    calls: dict[str, list[fx.Node]] = {n: [] for n in names}
    for node in graph.nodes:
        if node.op not in ("call_module", "get_attr"):
            continue
        owner = next((n for n in names if node.target == n or str(node.target).startswith(f"{n}.")), None)
        if owner is None:
            continue
        if node.op == "get_attr" or node.target != owner:
            return f"uses {node.target} outside a call of {owner}"
        calls[owner].append(node)
    for name in names:
        if len(calls[name]) != 1:
            return f"calls {name} {len(calls[name])} times" if calls[name] else f"never calls {name}"
    order = sorted(names, key=lambda n: list(graph.nodes).index(calls[n][0]))
    if order != names:
        first = next(i for i, (a, b) in enumerate(zip(order, names)) if a != b)
        return f"calls {order[first]} before {names[first]} (registered first)"
    for before, after in zip(names, names[1:]):
        if not _depends(calls[after][0], calls[before][0]):
            return f"calls {after} on something that does not come from {before}'s output"
    return None


def chained_children(net: nn.Module, owner: str, no_container: str) -> list[Block]:
    """The fallback blocks of ``net`` (each direct child with parameters) when its forward runs them as a chain;
    otherwise ``ValueError`` in one line: ``no_container`` (why ``"auto"`` found no block container), the reason, the fix.
    """
    blocks = find_blocks(net, "auto", stacks="all", children=True)
    reason = chain_break(net, blocks)
    if reason is None:
        return blocks
    listed = ", ".join(b.name for b in blocks)
    raise ValueError(
        f"{owner}: {no_container.split(';')[0]}, and its children with parameters ({listed}) cannot be cut into pipeline "
        f"stages: {type(net).__name__}.forward {reason}; pass blocks=<the classes of the modules to cut at>, e.g. "
        f"blocks=[{type(blocks[0].module).__name__!r}], or a callable returning them in the order the forward runs them"
    )
