"""A mixture-of-experts router loss across pipeline ranks: each stage carries its layers' router statistics forward.

transformers' MoE models (Mixtral, Qwen3-MoE, ...) with ``output_router_logits=True`` add
``load_balancing_loss_func(router_logits, E, k, attention_mask)`` to the loss: ``E * sum_e f_e * P_e``,
where ``f_e`` is the fraction of (token, top-k slot) assignments routed to expert ``e`` and ``P_e`` the
mean router probability of ``e``, both over ALL layers' tokens together. It is not a sum of per-layer
losses, so a stage cannot add its own part. But its inputs are sums: per expert the top-k counts and the
router probabilities, and the (masked) token count, accumulated layer after layer. So each stage adds
its own layers' sums to what the previous stage sent and sends the result on, one float32 tensor
``[counts (E), probabilities (E), tokens (1)]`` beside the block output; the probability part keeps its
autograd graph, so the loss's gradient flows back through the sends to every stage's router. On the
last stage the model's own forward calls its module's ``load_balancing_loss_func``, which is replaced,
for that forward only, by one that finishes the carried sums (:meth:`RouterCarry.micro_batch`).

The sums are transformers 5.24's own, in its order (layer by layer, float32, the attention mask
weighting tokens when given), so the loss equals the one-process model's on the same micro-batch
(``tests/strategies/test_gpipe_distributed_semantics.py``). Per micro-batch, as Megatron does; the
strategy says so once (:func:`lightning_accel.models.router_loss.router_loss_notice`).

Evaluation carries it too (:func:`lightning_accel.pipeline.evaluation.stream_evaluate`): each stage adds its
sums per micro-batch; the last stage, which runs the whole batch at once, starts from the earlier stages' sums
added over the micro-batches (sums over tokens), so a validation step's router loss is the whole batch's, over
every layer, as plain Lightning's.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from lightning_accel.patching import patch

__all__ = ["RouterCarry"]

LOSS_FUNCTION = "load_balancing_loss_func"


def _owner(net: nn.Module) -> nn.Module | None:
    """The module whose forward adds the router loss: config ``output_router_logits=True`` and a module-level
    :data:`LOSS_FUNCTION` where its class is defined (transformers' ``*ForCausalLM``)."""
    for module in net.modules():
        config = getattr(module, "config", None)
        if getattr(config, "output_router_logits", False) is True and hasattr(sys.modules[type(module).__module__], LOSS_FUNCTION):
            return module
    return None


def _router_class(owner: nn.Module) -> tuple[type, int] | None:
    """The router module class whose output ``index`` transformers records as ``router_logits``."""
    recorder = getattr(owner, "_can_record_outputs", None) or {}
    spec = recorder.get("router_logits") if isinstance(recorder, dict) else None
    target = getattr(spec, "target_class", None)
    return (target, int(getattr(spec, "index", 0))) if isinstance(target, type) else None


class RouterCarry:
    """The router statistics of one pipeline rank's stages (see the module doc). Build with :meth:`of`."""

    def __init__(self, owner: nn.Module, routers: Sequence[nn.Module], index: int) -> None:
        self.owner, self.index = owner, index
        self.experts, self.top_k = int(owner.num_experts), int(owner.num_experts_per_tok)
        self._logits: list[Tensor] | None = None  # router logits of this micro-batch's forward (None: not capturing)
        self._mask: Tensor | None = None
        self._handles = [r.register_forward_hook(self._record) for r in routers]
        # the mask as the model's call gets it; and as its base model's call does (a pipeline step that runs once a batch
        # calls the base model per micro-batch: lightning_accel.pipeline.whole_step)
        base = getattr(owner, "base_model", owner)
        for module in (owner, base) if isinstance(base, nn.Module) and base is not owner else (owner,):
            names = list(inspect.signature(module.forward).parameters)  # bound: without self, as a pre-hook's args
            position = names.index("attention_mask") if "attention_mask" in names else None
            self._handles.append(module.register_forward_pre_hook(
                lambda _m, args, kwargs, position=position: self._record_mask(args, kwargs, position), with_kwargs=True))

    @classmethod
    def of(cls, net: nn.Module) -> RouterCarry | None:
        """A carry for ``net`` when it adds a router loss (``output_router_logits=True``), else None; a model that adds
        one in a way this does not know (no ``num_experts``, no recorded router) is refused in one line."""
        owner = _owner(net)
        if owner is None:
            return None
        router = _router_class(owner)
        if router is None or not hasattr(owner, "num_experts") or not hasattr(owner, "num_experts_per_tok"):
            raise ValueError(
                f"{type(owner).__name__} adds a router load-balancing loss (output_router_logits=True) that the multi-process "
                "pipeline cannot carry between ranks (no recorded router_logits or num_experts); set "
                "config.output_router_logits=False, or use gpipe in one process"
            )
        cls_, index = router
        return cls(owner, [m for m in net.modules() if isinstance(m, cls_)], index)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def width(self) -> int:
        """Elements of the carried tensor: counts and probability sums per expert, and the token count."""
        return 2 * self.experts + 1

    def _record(self, _module: nn.Module, _args: Any, output: Any) -> None:
        logits = output[self.index] if isinstance(output, (tuple, list)) else output
        if self._logits is not None and not logits.is_meta:  # another stage's router run for shapes: not this stage's
            self._logits.append(logits)

    def _record_mask(self, args: tuple, kwargs: dict, position: int | None) -> None:
        if self._logits is None:
            return
        mask = kwargs.get("attention_mask")
        if mask is None and position is not None and len(args) > position:
            mask = args[position]
        self._mask = mask

    def _sums(self, carried: Tensor | None, device: torch.device) -> Tensor:
        """``carried`` (or zeros) plus this micro-batch's recorded layers, layer by layer as transformers sums them."""
        e, k = self.experts, self.top_k
        if carried is None:
            counts = torch.zeros(e, dtype=torch.float32, device=device)
            probs = torch.zeros(e, dtype=torch.float32, device=device)
            rows: Tensor | float = 0.0
        else:
            counts, probs, rows = carried[:e], carried[e : 2 * e], carried[2 * e]
        flat = None if self._mask is None else self._mask.reshape(-1).to(device=device, dtype=torch.float32)
        for logits in self._logits or []:
            weights = torch.nn.functional.softmax(logits.to(device), dim=-1)
            _, selected = torch.topk(weights, k, dim=-1)
            if flat is None:
                counts = counts + torch.histc(selected.reshape(-1).to(torch.float32), bins=e, min=0, max=e)
                probs = probs + weights.float().sum(dim=0)
                rows = rows + weights.shape[0]
            else:
                counts = counts + torch.zeros(e, dtype=torch.float32, device=device).scatter_add_(
                    0, selected.reshape(-1), flat.repeat_interleave(k))
                probs = probs + (weights.float() * flat.unsqueeze(-1)).sum(dim=0)
                rows = rows + flat.sum()
        rows_t = rows if isinstance(rows, Tensor) else torch.tensor(float(rows), device=device)
        return torch.cat([counts.detach(), probs, rows_t.reshape(1).to(torch.float32).detach()])

    def _loss(self, carried: Tensor | None, device: torch.device) -> Any:
        """What ``load_balancing_loss_func`` returns for the whole model: the carried sums and this stage's, finished."""
        sums = self._sums(carried, device)
        e = self.experts
        rows = sums[2 * e]
        return torch.sum((sums[:e] / rows) * (sums[e : 2 * e] / rows).unsqueeze(0)) * e

    @contextmanager
    def micro_batch(self, carried: Tensor | None, last: bool, device: torch.device) -> Iterator[_MicroBatch]:
        """One stage's forward of one micro-batch: its routers are recorded; on the ``last`` stage the model's router loss
        is the whole model's. ``carried``: the previous stage's sums (None on the first stage)."""
        self._logits, self._mask = [], None
        try:
            if not last:
                yield _MicroBatch(self, carried, device)
                return
            module = sys.modules[type(self.owner).__module__]
            own = getattr(module, LOSS_FUNCTION)

            def whole_model(gate_logits: Any, num_experts: int | None = None, top_k: int = 2, attention_mask: Any = None) -> Any:
                if gate_logits is None or not isinstance(gate_logits, tuple):
                    return own(gate_logits, num_experts, top_k, attention_mask)
                if attention_mask is not None:
                    self._mask = attention_mask
                return self._loss(carried, device)

            handle = patch(module, LOSS_FUNCTION, whole_model)
            try:
                yield _MicroBatch(self, carried, device)
            finally:
                handle.remove()
        finally:
            self._logits, self._mask = None, None


class _MicroBatch:
    """What a non-last stage sends on: its block output's tensors and the carried sums (:meth:`attach`)."""

    def __init__(self, carry: RouterCarry, carried: Tensor | None, device: torch.device) -> None:
        self.carry, self.carried, self.device = carry, carried, device

    def attach(self, output: Tensor | tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        tensors = (output,) if isinstance(output, Tensor) else tuple(output)
        return (*tensors, self.carry._sums(self.carried, self.device))
