"""The block structure every zoo network declares.

Strategies that move or split a network block by block (L2L CPU offload keeps one
block on the accelerator at a time; GPipe cuts the block list into pipeline stages)
must know where the repeated blocks are without reading each model's ``forward``.
Zoo networks therefore expose three submodules whose composition *is* their forward:

    net(x) == net.post(net.blocks[-1](... net.blocks[0](net.pre(x)) ...))

``pre`` is everything before the repeated blocks (embeddings, a conv stem), ``blocks``
is an ``nn.ModuleList`` in execution order whose members each take and return ONE
tensor, and ``post`` is everything after (final norm and head). ``pre`` and ``post``
may share parameters (GPT ties its token embedding to its output head), so a strategy
that places them on different devices must handle the shared tensor once.

User networks need not follow this protocol; the training tasks accept any
``nn.Module``. Only the block-wise strategies call :func:`require_block_network`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor, nn


@runtime_checkable
class BlockNetwork(Protocol):
    """A network whose forward is ``post(blocks[-1](...blocks[0](pre(x))))``.

    ``isinstance(net, BlockNetwork)`` checks only that the three attributes exist;
    :func:`require_block_network` also checks their types.
    """

    pre: nn.Module
    blocks: nn.ModuleList
    post: nn.Module

    def __call__(self, x: Tensor) -> Tensor: ...


def require_block_network(net: nn.Module, needed_by: str) -> BlockNetwork:
    """Return ``net`` typed as a :class:`BlockNetwork`, or raise saying what is missing.

    ``needed_by`` names the caller (e.g. ``"the l2l strategy"``) so the error tells the
    user which feature demanded the structure.
    """
    name = type(net).__name__
    hint = (
        "give it `pre`, `blocks` (an nn.ModuleList) and `post` submodules whose composition "
        "is its forward (see lightning_accel.models.blocks), or use a zoo model"
    )
    for attr in ("pre", "blocks", "post"):
        if not isinstance(getattr(net, attr, None), nn.Module):
            raise TypeError(f"{needed_by} needs a block network, but {name} has no nn.Module `{attr}`; {hint}")
    blocks = getattr(net, "blocks")
    if not isinstance(blocks, nn.ModuleList):
        raise TypeError(
            f"{needed_by} needs a block network, but {name}.blocks is a {type(blocks).__name__}, "
            f"not an nn.ModuleList; {hint}"
        )
    if len(blocks) == 0:
        raise TypeError(f"{needed_by} needs a block network, but {name}.blocks is empty; {hint}")
    return net  # type: ignore[return-value]  # structure checked above


def block_classes(net: BlockNetwork) -> tuple[type[nn.Module], ...]:
    """The distinct classes in ``net.blocks``, in order of first appearance.

    Offload and checkpointing policies (e.g. FSDP auto-wrap) take "wrap every module
    of these classes"; this gives them the list without naming model internals.
    """
    return tuple(dict.fromkeys(type(block) for block in net.blocks))


def run_blocks(net: BlockNetwork, x: Tensor) -> Tensor:
    """Compute ``net(x)`` the way a block-wise strategy does: pre, each block, post.

    This is the reference a strategy's output must match; it equals ``net(x)`` exactly
    for every zoo network.
    """
    h = net.pre(x)
    for block in net.blocks:
        h = block(h)
    return net.post(h)
