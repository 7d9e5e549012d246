"""Mixture-of-experts router losses under micro-batching: what a pipeline computes, said once.

transformers' MoE models (Mixtral, Qwen3-MoE, ...) with ``config.output_router_logits=True``
add a load-balancing loss that depends on which tokens share a forward: the fraction of
tokens each expert receives, over the whole call. A pipeline that splits the batch into
micro-batches computes it per micro-batch, as Megatron does, so a step equals plain
training accumulating the same micro-batches, not one whole-batch step (a Mixtral here:
3.6e-2 apart after 2 steps at chunks=2, 0.0 from the accumulated reference). The pipeline
strategies keep that convention and say it once (:func:`router_loss_notice`).
"""

from __future__ import annotations

from torch import nn


def router_loss_config(net: nn.Module) -> str | None:
    """``net``'s config class name when it adds a router load-balancing loss (``output_router_logits=True``), else None."""
    for module in net.modules():
        config = getattr(module, "config", None)
        if getattr(config, "output_router_logits", False) is True:
            return type(config).__name__
    return None


def router_loss_notice(owner: str, net: nn.Module, chunks: int) -> str | None:
    """The one line a pipeline of ``chunks`` micro-batches says about ``net``'s router loss, or None (no such loss)."""
    config = router_loss_config(net)
    if config is None or chunks <= 1:
        return None
    return (
        f"{owner}(chunks={chunks}): {config}.output_router_logits=True adds the router's load-balancing loss, which depends "
        f"on the tokens of one forward; it is computed per micro-batch (as Megatron does), so a step equals plain Lightning "
        f"accumulating {chunks} micro-batches, not one whole-batch step; chunks=1 keeps the whole batch's"
    )
